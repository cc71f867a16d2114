"""`train.moment_dtype=bfloat16` (DeepSeek-V3's AdamW moments in BF16): the updates
against a written-out reference that rounds the moments between steps, the float32
default the same tree and values as `optax.adamw`, Muon's momentum kept the same way,
and a float32 checkpoint restoring into bf16 moments."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

from moe_jax import config as config_lib
from moe_jax.optimizer import adamw, muon

LR, B1, B2, EPS, DECAY = 1e-2, 0.9, 0.95, 1e-8, 0.1


def _train(**settings) -> config_lib.TrainConfig:
    base = dict(b1=B1, b2=B2, eps=EPS, weight_decay=DECAY)
    return dataclasses.replace(config_lib.TrainConfig(), **base, **settings)


def _params_and_grads(steps: int):
    rng = np.random.default_rng(0)
    params = {"w": rng.normal(size=(24, 40)) / 5, "out_bias": rng.normal(size=(40,))}
    grads = [
        {
            k: rng.normal(size=v.shape) * 10.0 ** rng.uniform(-4, 0, v.shape)
            for k, v in params.items()
        }
        for _ in range(steps)
    ]
    as32 = lambda tree: jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), tree)
    return params, as32(params), grads, [as32(g) for g in grads]


def _reference(params: dict, grads: list[dict], rounded: bool) -> dict:
    """AdamW in float64 (decay on the matrix, not the bias), each update from the new
    moments, which are then kept rounded to bf16 when `rounded`."""
    keep = (lambda x: x.astype(ml_dtypes.bfloat16).astype(np.float64)) if rounded else (lambda x: x)
    mu = {k: np.zeros_like(v) for k, v in params.items()}
    nu = {k: np.zeros_like(v) for k, v in params.items()}
    for t, g in enumerate(grads, start=1):
        for k, w in params.items():
            m = B1 * mu[k] + (1 - B1) * g[k]
            v = B2 * nu[k] + (1 - B2) * g[k] ** 2
            step = (m / (1 - B1**t)) / (np.sqrt(v / (1 - B2**t)) + EPS)
            decay = DECAY * w if k == "w" else 0.0
            params = {**params, k: w - LR * (step + decay)}
            mu[k], nu[k] = keep(m), keep(v)
    return params


def _run(rule, params, grads):
    state = rule.init(params)
    for g in grads:
        update, state = rule.update(g, state, params)
        params = optax.apply_updates(params, update)
    return params, state


def test_bf16_moments_equal_a_reference_that_rounds_them_between_steps():
    """Four steps on a [24, 40] matrix and a bias, gradients over four decades: within
    1e-6 of the float64 reference that keeps the moments in bf16, and measurably off the
    one that keeps them whole (so the rounding is real); both moments stored as bf16."""
    p64, p32, g64, g32 = _params_and_grads(4)
    params, state = _run(adamw(_train(moment_dtype="bfloat16"), lambda c: LR), p32, g32)
    adam = state[0]
    assert {x.dtype for x in jax.tree.leaves((adam.mu, adam.nu))} == {jnp.dtype(jnp.bfloat16)}
    rounded, whole = _reference(p64, g64, True), _reference(p64, g64, False)
    for k in params:
        np.testing.assert_allclose(params[k], rounded[k], rtol=0, atol=1e-6)
        assert np.abs(np.asarray(params[k]) - whole[k]).max() > 1e-5


def test_float32_moments_are_optax_adamw_tree_and_values():
    """The default is `optax.adamw` itself: the same state tree (checkpoints written
    before the setting existed read the same) and the same parameters."""
    _, p32, _, g32 = _params_and_grads(3)
    ours, state = _run(adamw(_train(), lambda c: LR), p32, g32)
    mask = lambda p: {"w": True, "out_bias": False}
    theirs, their_state = _run(
        optax.adamw(lambda c: LR, B1, B2, eps=EPS, weight_decay=DECAY, mask=mask), p32, g32
    )
    assert jax.tree.structure(state) == jax.tree.structure(their_state)
    for k in ours:
        np.testing.assert_array_equal(ours[k], theirs[k])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_muon_momentum_is_kept_in_the_moment_dtype(dtype):
    """Muon's one momentum per matrix in `train.moment_dtype`; the updates from the
    rounded momentum stay within bf16's rounding of the float32 ones."""
    _, p32, _, g32 = _params_and_grads(3)
    p32 = {"query": p32["w"].reshape(24, 4, 10), "scale": p32["out_bias"]}
    g32 = [{"query": g["w"].reshape(24, 4, 10), "scale": g["out_bias"]} for g in g32]
    rule = lambda d: muon(_train(optimizer="muon", moment_dtype=d), lambda c: LR)
    params, state = _run(rule(dtype), p32, g32)
    momenta = [x for x in jax.tree.leaves(state) if x.shape == (24, 4, 10)]
    assert momenta and {x.dtype for x in momenta} == {jnp.dtype(dtype)}
    whole, _ = _run(rule("float32"), p32, g32)
    np.testing.assert_allclose(params["query"], whole["query"], rtol=0, atol=LR * 2e-2)
