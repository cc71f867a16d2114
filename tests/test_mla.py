"""Multi-head latent attention (`model.attention='mla'`): the kernels with values of
another width than queries and keys, every attention layout (and its rings and chunks)
equal to one device, decoding from the cached latent equal to the full forward, and
settings that do not fit refused in one line before anything compiles (8 forced CPU
devices, see conftest.py)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moe_jax.config import load, to_config_dict
from moe_jax.kernels.attention import xla_attention
from moe_jax.kernels.blockwise_attention import blockwise_attention
from moe_jax.model import decode, remat, rope
from moe_jax.model.mla import MLAttention
from moe_jax.model.transformer import Transformer
from moe_jax.plan.resolve import check_plan
from tests import layouts
from tests.layouts import MLA, assert_trees_close, planned, reference, with_plan


def _plain(q, k, v, scale):
    """Causal attention written out: one head per query head, softmax in float32."""
    s = q.shape[1]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
    scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)


def test_cores_take_values_of_another_width_and_the_given_scale():
    """xla (v padded to the qk width) and blockwise (v as it is, in blocks of 8 of 24
    positions) equal the written-out attention, outputs and gradients, for qk 10 wide,
    v 6 wide and MLA's scale 10**-0.5 * 1.7 (a YaRN-like factor)."""
    keys = jax.random.split(jax.random.key(0), 4)
    b, s, h = 2, 24, 3
    q, k = (jax.random.normal(key, (b, s, h, 10)) for key in keys[:2])
    v, cotangent = (jax.random.normal(key, (b, s, h, 6)) for key in keys[2:])
    scale = 10**-0.5 * 1.7

    def out_and_grads(core, q, k, v, cotangent):
        out, vjp = jax.vjp(lambda q, k, v: core(q, k, v, scale), q, k, v)
        return out, vjp(cotangent)

    run = jax.jit(
        lambda q, k, v, c: [
            out_and_grads(core, q, k, v, c) for core in (_plain, xla_attention, blockwise_attention)
        ]
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("moe_jax.kernels.blockwise_attention.MAX_BLOCK", 8)
        want, *got = run.lower(q, k, v, cotangent).compile(layouts.FAST_COMPILE)(q, k, v, cotangent)
    assert want[0].shape == (b, s, h, 6)
    for each in got:
        assert_trees_close(each, want, 1e-5)


def _rms(x: np.ndarray, scale: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def _rope(x: np.ndarray, theta: float, frequencies: np.ndarray | None = None) -> np.ndarray:
    """Half-split rotary on x [b, s, ..., r] at positions 0..s-1 (at `frequencies`, else
    theta's own)."""
    half = x.shape[-1] // 2
    if frequencies is None:
        frequencies = theta ** (-np.arange(half) / half)
    angle = np.arange(x.shape[1])[:, None] * frequencies  # [s, half]
    angle = angle.reshape(1, x.shape[1], *([1] * (x.ndim - 3)), half)
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate(
        [x1 * np.cos(angle) - x2 * np.sin(angle), x2 * np.cos(angle) + x1 * np.sin(angle)], -1
    )


# DeepSeek-V2's YaRN (mscale = mscale_all_dim = 0.707: cos and sin unscaled), stretched
# from 4 positions so that the 16 here reach the interpolated frequencies.
YARN = dict(
    rope_scaling="yarn",
    rope_factor=40.0,
    rope_original_max_position=4,
    rope_beta_fast=32.0,
    rope_beta_slow=1.0,
    rope_mscale=0.707,
    rope_mscale_all_dim=0.707,
)


@pytest.mark.parametrize("scaling", [{}, YARN], ids=["no_scaling", "yarn"])
def test_block_follows_the_written_out_formulas(scaling: dict):
    """The block (xla core) equals MLA written out in numpy (float64): c_q = norm(x W_qa),
    q = c_q W_qb; [c_kv, k_pe] = x W_kva, c_kv normed, [k_nope, v] = c_kv W_kvb per head;
    rotary on q_pe and on the one k_pe every head shares; scale (6 + 4)^-0.5; out. Under
    YaRN: its frequencies (checked against transformers in test_hf_references) and the
    scale times (0.1 mscale_all_dim ln(factor) + 1)^2."""
    m = dataclasses.replace(MLA.model, attention_impl="xla", **scaling)
    attn = MLAttention(m, rngs=nnx.Rngs(3))
    w = jax.tree.map(np.float64, attn.weights())
    scales = jax.random.split(jax.random.key(4), 2)
    w = dataclasses.replace(  # norms away from one, so that they count
        w,
        kv_norm=np.asarray(1 + jax.random.uniform(scales[0], (10,)), np.float64),
        query_norm=np.asarray(1 + jax.random.uniform(scales[1], (12,)), np.float64),
    )
    attn.kv_norm.scale[...] = jnp.asarray(w.kv_norm, jnp.float32)
    attn.query_norm.scale[...] = jnp.asarray(w.query_norm, jnp.float32)
    x = np.asarray(jax.random.normal(jax.random.key(5), (2, 16, 32)), np.float64)
    positions = jnp.broadcast_to(jnp.arange(16), (2, 16))
    graphdef, state = nnx.split(attn)
    run = jax.jit(lambda state, x: nnx.merge(graphdef, state)(x, positions))
    x32 = jnp.asarray(x, jnp.float32)
    got = run.lower(state, x32).compile(layouts.FAST_COMPILE)(state, x32)

    eps, theta = m.norm_eps, m.rope_theta
    freq, scale = None, 10**-0.5
    if scaling:
        freq = rope.inverse_frequencies(4, theta, rope.RopeScaling.of(m))
        scale *= (0.1 * 0.707 * np.log(40.0) + 1) ** 2
    q = np.einsum("bsr,rhk->bshk", _rms(x @ w.query_down, w.query_norm, eps), w.query_up)
    joint = x @ w.kv_down
    c_kv, k_pe = _rms(joint[..., :10], w.kv_norm, eps), _rope(joint[..., 10:], theta, freq)
    kv = np.einsum("bsr,rhk->bshk", c_kv, w.kv_up)
    k = np.concatenate([kv[..., :6], np.broadcast_to(k_pe[:, :, None], (2, 16, 8, 4))], -1)
    q = np.concatenate([q[..., :6], _rope(q[..., 6:], theta, freq)], -1)
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
    scores = np.where(np.tril(np.ones((16, 16), bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    o = np.einsum("bhqk,bkhv->bqhv", probs, kv[..., 6:])
    want = np.einsum("bqhv,hvd->bqd", o, w.out)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5)


def _first_step_matches(got: layouts.Run, want: layouts.Run) -> None:
    for key in ("loss", "lm_loss", "aux_loss", "z_loss"):
        np.testing.assert_allclose(got.metrics[key], want.metrics[key], rtol=1e-5, err_msg=key)
    np.testing.assert_array_equal(got.metrics["load"], want.metrics["load"])
    assert_trees_close(got.grads, want.grads, 1e-5)
    assert_trees_close(jax.device_get(got.state.params), jax.device_get(want.state.params), 1e-5)


def _with(config, **parallel):
    return dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, **parallel))


def _xla(config):
    return dataclasses.replace(
        config, model=dataclasses.replace(config.model, attention_impl="xla")
    )


# Each attention layout once, and each ring and chunked form once: dp runs the xla core
# (the reference and the others blockwise), so it compares the cores in the model too;
# sp's ring runs inside two chunks of the batch (both of sp's overlaps in one program).
PLANS = {
    "dp_xla": _xla(with_plan("dp", 2, 4, base=MLA)),
    "fsdp": with_plan("fsdp", 8, 1, base=MLA),
    "tp": with_plan("tp", 2, 4, "etp", base=MLA),  # also tests/test_comm_report.py's
    "sp": with_plan("sp", 2, 4, "ep_a2a", base=MLA),
    "tp_ring": _with(with_plan("tp", 2, 4, base=MLA), collective_matmul=True),
    "sp_ring_chunks": _with(
        with_plan("sp", 2, 4, base=MLA), collective_matmul=True, overlap_chunks=2
    ),
}


@pytest.mark.parametrize("plan", PLANS)
def test_layout_matches_single_device(plan: str):
    """Loss, load, every gradient of the first step and the parameters after three AdamW
    steps within 1e-5 of one device."""
    _first_step_matches(planned(PLANS[plan]), reference(MLA))


def test_sp_ring_projects_down_once_per_chunk_not_per_step():
    """sp's ring up-projects one destination's heads per step from latents made once
    (`prepare`): the compiled step holds one kv_down weight-gradient GEMM
    (f32[32, 10 + 4]) per chunk (2), not one per ring step and chunk (8)."""
    hlo = planned(PLANS["sp_ring_chunks"]).hlo
    grads = [line for line in hlo.splitlines() if "= f32[32,14]{1,0} dot(" in line]
    assert len(grads) == 2, grads


def _decoded_logits(config, tokens: np.ndarray, prompt: int) -> tuple:
    """(the full forward's logits, the logits of decoding: the first `prompt` tokens at
    once, then one token at a time from the cache, the cache at the end)."""
    model = Transformer(config.model, config.moe, rngs=nnx.Rngs(1))
    graphdef, state = nnx.split(model)

    def fast(fn, *args):  # compiled once for these shapes, with the tests' fast flags
        return jax.jit(fn).lower(*args).compile(layouts.FAST_COMPILE)(*args)

    full = fast(lambda s, t: nnx.merge(graphdef, s)(t)[0], state, tokens)
    step = lambda s, t, c, i: decode.forward(nnx.merge(graphdef, s), t, c, i)
    cache = decode.empty_cache(model, tokens.shape[0], tokens.shape[1])
    logits, cache = fast(step, state, tokens[:, :prompt], cache, 0)
    pieces = [logits]
    one = jax.jit(step).lower(state, tokens[:, :1], cache, 0).compile(layouts.FAST_COMPILE)
    for i in range(prompt, tokens.shape[1]):
        logits, cache = one(state, tokens[:, i : i + 1], cache, i)
        pieces.append(logits)
    return np.asarray(full), np.asarray(jnp.concatenate(pieces, axis=1)), cache


def test_decoding_from_the_cached_latent_equals_the_full_forward():
    """One query projection (q_lora_rank=0, as DeepSeek-V2-Lite), a dense first layer: the
    cache holds each layer's c_kv [b, len, kv_lora] and rotated k_pe [b, len, rope] only,
    and the absorbed attention over it gives the full forward's logits."""
    model = dataclasses.replace(MLA.model, q_lora_rank=0, first_k_dense=1)
    config = dataclasses.replace(MLA, model=dataclasses.replace(model, mlp_dim=24))
    tokens = np.random.default_rng(0).integers(0, model.vocab_size, (2, 9)).astype(np.int32)
    full, decoded, cache = _decoded_logits(config, tokens, prompt=4)
    np.testing.assert_allclose(decoded, full, rtol=1e-5, atol=1e-5)
    shapes = {
        name: [tuple(t.shape) for t in pair] for name, pairs in cache.items() for pair in pairs
    }
    assert shapes == {"dense": [(1, 2, 9, 10), (1, 2, 9, 4)], "moe": [(1, 2, 9, 10), (1, 2, 9, 4)]}


def _model(**changes) -> dict:
    config = to_config_dict(MLA)
    for key, value in changes.items():
        config.model[key] = value
    return config


@pytest.mark.parametrize(
    "changes,message",
    [
        (
            dict(qk_rope_head_dim=5),
            "model.qk_rope_head_dim=5 is invalid: must be even (rotary pairs)",
        ),
        (dict(attention="gqa"), "model.q_lora_rank=12 is invalid: only model.attention='mla'"),
        (dict(num_kv_heads=2), "model.num_kv_heads=2 is invalid: must equal model.num_heads=8"),
        (dict(kv_lora_rank=0), "model.kv_lora_rank=0 is invalid: must be > 0 under mla"),
        (dict(attention="mha"), "model.attention='mha' is invalid: valid: ('gqa', 'mla')"),
        (
            dict(attention_impl="cudnn", dtype="bfloat16"),
            "model.attention_impl='cudnn' is invalid for mla heads 10 wide (max of qk_nope + "
            "qk_rope and v_head_dim): cuDNN's flash attention takes head widths that are a "
            "multiple of 8 and at most 256",
        ),
    ],
)
def test_settings_that_do_not_fit_are_refused_in_one_line(changes: dict, message: str):
    with pytest.raises(ValueError) as error:
        load(_model(**changes))
    assert str(error.value).startswith(message), str(error.value)
    assert "\n" not in str(error.value)


def test_cudnn_takes_mla_heads_it_can_hold():
    """qk 12 + 4 = 16 wide (values 8): a multiple of 8, at most 256; config accepts it."""
    config = _model(attention_impl="cudnn", dtype="bfloat16", qk_nope_head_dim=12, v_head_dim=8)
    config.data.document_mask = False  # this jax's cuDNN attention cannot mask documents
    assert load(config).model.attention_impl == "cudnn"


def test_sp_with_heads_the_group_does_not_divide_is_refused():
    model = dataclasses.replace(MLA.model, num_heads=6, num_kv_heads=6)
    config = with_plan("sp", 2, 4, base=dataclasses.replace(MLA, model=model))
    with pytest.raises(
        ValueError, match=r"^model.num_heads=6 must be divisible by parallel.intra=4"
    ):
        check_plan(config, 8)


def test_selective_remat_keeps_the_latents_and_what_the_core_reads(capsys):
    """One MLA block under `model.remat='selective'` saves, beside its inputs, only the
    two down-projections' outputs (query latent [.., 12], joint kv [.., 10 + 4]), the
    q, k, v the core reads and the core's output and logsumexp: the normed latents, the
    up-projections' halves and the rotary are rebuilt in the backward."""
    attn = MLAttention(MLA.model, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(attn)
    x = jnp.ones((2, 16, 32))
    positions = jnp.broadcast_to(jnp.arange(16), (2, 16))
    f = lambda state, x: nnx.merge(graphdef, state)(x, positions).sum()
    jax.ad_checkpoint.print_saved_residuals(
        jax.checkpoint(f, policy=remat.policy("selective")), state, x
    )
    saved = [
        line for line in capsys.readouterr().out.splitlines() if "from the argument" not in line
    ]
    named = sorted(line.split(" from ")[0] for line in saved if " named " in line)
    assert named == [
        "f32[2,16,12] named 'mla_latent'",
        "f32[2,16,14] named 'mla_latent'",
        "f32[2,16,8,10] named 'qkv'",
        "f32[2,16,8,10] named 'qkv'",
        "f32[2,16,8,1] named 'attention_core'",
        "f32[2,16,8,5] named 'attention_core'",
        "f32[2,16,8,5] named 'qkv'",
    ]
    assert [line for line in saved if " named " not in line] == ["i32[2,16] from a constant"]
