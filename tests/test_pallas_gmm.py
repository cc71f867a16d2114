"""The Pallas grouped GEMM kernels (interpreted on CPU) against a float64 NumPy loop
over groups, for awkward group sizes; and the fused-permutation ops against
dispatch -> GEMM -> combine."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax.config import MoEConfig
from moe_jax.kernels import pallas_gmm
from moe_jax.kernels.routed_gmm import gather_gmm, gmm_scatter
from moe_jax.moe import dispatch as dsp
from moe_jax.moe.routing import route

BLOCK = pallas_gmm.default_blocks().m  # rows per block in interpret mode
K, N = 40, 24  # neither a multiple of the 16-wide blocks: edges are masked
SIZES = {
    "empty_one_and_block_edges": [0, 1, BLOCK - 1, BLOCK + 1, 0, BLOCK],
    "one_group_holds_all": [0, 0, 3 * BLOCK + 5, 0],
    "skewed": [1, 2 * BLOCK + 3, 2, 0, 7],
}


def _inputs(sizes: list[int], dtype, spare: int = 3):
    """Sorted rows (with `spare` empty rows past the groups), weights, a cotangent."""
    rng = np.random.default_rng(len(sizes) * 7 + sum(sizes))
    rows = sum(sizes) + spare
    x = rng.normal(size=(rows, K))
    x[sum(sizes) :] = 0.0  # empty rows hold nothing
    w = rng.normal(size=(len(sizes), K, N)) / np.sqrt(K)
    dy = rng.normal(size=(rows, N))
    cast = lambda a: jnp.asarray(a, dtype)
    return cast(x), cast(w), cast(dy), jnp.asarray(sizes, jnp.int32)


def _groups(sizes):
    ends = np.cumsum(sizes)
    return [slice(int(e - s), int(e)) for s, e in zip(sizes, ends, strict=True)]


def _reference(x, w, dy, sizes):
    """Forward, input gradient and weight gradient, group by group in float64."""
    x, w, dy = (np.asarray(a, np.float64) for a in (x, w, dy))
    y, dx, dw = np.zeros((x.shape[0], N)), np.zeros_like(x), np.zeros_like(w)
    for g, rows in enumerate(_groups(sizes)):
        y[rows] = x[rows] @ w[g]
        dx[rows] = dy[rows] @ w[g].T
        dw[g] = x[rows].T @ dy[rows]
    return y, dx, dw


def _close(got, want, dtype):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = max(np.abs(want).max(), 1e-30)
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    assert np.abs(got - want).max() <= tol * scale, np.abs(got - want).max() / scale


@pytest.mark.parametrize("spare", [3, 0], ids=["spare_rows", "no_spare_row"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", sorted(SIZES))
def test_the_three_products_match_a_loop_over_groups(case, dtype, spare):
    """With no spare row the last group ends on the last row, mid-block (as a MoE's
    T*k rows do): masked-off lanes must not overwrite it."""
    sizes = SIZES[case]
    x, w, dy, group_sizes = _inputs(sizes, dtype, spare)
    y_ref, dx_ref, dw_ref = _reference(x, w, dy, sizes)
    y = pallas_gmm.grouped_matmul(x, w, group_sizes)
    dx = pallas_gmm.grouped_matmul(dy, w, group_sizes, transpose_rhs=True)
    dw = pallas_gmm.transposed_grouped_matmul(x, dy, group_sizes, rows=x.shape[0])
    assert y.dtype == dtype and dw.dtype == jnp.float32
    _close(y, y_ref, dtype)
    _close(dx, dx_ref, dtype)
    _close(dw, dw_ref, dtype)
    # Rows no group owns come out zero, and empty groups' weight gradients are zero.
    assert not np.asarray(y[sum(sizes) :], np.float32).any()
    assert all(not np.asarray(dw[g]).any() for g, s in enumerate(sizes) if s == 0)


def _routing_case(dtype, top_k=2, experts=6, tokens=40):
    cfg = MoEConfig(num_experts=experts, top_k=top_k, expert_mlp_dim=N)
    keys = jax.random.split(jax.random.key(3), 6)
    x = jax.random.normal(keys[0], (tokens, K), dtype)
    router = jax.random.normal(keys[1], (K, experts))
    routing = route(x.astype(jnp.float32), router, jnp.zeros(experts), cfg)
    up = (jax.random.normal(keys[2], (experts, K, N)) / np.sqrt(K)).astype(dtype)
    down = (jax.random.normal(keys[3], (experts, N, K)) / np.sqrt(N)).astype(dtype)
    cotangent = jax.random.normal(keys[4], (tokens, K), dtype)
    return cfg, x, routing, up, down, cotangent


def _fused(x, up, down, weights, routing, cfg):
    routing = dataclasses.replace(routing, weights=weights)
    rows = dsp.sorted_layout(routing, cfg.num_experts)
    h = jnp.tanh(gather_gmm(x, up, rows.source, rows.group_sizes))
    weight = dsp.row_weights(rows, routing).astype(x.dtype)
    return gmm_scatter(h, down, rows.source, weight, rows.group_sizes, x.shape[0])


def _unfused(x, up, down, weights, routing, cfg):
    """dispatch -> per-expert GEMM (XLA's ragged_dot) -> combine."""
    routing = dataclasses.replace(routing, weights=weights)
    rows = dsp.sorted_layout(routing, cfg.num_experts)
    h = jnp.tanh(jax.lax.ragged_dot(dsp.dispatch(x, rows), up, rows.group_sizes))
    return dsp.combine(jax.lax.ragged_dot(h, down, rows.group_sizes), rows, routing)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_fused_permutation_equals_dispatch_gemm_combine(dtype):
    cfg, x, routing, up, down, cotangent = _routing_case(dtype)

    def loss(fn):
        def value(x, up, down, weights):
            y = fn(x, up, down, weights, routing, cfg)
            return jnp.sum(y.astype(jnp.float32) * cotangent.astype(jnp.float32))

        return jax.value_and_grad(value, argnums=(0, 1, 2, 3))

    args = (x, up, down, routing.weights)
    got_value, got = loss(_fused)(*args)
    want_value, want = loss(_unfused)(*args)
    _close(got_value, want_value, dtype)
    for name, a, b in zip(("x", "up", "down", "weights"), got, want, strict=True):
        assert a.dtype == b.dtype, name
        _close(a, b, dtype)


def test_dropped_assignments_contribute_nothing():
    """Assignments routing dropped get no row: the fused ops skip them exactly."""
    cfg, x, routing, up, down, _ = _routing_case(jnp.float32, top_k=3)
    keep = jax.random.bernoulli(jax.random.key(9), 0.6, routing.keep.shape)
    routing = dataclasses.replace(routing, keep=keep)
    got = _fused(x, up, down, routing.weights, routing, cfg)
    want = _unfused(x, up, down, routing.weights, routing, cfg)
    _close(got, want, jnp.float32)
