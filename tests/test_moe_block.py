"""The MoE block equals an independent per-expert reference, for every `moe.impl`."""

from __future__ import annotations

import dataclasses
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moe_jax.config import MoEConfig
from moe_jax.moe.block import MoE
from tests import reference

DIM, BATCH, SEQ = 16, 2, 24

ROUTING_CASES = {
    "softmax_top1": MoEConfig(num_experts=8, top_k=1, renormalize=False),
    "softmax_top2": MoEConfig(num_experts=8, top_k=2),
    "softmax_top6_no_renorm": MoEConfig(num_experts=8, top_k=6, renormalize=False),
    "sigmoid_top2": MoEConfig(num_experts=8, top_k=2, score_fn="sigmoid", routed_scaling=2.5),
    "sigmoid_top6_no_renorm": MoEConfig(
        num_experts=8, top_k=6, score_fn="sigmoid", renormalize=False
    ),
    "shared_experts": MoEConfig(num_experts=8, top_k=2, num_shared_experts=2, shared_mlp_dim=8),
    "group_limited": MoEConfig(
        num_experts=12, top_k=4, score_fn="sigmoid", n_groups=4, topk_groups=2
    ),
    "capacity_drops_top2": MoEConfig(num_experts=8, top_k=2, capacity_factor=0.5),
    "capacity_drops_sigmoid_top6": MoEConfig(
        num_experts=8, top_k=6, score_fn="sigmoid", capacity_factor=0.8
    ),
}
IMPLS = (
    "tiled",
    "ragged_dot",
    "pallas",
    # The optional tokamax package (XLA's ragged_dot on CPU): only where it is installed.
    pytest.param(
        "tokamax",
        marks=pytest.mark.skipif(
            importlib.util.find_spec("tokamax") is None, reason="tokamax is not installed"
        ),
    ),
    "capacity",
    "dense",
)


# Qwen2-MoE's shared expert, scaled per token by sigmoid(x @ w): outside the routed
# experts, so one impl checks it.
GATED_SHARED = MoEConfig(
    num_experts=8,
    top_k=2,
    renormalize=False,
    num_shared_experts=1,
    shared_mlp_dim=20,
    shared_expert_gate=True,
)


def _config(routing: MoEConfig, impl: str) -> MoEConfig:
    cfg = dataclasses.replace(routing, impl=impl, expert_mlp_dim=12, tile_size=4)
    if impl == "capacity" and cfg.dropless:
        # Capacity mode that can hold every assignment: the same routing, no drops.
        cfg = dataclasses.replace(cfg, capacity_factor=cfg.num_experts / cfg.top_k)
    return cfg


def _block(cfg: MoEConfig):
    block = MoE(DIM, cfg, rngs=nnx.Rngs(0))
    num_experts = cfg.num_experts
    block.bias[...] = 0.05 * jax.random.normal(jax.random.key(7), (num_experts,))
    return block


def _params(block: MoE) -> dict:
    params = {name: getattr(block, name)[...] for name in ("router", "gate", "up", "down")}
    if block.shared is not None:
        for name in ("gate", "up", "down", "output_gate"):
            if getattr(block.shared, name) is not None:
                params[f"shared_{name}"] = getattr(block.shared, name)[...]
    return params


def _as_state(template: nnx.State, params: dict) -> nnx.State:
    """The parameter state of a block with its arrays taken from `params`."""

    def pick(path, _):
        keys = [str(getattr(p, "key", getattr(p, "name", ""))) for p in path]
        return params["_".join(k for k in keys if k not in ("", "value", "raw_value"))]

    return jax.tree_util.tree_map_with_path(pick, template)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", sorted(ROUTING_CASES))
def test_block_matches_reference(case: str, impl: str):
    _check_against_reference(ROUTING_CASES[case], impl)


def test_gated_shared_expert_matches_reference():
    _check_against_reference(GATED_SHARED, "tiled")


def _check_against_reference(routing: MoEConfig, impl: str):
    """Output, gradients of the input and every parameter, expert loads and drops of the
    block against the reference block."""
    cfg = _config(routing, impl)
    block = _block(cfg)
    params = _params(block)
    bias = block.bias[...]
    keys = jax.random.split(jax.random.key(1), 2)
    x = jax.random.normal(keys[0], (BATCH, SEQ, DIM))
    cotangent = jax.random.normal(keys[1], (BATCH, SEQ, DIM))

    ref_y, chosen, keep = reference.moe_forward(x, params, bias, cfg)
    dropped = 1.0 - keep.mean()
    if routing.capacity_factor > 0:
        assert dropped > 0.05, "capacity cases must really drop assignments"

    graphdef, param_state, rest = nnx.split(block, nnx.Param, ...)

    def block_loss(params, x):
        y, stats = nnx.merge(graphdef, _as_state(param_state, params), rest)(x)
        return jnp.sum(y * cotangent), (y, stats)

    def ref_loss(params, x):
        y, _, _ = reference.moe_forward(x, params, bias, cfg, keep=keep)
        return jnp.sum(y * cotangent)

    grads, (y, stats) = jax.grad(block_loss, argnums=(0, 1), has_aux=True)(params, x)
    ref_grads = jax.grad(ref_loss, argnums=(0, 1))(params, x)

    np.testing.assert_allclose(y, ref_y, rtol=1e-5, atol=1e-5 * float(jnp.abs(ref_y).max()))
    for name, got, want in [("x", grads[1], ref_grads[1])] + [
        (k, grads[0][k], ref_grads[0][k]) for k in params
    ]:
        scale = float(jnp.abs(want).max())
        assert scale > 0, name
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * scale, err_msg=name)

    load = np.bincount(np.asarray(chosen).reshape(-1), minlength=cfg.num_experts)
    np.testing.assert_array_equal(stats.load, load)
    np.testing.assert_allclose(stats.dropped_fraction, dropped, atol=1e-7)


def test_bias_changes_selection_not_weights():
    """A large bias on one expert makes every token choose it, at its unbiased weight."""
    cfg = MoEConfig(num_experts=8, top_k=2, renormalize=False, impl="dense", expert_mlp_dim=12)
    block = _block(cfg)
    block.bias[...] = jnp.zeros(8).at[3].set(100.0)
    x = jax.random.normal(jax.random.key(2), (BATCH, SEQ, DIM))
    _, stats = block(x)
    assert stats.load[3] == BATCH * SEQ
    params = _params(block)
    ref_y, chosen, _ = reference.moe_forward(x, params, block.bias[...], cfg)
    assert (np.asarray(chosen) == 3).any(-1).all()
    np.testing.assert_allclose(block(x)[0], ref_y, rtol=1e-5, atol=1e-6)


def test_capacity_multiplies_no_more_than_dropless():
    """Capacity factor 2.0 bounds buffers, it adds no FLOPs: the compiled forward and
    backward of the block in capacity mode count at most 5% more FLOPs than the dropless
    block's (XLA's cost analysis), where fixed [E, C] buckets multiplied every padded
    row (twice the routed rows at factor 2)."""

    def flops(capacity_factor: float) -> float:
        cfg = MoEConfig(num_experts=8, top_k=2, expert_mlp_dim=128, capacity_factor=capacity_factor)
        block = MoE(64, cfg, rngs=nnx.Rngs(0))
        graphdef, params, rest = nnx.split(block, nnx.Param, ...)
        x = jax.ShapeDtypeStruct((4, 128, 64), jnp.float32)

        def loss(params, x):
            y, _ = nnx.merge(graphdef, params, rest)(x)
            return jnp.sum(y * y)

        compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x).compile()
        return compiled.cost_analysis()["flops"]

    dropless, capacity = flops(0.0), flops(2.0)
    assert capacity <= 1.05 * dropless, (capacity, dropless)
