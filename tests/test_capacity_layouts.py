"""Capacity mode (token dropping) under every expert layout, against the layout's own
single-device definition of where drops are decided (8 forced CPU devices):

* all-to-all (`ep_a2a`): per device, over the tokens it holds between blocks; each
  device's output equals one device running the block on those tokens alone;
* all-gather forms (`ep_ag`, `etp`, `ep_etp`): per intra group, over the group's
  gathered tokens with the capacity of all E experts; each data group's output
  equals one device running the block on that group's sequences.

The all-gather forms also compute only their E/n experts' share of the slots: the
compiled buckets are [E/n, C, d], not the [E/n, n·C, d] a local capacity would give.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from moe_jax.config import MoEConfig
from moe_jax.moe.block import MoEParams, moe_forward
from moe_jax.moe.experts import ExpertWeights
from moe_jax.parallel import mesh as mesh_lib
from moe_jax.parallel.layout import SINGLE_DEVICE
from moe_jax.plan.resolve import check_plan
from tests.layouts import assert_trees_close, with_plan

CFG = MoEConfig(num_experts=8, top_k=2, expert_mlp_dim=16, capacity_factor=0.75)
DIM = 32
SHAPE = (8, 16, DIM)  # batch, seq, embed
CASES = [  # expert layout, where drops are decided
    ("ep_a2a", "device"),
    ("ep_ag", "group"),
    ("etp", "group"),
    ("ep_etp", "group"),
]


def _params() -> MoEParams:
    keys = jax.random.split(jax.random.key(7), 4)
    e, f = CFG.num_experts, CFG.expert_mlp_dim
    normal = lambda key, shape, fan_in: jax.random.normal(key, shape) / np.sqrt(fan_in)
    return MoEParams(
        router=normal(keys[0], (DIM, e), DIM),
        bias=jnp.zeros(e),
        experts=ExpertWeights(
            gate=normal(keys[1], (e, DIM, f), DIM),
            up=normal(keys[2], (e, DIM, f), DIM),
            down=normal(keys[3], (e, f, DIM), f),
        ),
    )


def _loss(block):
    """mean(y²) of a block `x -> (y, dropped fraction)`, with y and the fraction."""

    def loss(params, x):
        y, dropped = block(params, x)
        return jnp.mean(jnp.square(y)), (y, dropped)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


def _parts(layout, scope: str) -> list[tuple[slice, ...]]:
    """The token blocks drops are decided over: each device's shard, or each data
    group's sequences (the group gathers its devices' tokens in their own order)."""
    if scope == "group":
        groups = layout.mesh.shape["data"]
        size = SHAPE[0] // groups
        return [(slice(g * size, (g + 1) * size),) for g in range(groups)]
    sharding = NamedSharding(layout.mesh, layout.activation_spec())
    return list(dict.fromkeys(sharding.devices_indices_map(SHAPE).values()))


def _reference(parts):
    """One device, the block run on each part on its own."""

    def block(params, x):
        y, dropped = jnp.zeros_like(x), []
        for part in parts:
            out, stats = SINGLE_DEVICE.moe(moe_forward, x[part], params, CFG)
            y = y.at[part].set(out)
            dropped.append(stats.dropped_fraction)
        return y, jnp.mean(jnp.stack(dropped))

    return block


@pytest.mark.parametrize("attention", ["dp", "sp"])
@pytest.mark.parametrize("experts,scope", CASES)
def test_capacity_matches_its_single_device_definition(experts: str, scope: str, attention):
    config = check_plan(
        dataclasses.replace(with_plan(attention, 2, 4, experts), moe=CFG), jax.device_count()
    )
    layout = mesh_lib.make_layout(config, mesh_lib.make_mesh(config))

    def block(params, x):
        y, stats = layout.moe(moe_forward, x, params, CFG)
        return y, stats.dropped_fraction

    params, x = _params(), jax.random.normal(jax.random.key(8), SHAPE)
    (loss, (y, dropped)), grads = _loss(block)(params, x)
    (ref_loss, (ref_y, ref_dropped)), ref_grads = _loss(_reference(_parts(layout, scope)))(
        params, x
    )
    assert 0.05 < float(ref_dropped) < 0.5  # drops happen, and not everywhere
    np.testing.assert_allclose(dropped, ref_dropped, rtol=1e-6)
    np.testing.assert_allclose(y, ref_y, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert_trees_close(grads, ref_grads)


@pytest.mark.parametrize("experts,local", [("ep_ag", 2), ("ep_etp", 4)])
def test_all_gather_forms_compute_their_share_of_the_slots(experts: str, local: int):
    """dp at (data 2, n 4): a group gathers 4 sequences of 16 tokens, capacity
    ceil(0.75 · 64 · 2 / 8) = 12 slots per expert, and each device's buffer of kept rows
    holds its local experts' 12 slots each (sorted by expert, each group padded to the
    tile of 16), not the ceil(0.75 · 64 · 2 / local) a capacity computed for its local
    experts alone would give (etp holds all 8 experts: nothing to check)."""
    config = check_plan(
        dataclasses.replace(with_plan("dp", 2, 4, experts), moe=CFG), jax.device_count()
    )
    layout = mesh_lib.make_layout(config, mesh_lib.make_mesh(config))
    params = _params()
    x = jax.ShapeDtypeStruct(SHAPE, jnp.float32)
    lowered = jax.jit(lambda p, x: layout.moe(moe_forward, x, p, CFG)[0]).lower(params, x)
    gathered = set(
        re.findall(r'"stablehlo.gather".*-> tensor<(\d+)x' f"{DIM}xf32>", lowered.as_text())
    )
    tile = CFG.tile(64)
    rows = lambda slots: -(-(min(64 * 2, local * slots) + local * (tile - 1)) // tile) * tile
    assert str(rows(12)) in gathered  # the dispatch gather's kept-row buffer
    assert str(rows(-(-75 * 64 * 2 // (100 * local)))) not in gathered
