"""The training step's optimizer pieces: gradient accumulation, decay mask, schedule, and
the learning rate as the step's argument."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial

import jax
import numpy as np
import optax
import pytest

from moe_jax.config import Config, ModelConfig, MoEConfig, TrainConfig
from moe_jax.optimizer import decay_mask, learning_rate, rates
from moe_jax.train_state import init_state
from moe_jax.train_step import RATE, gradients, train_step

SMALL = Config(
    model=ModelConfig(embed_dim=32, head_dim=8, mlp_dim=64),
    moe=MoEConfig(expert_mlp_dim=32, impl="dense"),
    train=TrainConfig(batch_size=4, seq_len=16, steps=10),
)


def _batch(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 259, (4, 17)).astype(np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def test_gradient_accumulation_matches_one_big_batch():
    """Two micro-batches of 2 give the same update as one batch of 4 (mean of means)."""
    results = []
    for micro in (1, 2):
        config = dataclasses.replace(
            SMALL, train=dataclasses.replace(SMALL.train, grad_accum=micro)
        )
        graphdef, state = init_state(config)
        step = jax.jit(partial(train_step, graphdef, config))
        state, metrics = step(state, _batch(), rates(config.train)[0])
        results.append((state, metrics))
    (one, m1), (two, m2) = results
    np.testing.assert_allclose(m1["lm_loss"], m2["lm_loss"], rtol=1e-5)
    np.testing.assert_allclose(m1["grad_norm"], m2["grad_norm"], rtol=1e-4)
    np.testing.assert_array_equal(m1["load"], m2["load"])
    for a, b in zip(jax.tree.leaves(one.params), jax.tree.leaves(two.params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("norms,embeddings", [(False, True), (True, False)])
def test_decay_mask_follows_settings(norms: bool, embeddings: bool):
    """Norm scales (the q/k norms' among them) and the table as set; biases never."""
    train = dataclasses.replace(SMALL.train, decay_norms=norms, decay_embeddings=embeddings)
    model = dataclasses.replace(SMALL.model, qkv_bias=True, qk_norm="head")
    _, state = init_state(dataclasses.replace(SMALL, model=model))
    mask = decay_mask(train)(state.params)
    flat = {
        "/".join(str(getattr(p, "key", getattr(p, "name", ""))) for p in path): leaf
        for path, leaf in jax.tree_util.tree_flatten_with_path(mask)[0]
    }
    assert all(v == norms for k, v in flat.items() if "scale" in k)
    assert all(v == embeddings for k, v in flat.items() if "table" in k)
    assert all(v for k, v in flat.items() if k.endswith(("gate", "query", "router")))
    assert sum("query_norm/scale" in k for k in flat) == 1
    biases = [v for k, v in flat.items() if "_bias" in k]
    assert len(biases) == 3 and not any(biases)  # q, k, v of the one (MoE) stack


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_schedule_warms_up_then_decays_to_floor(schedule: str):
    train = TrainConfig(
        steps=110, warmup_steps=10, learning_rate=1.0, min_lr_ratio=0.1, schedule=schedule
    )
    lr = learning_rate(train)
    assert float(lr(0)) == 0.0
    np.testing.assert_allclose(float(lr(5)), 0.5, rtol=1e-6)
    np.testing.assert_allclose(float(lr(10)), 1.0, rtol=1e-6)
    np.testing.assert_allclose(float(lr(110)), 0.1, rtol=1e-6)
    # Halfway through the decay both schedules sit midway between peak and floor.
    np.testing.assert_allclose(float(lr(60)), 0.55, rtol=1e-5)
    quarter = 0.1 + 0.9 * (0.5 + 0.5 * np.cos(np.pi / 4)) if schedule == "cosine" else 0.775
    np.testing.assert_allclose(float(lr(35)), quarter, rtol=1e-5)


def _schedule(name: str, **train) -> Callable[[int], float]:
    settings = dict(steps=110, warmup_steps=10, learning_rate=1.0, min_lr_ratio=0.1)
    lr = learning_rate(TrainConfig(schedule=name, **{**settings, **train}))
    return lambda step: float(lr(step))


def test_constant_schedule_holds_the_peak_after_warmup():
    lr = _schedule("constant")
    assert [lr(0), lr(5)] == [0.0, 0.5]
    assert lr(10) == lr(60) == lr(110) == 1.0


def test_wsd_is_stable_then_decays_linearly_over_its_last_fraction():
    """110 steps, 20% decaying: the peak from step 10 to 88, then linear to 0.1 at 110."""
    lr = _schedule("wsd", wsd_decay_fraction=0.2)
    np.testing.assert_allclose([lr(5), lr(10), lr(50), lr(88)], [0.5, 1.0, 1.0, 1.0], rtol=1e-6)
    np.testing.assert_allclose(lr(99), 1.0 - 0.9 * 11 / 22, rtol=1e-6)
    np.testing.assert_allclose(lr(110), 0.1, rtol=1e-6)


def test_wsd_whose_warmup_reaches_into_the_decay_still_ends_at_the_floor():
    """10 steps, 8 of warmup, half decaying: decay runs over the 2 steps left, from 1.0
    at step 8 through 0.55 at 9 to 0.1 at 10."""
    lr = _schedule("wsd", steps=10, warmup_steps=8, wsd_decay_fraction=0.5)
    np.testing.assert_allclose([lr(4), lr(8), lr(9), lr(10)], [0.5, 1.0, 0.55, 0.1], rtol=1e-6)


def test_inverse_sqrt_falls_as_one_over_root_step_down_to_the_floor():
    """peak * sqrt(warmup / step): 1 at 10, 1/2 at 40, 1/4 at 160; never under 0.1."""
    lr = _schedule("inverse_sqrt", steps=2000)
    np.testing.assert_allclose([lr(10), lr(40), lr(160)], [1.0, 0.5, 0.25], rtol=1e-6)
    np.testing.assert_allclose(lr(2000), 0.1, rtol=1e-6)  # sqrt(10/2000) = 0.07 < floor


def _lowered(config: Config) -> str:
    graphdef, state = jax.eval_shape(lambda: init_state(config))
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), _batch())
    step = jax.jit(partial(train_step, graphdef, config), donate_argnums=0)
    return step.lower(state, batch, RATE).as_text()


def test_the_schedule_and_the_run_length_stay_out_of_the_program():
    """Runs that differ only in train.steps, the warmup, the schedule and its peak lower
    to one program (the learning rate is an argument), so the persistent compilation
    cache shares it; a setting the step does use still changes it."""
    schedule = dict(steps=1000, warmup_steps=100, schedule="wsd", learning_rate=1e-2)
    other = dataclasses.replace(SMALL, train=dataclasses.replace(SMALL.train, **schedule))
    assert _lowered(other) == _lowered(SMALL)
    decay = dataclasses.replace(SMALL, train=dataclasses.replace(SMALL.train, weight_decay=0.5))
    assert _lowered(decay) != _lowered(SMALL)


@pytest.mark.parametrize("clip", [1.0, 0.0])
def test_each_step_updates_at_its_scheduled_rate_as_optax_adamw(clip: float):
    """Five steps through warmup and cosine decay, the rate passed in from the host, match
    optax's own clipped AdamW that reads the schedule itself (decoupled weight decay
    scaled by the rate included); the logged rate is the schedule's, and the optimizer
    state keeps the tree that checkpoints hold."""
    train = dict(steps=5, warmup_steps=2, learning_rate=1e-2, weight_decay=0.1, grad_clip=clip)
    config = dataclasses.replace(SMALL, train=dataclasses.replace(SMALL.train, **train))
    cfg = config.train
    adamw = optax.adamw(
        learning_rate(cfg),
        cfg.b1,
        cfg.b2,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        mask=decay_mask(cfg),
    )
    reference = optax.chain(optax.clip_by_global_norm(clip), adamw) if clip else adamw
    graphdef, state = init_state(config)
    params, opt_state = state.params, reference.init(state.params)
    step = jax.jit(partial(train_step, graphdef, config))
    grads_of = jax.jit(lambda state, batch: gradients(state, graphdef, batch, config)[1])
    for i, lr in enumerate(rates(cfg)):
        batch = _batch(i)
        grads = grads_of(dataclasses.replace(state, params=params), batch)
        updates, opt_state = reference.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        state, metrics = step(state, batch, lr)
        np.testing.assert_allclose(float(metrics["lr"]), float(learning_rate(cfg)(i)), rtol=1e-6)
        for got, want in zip(jax.tree.leaves(state.params), jax.tree.leaves(params), strict=True):
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-7)
    assert [float(x) for x in rates(cfg)][:3] == pytest.approx([0.0, 5e-3, 1e-2])
    assert jax.tree.structure(state.opt_state) == jax.tree.structure(opt_state)


def test_a_step_whose_update_overflows_is_skipped_like_a_non_finite_loss():
    """The rate inf (data to the trainer's program, which the test above compiled) leaves
    the loss and gradients finite but would make every parameter non-finite: the step
    changes nothing but the step counter and reports skipped=1, exactly as a step whose
    loss is NaN does; the same step at a finite rate updates."""
    train = dict(steps=5, warmup_steps=2, learning_rate=1e-2, weight_decay=0.1, grad_clip=1.0)
    config = dataclasses.replace(SMALL, train=dataclasses.replace(SMALL.train, **train))
    graphdef, state = init_state(config)
    step = jax.jit(partial(train_step, graphdef, config))
    before = jax.device_get(state)
    after, metrics = step(state, _batch(), np.float32(np.inf))
    assert int(metrics["skipped"]) == 1
    assert np.isfinite(float(metrics["loss"])) and np.isfinite(float(metrics["grad_norm"]))
    assert int(after.step) == int(before.step) + 1
    kept = (after.params, after.opt_state, after.biases)
    for got, want in zip(
        jax.tree.leaves(kept),
        jax.tree.leaves((before.params, before.opt_state, before.biases)),
        strict=True,
    ):
        np.testing.assert_array_equal(got, want)
    poison = lambda x: x.at[(0,) * x.ndim].set(np.nan)
    nan_params = jax.tree.map(poison, state.params)
    _, nan_metrics = step(dataclasses.replace(state, params=nan_params), _batch(), np.float32(1e-2))
    assert int(nan_metrics["skipped"]) == 1 and not np.isfinite(float(nan_metrics["loss"]))
    updated, good = step(state, _batch(), np.float32(1e-2))
    assert int(good["skipped"]) == 0
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(updated.params))
    pairs = zip(jax.tree.leaves(updated.params), jax.tree.leaves(before.params), strict=True)
    assert any(not np.array_equal(a, b) for a, b in pairs)
