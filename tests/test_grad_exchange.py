"""`parallel.grad_exchange='bf16_a2a'`: gradients summed over devices as bf16 shards
after one all-to-all, in float32 (moe_jax.parallel.grad_exchange).

References: the same plan with float32 gradient exchange (the trainer's default), a
float32 sum of per-device gradients, and a bf16 ring reduce-scatter emulated in numpy
with a rounding at every hop.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from moe_jax.model.transformer import Transformer
from moe_jax.moe.block import RouterBias
from moe_jax.parallel import grad_exchange
from moe_jax.parallel.layout import DATA
from moe_jax.parallel.scopes import GRAD_EXCHANGE
from moe_jax.tools import hlo_collectives, lowered_dtypes
from moe_jax.train_step import loss_fn
from tests.layouts import (
    BASE,
    assert_leaves_close_in_norm,
    batch,
    on_ragged_dot,
    planned,
    with_plan,
)

BASE = on_ragged_dot(BASE)  # the GPU path's expert kernel

VOCAB = dataclasses.replace(BASE, model=dataclasses.replace(BASE.model, vocab_size=256))
PLANS = {
    "sp+ep_a2a": with_plan("sp", 2, 4, "ep_a2a", base=BASE),
    "tp+ep_a2a,vocab_parallel": dataclasses.replace(
        with_plan("tp", 2, 4, "ep_a2a", base=VOCAB),
        parallel=dataclasses.replace(with_plan("tp", 2, 4, "ep_a2a").parallel, vocab_parallel=True),
    ),
    "tp+etp,zero1": with_plan("tp", 2, 4, "etp", base=BASE, zero=1),
    "sp+ep_a2a,grad_accum2": with_plan(
        "sp",
        2,
        4,
        "ep_a2a",
        base=dataclasses.replace(BASE, train=dataclasses.replace(BASE.train, grad_accum=2)),
    ),
    "fsdp+ep_ag,expert_fsdp": dataclasses.replace(
        with_plan("fsdp", 2, 4, "ep_ag", base=BASE),
        parallel=dataclasses.replace(with_plan("fsdp", 2, 4).parallel, expert_fsdp=True),
    ),
}


def _with_bf16_exchange(config):
    return dataclasses.replace(
        config, parallel=dataclasses.replace(config.parallel, grad_exchange="bf16_a2a")
    )


@pytest.mark.parametrize("name", PLANS)
def test_gradients_equal_the_float32_exchange_within_bf16s_rounding(name):
    fp32, bf16 = planned(PLANS[name]), planned(_with_bf16_exchange(PLANS[name]))
    np.testing.assert_allclose(bf16.metrics["loss"], fp32.metrics["loss"], rtol=1e-6)
    assert_leaves_close_in_norm(bf16.grads, fp32.grads, rtol=1e-2)
    # and not merely the float32 path again: one bf16 rounding shows
    errors = [
        np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(np.asarray(b))
        for a, b in zip(jax.tree.leaves(bf16.grads), jax.tree.leaves(fp32.grads), strict=True)
    ]
    assert max(errors) > 1e-4


@pytest.mark.parametrize("name", PLANS)
def test_gradients_cross_devices_only_as_bf16_all_to_alls(name):
    """No reduce-scatter or all-reduce of a gradient remains (FSDP's gather transpose
    included): the sums are all-to-alls sent as bf16 (read from the lowered program:
    XLA:CPU widens them when it compiles), then float32 all-gathers of the sums."""
    run = planned(_with_bf16_exchange(PLANS[name]))
    compiled = lowered_dtypes.as_sent(hlo_collectives.parse(run.hlo), run.lowered)
    exchange = [c for c in compiled if GRAD_EXCHANGE in c.op_name]
    sums = [c for c in exchange if c.kind == "all-to-all"]
    assert sums and all(c.dtype == "bf16" and c.compiled_dtype == "f32" for c in sums)
    # the rest: the summed shards gathered back, a float32 copy
    assert all(c.kind == "all-gather" and c.dtype == "f32" for c in exchange if c not in sums)
    params = sum(np.asarray(g).size for g in jax.tree.leaves(run.grads))
    for c in compiled:
        if c.kind in ("all-reduce", "reduce-scatter") and c.role == "param_grad":
            # only scalars are left: the loss, the metrics, the gradient norm's parts
            assert c.size <= 1024 and c.size * 100 < params * 4, c
    fp32 = hlo_collectives.parse(planned(PLANS[name]).hlo)
    assert any(c.kind in ("all-reduce", "reduce-scatter") and c.size > 4096 for c in fp32)


def test_the_default_plan_keeps_the_float32_exchange():
    compiled = hlo_collectives.parse(planned(PLANS["sp+ep_a2a"]).hlo)
    assert not any(GRAD_EXCHANGE in c.op_name for c in compiled)


def _round_bf16(x: np.ndarray) -> np.ndarray:
    return np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32)


def _ring_reduce_scatter(parts: np.ndarray) -> np.ndarray:
    """A bf16 ring reduce-scatter of `parts` [n devices, n shards, ...]: shard j's running
    sum travels n-1 hops and is sent as bf16 each time. Returns [n shards, ...]."""
    n = parts.shape[0]
    out = []
    for j in range(n):
        total = _round_bf16(parts[(j + 1) % n, j])
        for hop in range(2, n + 1):
            total = _round_bf16(total + parts[(j + hop) % n, j])
        out.append(total)
    return np.stack(out)


@jax.jit
def _single_device_grads(rows):
    model = Transformer(BASE.model, BASE.moe, rngs=nnx.Rngs(0))
    graphdef, params, biases = nnx.split(model, nnx.Param, RouterBias)
    return jax.grad(lambda p: loss_fn(p, biases, graphdef, rows, BASE)[0])(params)


def test_one_rounding_beats_a_rounding_per_hop_on_real_gradients():
    """The point of the pattern, on the gradients 8 data-parallel devices hold before
    their exchange (one sequence each, of the test model): at most half a bf16 ring's
    error over the whole gradient."""
    n = 8
    inputs = batch(dataclasses.replace(BASE, train=dataclasses.replace(BASE.train, batch_size=n)))
    per_device = [
        jax.tree.leaves(_single_device_grads({k: v[d : d + 1] for k, v in inputs.items()}))
        for d in range(n)
    ]
    mesh = Mesh(np.asarray(jax.devices()[:n]), (DATA,))
    summed = jax.jit(
        jax.shard_map(
            lambda g: grad_exchange.sum_shards(g[0], (DATA,), 0)[None],
            mesh=mesh,
            in_specs=P(DATA),
            out_specs=P(DATA),
        )
    )
    exact, ours, ring = [], [], []
    for leaf in zip(*per_device, strict=True):
        flat = np.stack([np.asarray(g, np.float32).reshape(-1) for g in leaf])
        flat = flat[:, : flat.shape[1] // n * n]  # whole shards only
        exact.append(flat.astype(np.float64).sum(0))
        ours.append(np.asarray(summed(jnp.asarray(flat))).reshape(-1))
        ring.append(_ring_reduce_scatter(flat.reshape(n, n, -1)).reshape(-1))
        leaf_error = np.linalg.norm(ours[-1] - exact[-1]) / np.linalg.norm(exact[-1])
        assert leaf_error < 2.0**-8  # one bf16 rounding's worth, in every parameter
    exact, ours, ring = map(np.concatenate, (exact, ours, ring))
    error = np.linalg.norm(ours - exact) / np.linalg.norm(exact)
    ring_error = np.linalg.norm(ring - exact) / np.linalg.norm(exact)
    assert 0 < error <= 0.5 * ring_error, (error, ring_error)


def test_shards_are_cut_where_the_group_divides_the_intra_group_first():
    sizes = {"stage": 2, "data": 2, "expert": 2, "tensor": 2}
    intra, outer = ("expert", "tensor"), ("stage", "data")
    # replicated everywhere: summed over the intra group, then across nodes (hierarchical)
    assert grad_exchange.summed_over(P(None)) == (intra, outer)
    assert grad_exchange.reduced_spec(sizes, P(None, None), (3, 128)) == P(None, (*intra, *outer))
    # already split over the intra group: only the outer axes are summed, cut below that
    assert grad_exchange.summed_over(P(intra, None)) == (outer,)
    assert grad_exchange.reduced_spec(sizes, P(intra, None), (16, 3)) == P((*intra, *outer), None)
    # split over data (FSDP): its gather's transpose sums it; only 'stage' is left
    assert grad_exchange.summed_over(P("data", intra)) == (("stage",),)
    # a pipelined stack's layers, split over stages: summed within its stage only
    assert grad_exchange.summed_over(P("stage", None)) == (intra, ("data",))
    # no dimension the group divides: kept whole, summed in float32
    assert grad_exchange.reduced_spec(sizes, P(None), (7,)) == P(None)
