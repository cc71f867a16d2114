"""QK-clip (`train.qk_clip`, `moe_jax.qk_clip`): each head's peak logit against the
scores written out in NumPy, the clip bringing every head that passed the threshold to
it exactly (the model's own forward before and after, the other heads unchanged), the
logged peak held at the threshold step after step, and the clipped step under sharded
layouts equal to one device."""

from __future__ import annotations

import dataclasses
from functools import cache, partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax import config as config_lib
from moe_jax import qk_clip
from moe_jax.kernels.attention import attention_fn, document_mask
from moe_jax.kernels.blockwise_attention import blockwise_attention
from moe_jax.optimizer import rates
from moe_jax.parallel import pipeline
from moe_jax.parallel.layout import SINGLE_DEVICE
from moe_jax.parallel.scopes import ATTENTION_PEAKS
from moe_jax.tools import hlo_collectives
from moe_jax.train_state import init_state
from moe_jax.train_step import PEAKS, RATE, loss_fn, train_step
from tests.layouts import (
    BASE,
    FAST_COMPILE,
    MLA_MODEL,
    assert_trees_close,
    batch,
    on_ragged_dot,
    planned,
    run_under,
    with_plan,
)
from tests.pipelined import one_device, pipelined
from tests.test_mtp import BASE as MTP_BASE

TRACKED = dataclasses.replace(SINGLE_DEVICE, track_peaks=True)


@cache
def _one_device(config: config_lib.Config):
    """`config` run on one device, its plan dropped: the layouts that differ only in
    their plan share one reference program."""
    return run_under(dataclasses.replace(config, parallel=config_lib.ParallelConfig()), TRACKED)


def _clipping(config: config_lib.Config, tau: float, **model) -> config_lib.Config:
    train = dataclasses.replace(config.train, qk_clip=True, qk_clip_threshold=tau)
    return dataclasses.replace(
        config, model=dataclasses.replace(config.model, **model), train=train
    )


def _scores_peak(q, k, positions=None, scale=None) -> np.ndarray:
    """Each query head's largest visible scaled score, float64, from all the scores."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    k = np.repeat(k, q.shape[2] // k.shape[2], axis=2)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
    s = q.shape[1]
    pos = np.broadcast_to(np.arange(s), q.shape[:2]) if positions is None else positions
    visible = np.asarray(document_mask(jnp.asarray(pos)))
    return np.where(visible, scores, -np.inf).max((0, 2, 3))


@pytest.mark.parametrize("impl", ["blockwise", "xla"])
@pytest.mark.parametrize("documents", [False, True])
def test_peaks_equal_the_largest_visible_score(impl: str, documents: bool):
    """GQA (8 query heads on 2 kv heads), values of another width, 3 blocks of the
    sequence; the peaks carry no gradient and change neither output nor gradient."""
    rng = np.random.default_rng(0)
    b, s, h, kv = 2, 48, 8, 2
    q = jnp.asarray(rng.normal(size=(b, s, h, 8)) * rng.uniform(0.5, 4, size=h)[:, None], "f4")
    k, v = (jnp.asarray(rng.normal(size=(b, s, kv, w)), "f4") for w in (8, 6))
    positions = np.concatenate([np.arange(17), np.arange(s - 17)]) if documents else None
    positions = None if positions is None else np.broadcast_to(positions, (b, s))
    masked = {} if positions is None else {"positions": jnp.asarray(positions)}
    core = attention_fn(impl, "float32", peaks=True, documents=documents)
    out, peaks = core(q, k, v, **masked)
    np.testing.assert_allclose(peaks, _scores_peak(q, k, positions), rtol=1e-5)
    plain = attention_fn(impl, "float32", documents=documents)
    np.testing.assert_allclose(out, plain(q, k, v, **masked), rtol=1e-6, atol=1e-6)
    loss = lambda f, q: (f(q, k, v, **masked)[0] if f is core else f(q, k, v, **masked)).sum()
    np.testing.assert_allclose(
        jax.grad(partial(loss, core))(q), jax.grad(partial(loss, plain))(q), atol=1e-6
    )
    if impl == "blockwise":
        np.testing.assert_array_equal(out, blockwise_attention(q, k, v, None, *masked.values()))


def _peaks(config: config_lib.Config, params, biases, graphdef) -> dict:
    """The model's own per-stack peaks [units, blocks, heads] on the test batch."""
    inputs = {k: jnp.asarray(v) for k, v in batch(config).items()}
    return loss_fn(params, biases, graphdef, inputs, config)[1][PEAKS]


MODELS = {
    "gqa": {},
    "gqa,projection_norm,bias": dict(qk_norm="projection", qkv_bias=True),
    "mla": MLA_MODEL,
}


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("stack", ["dense", "moe", "mtp"])
def test_clip_brings_each_head_that_passed_to_the_threshold(model: str, stack: str):
    """One stack clipped (a dense layer, an MoE layer, a multi-token prediction module:
    the clip of a layer changes the next layer's inputs, so each is checked on
    unchanged ones): the same tokens' peak of each of its heads is then min(peak, τ),
    the heads over τ at it and the others (in a kv group with a clipped head too)
    unchanged, and no weight but its queries' and keys' (or their norms') changes."""
    two = dict(num_layers=2, first_k_dense=1, mlp_dim=32, mtp_depth=int(stack == "mtp"))
    two.update(MODELS[model])
    config = _clipping(on_ragged_dot(BASE), 1.0, **two)
    graphdef, state = init_state(config, TRACKED)
    before = _peaks(config, state.params, state.biases, graphdef)
    tau = float(np.median(before[stack]))
    assert (before[stack] > tau).any() and (before[stack] < tau).any()
    params = qk_clip.clipped(state.params, {stack: before[stack]}, tau, config.model)
    after = _peaks(config, params, state.biases, graphdef)
    np.testing.assert_allclose(after[stack], np.minimum(before[stack], tau), rtol=2e-5)
    scaled = {"query_up", "kv_up", "query_bias", "key_bias"}
    scaled |= {"query_norm", "key_norm"} if "norm" in model else {"query", "key"}
    for (path, new), old in zip(
        jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(state.params), strict=True
    ):
        names = {getattr(p, "key", None) for p in path}
        if stack not in names or not names & scaled:
            np.testing.assert_array_equal(new, old, err_msg=jax.tree_util.keystr(path))


def _logged_peaks(config: config_lib.Config, steps: int) -> list[float]:
    """`max_attn_logit` of each of `steps` trainer steps on one batch."""
    graphdef, state = init_state(config, TRACKED)
    inputs = batch(config)
    step = jax.jit(partial(train_step, graphdef, config), donate_argnums=0)
    compiled = step.lower(state, inputs, RATE).compile(compiler_options=FAST_COMPILE)
    out = []
    for lr in rates(config.train, 0, steps):
        state, metrics = compiled(state, inputs, lr)
        out.append(float(metrics["max_attn_logit"]))
    return out


def test_logged_peak_stays_at_the_threshold_and_passes_it_without_the_clip():
    """τ at 0.8 of the first step's peak: every later step logs at most τ (1%), while the
    same run with a threshold no logit reaches logs peaks over τ at every step. The
    clip is computed from a step's forward and applied after its update, so a step
    logs what the previous update added to a clipped head (here 0.5%; more at larger
    rates, and in deeper stacks, whose later layers' inputs move with the clip of the
    earlier ones: docs/training.md); one attention layer, a 5e-4 rate."""
    train = dataclasses.replace(BASE.train, learning_rate=5e-4, warmup_steps=0)
    model = dataclasses.replace(BASE.model, num_layers=1)
    base = on_ragged_dot(dataclasses.replace(BASE, model=model, train=train))
    free = _logged_peaks(_clipping(base, 1e6), 4)
    tau = free[0] * 0.8
    clipped = _logged_peaks(_clipping(base, tau), 4)
    assert clipped[0] == pytest.approx(free[0], rel=1e-6)
    assert all(p <= tau * 1.01 for p in clipped[1:]), (clipped, tau)
    assert all(p > tau * 1.2 for p in free), (free, tau)


LAYOUTS = {
    "tp+etp": with_plan("tp", 2, 4, "etp"),  # heads over the intra group, GSPMD
    "sp+ep_a2a,zero=2": with_plan("sp", 2, 4, "ep_a2a", zero=2),  # heads split, per device
}


def _schedule(schedule: str, base: config_lib.Config) -> config_lib.Config:
    """2 stages, 4 micro-batches, 2 repeats of `base` (a dense first layer: GPipe runs
    it before the pipeline, each stage on its own rows, 1F1B inside its loop)."""
    plan = dataclasses.replace(pipelined(2, 1, 4, 4, repeats=2).parallel, schedule=schedule)
    train = dataclasses.replace(base.train, grad_accum=1)
    return dataclasses.replace(base, train=train, parallel=plan)


# 1F1B with the MTP tests' model: its two MTP modules run inside the tick loop's tail.
LAYOUTS.update(gpipe=_schedule("gpipe", one_device(4)), **{"1f1b,mtp": _schedule("1f1b", MTP_BASE)})
# the one-device runs of the same micro-batches
REFERENCE = {"gpipe": one_device(4), "1f1b,mtp": MTP_BASE}


@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_equals_one_device(name: str):
    """Loss, peak and every parameter after three clipping steps within 1e-5 of one
    device, τ below the peak: each head's peak is its maximum over all devices, and a
    pipeline's stages each bring their own layers' (and the dense prefix's). Without a
    pipeline the compiled step reduces them by one all-reduce of heads x 4 bytes over
    the 8 devices per layer (the heads' shards put in place first)."""
    config = _clipping(on_ragged_dot(LAYOUTS[name]), 1.0)
    run = planned(config)
    ref = _one_device(_clipping(on_ragged_dot(REFERENCE.get(name, LAYOUTS[name])), 1.0))
    for key in ("loss", "max_attn_logit"):
        np.testing.assert_allclose(run.metrics[key], ref.metrics[key], rtol=1e-5)
    assert ref.metrics["max_attn_logit"] > 1.0
    after = jax.device_get(pipeline.canonical(run.state.params))
    assert_trees_close(after, jax.device_get(ref.state.params), 1e-5)
    if config.parallel.stages == 1:  # from the compiled step: one max of heads floats a layer
        reduced = [c for c in hlo_collectives.parse(run.hlo) if c.tag == ATTENTION_PEAKS]
        per_layer = [c for c in reduced if c.group_size == 8]
        assert sum(c.count for c in per_layer) == config.model.num_layers, reduced
        assert {(c.kind, c.size) for c in per_layer} == {("all-reduce", 4 * BASE.model.num_heads)}


@pytest.mark.parametrize(
    "settings,setting",
    [
        ({"qk_clip_threshold": 0.0}, "train.qk_clip_threshold=0.0"),
        ({"model.qk_norm": "head"}, "model.qk_norm='head'"),
    ],
)
def test_what_it_cannot_clip_is_refused_in_one_line(settings: dict, setting: str):
    config = config_lib.to_config_dict(config_lib.Config())
    config.train.qk_clip = True
    for key, value in settings.items():
        section, name = key.split(".") if "." in key else ("train", key)
        config[section][name] = value
    with pytest.raises(ValueError, match=f"^{setting.replace('.', '[.]')} is invalid") as got:
        config_lib.load(config)
    assert "\n" not in str(got.value)
