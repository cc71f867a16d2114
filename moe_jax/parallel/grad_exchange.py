"""BF16 gradient exchange summed in float32 (`parallel.grad_exchange='bf16_a2a'`).

A ring reduce-scatter in bf16 rounds its running sum at every hop, n-1 times. Here each
device's float32 gradient is rounded to bf16 once, split into one shard per device,
sent to the shards' owners in one all-to-all, and the owner sums the n shards it
receives in float32: half the bytes of a float32 exchange, one rounding. A gradient
reduced over the intra group as well as over 'data' (weights replicated there) is
exchanged over the intra group first, then over 'data' (the paper's hierarchical form:
nodes are joined by the slower network, which then carries 1/n of the bytes).

To see the unreduced gradients at all, the step's loss and gradients run inside one
`shard_map` over the whole mesh (`step_gradients`). Every parameter enters as its own
shard, made device-varying over the mesh axes it is replicated on, so autodiff leaves
each device its partial gradient; the blocks' own shard_maps become plain calls of
their bodies there (`Layout.block_map`). FSDP's weight gathers get the same exchange as
the transpose of their all-gather (`gather_over_data`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from moe_jax.kernels.varying import varying_axes
from moe_jax.parallel import pipeline
from moe_jax.parallel.layout import (
    DATA,
    EVERY,
    INTRA,
    STAGE,
    Layout,
    axes_of,
    split_size,
    step_mapped,
)
from moe_jax.parallel.scopes import GRAD_EXCHANGE


def _is_spec(s) -> bool:
    return isinstance(s, P)


def _used(spec: P) -> set[str]:
    return {a for entry in spec for a in axes_of(entry)}


def summed_over(spec: P) -> tuple[tuple[str, ...], ...]:
    """The levels that sum a gradient whose parameter is placed by `spec`: the mesh axes
    it is replicated on, the intra group's first, then those across nodes ('stage' and
    'data'; either level may be absent)."""
    used = _used(spec)
    intra = tuple(a for a in INTRA if a not in used)
    outer = tuple(a for a in (STAGE, DATA) if a not in used)
    return tuple(level for level in (intra, outer) if level)


def cut_dimension(sizes: Mapping[str, int], spec: P, shape: tuple[int, ...]) -> int | None:
    """The first dimension whose per-device size the exchange group divides (shards are
    cut there), or None. `sizes`: the mesh's axis sizes."""
    group = math.prod(split_size(stage, sizes) for stage in summed_over(spec))
    for dim, (size, entry) in enumerate(zip(shape, (*spec, *[None] * len(shape)), strict=False)):
        if (size // split_size(entry, sizes)) % group == 0:
            return dim
    return None


def reduced_spec(sizes: Mapping[str, int], spec: P, shape: tuple[int, ...]) -> P:
    """Where a reduced gradient lives: its parameter's spec, with the cut dimension also
    split over the summed axes (the intra group major, as exchanged)."""
    stages = summed_over(spec)
    dim = cut_dimension(sizes, spec, shape)
    if not stages or dim is None:
        return spec
    full = [*spec, *[None] * (len(shape) - len(spec))]
    full[dim] = (*axes_of(full[dim]), *_axes(spec))
    return P(*full)


def _reduced_specs(sizes: Mapping[str, int], specs, shapes):
    """`reduced_spec` of every parameter of a tree."""
    place = lambda s, shape: reduced_spec(sizes, s, shape)
    return jax.tree.map(place, specs, shapes, is_leaf=_is_spec)


def sum_shards(g: jax.Array, axes: tuple[str, ...], dim: int) -> jax.Array:
    """Each device's float32 `g` cut along `dim` into one shard per device of `axes`,
    sent as bf16 in one all-to-all; returns the float32 sum of this device's shard."""
    n = math.prod(jax.lax.axis_size(a) for a in axes)
    parts = g.reshape(*g.shape[:dim], n, g.shape[dim] // n, *g.shape[dim + 1 :])
    received = jax.lax.all_to_all(parts.astype(jnp.bfloat16), axes, dim, dim)
    return received.astype(jnp.float32).sum(dim)


def exchange(sizes: Mapping[str, int], g: jax.Array, spec: P, shape: tuple[int, ...]) -> jax.Array:
    """A device's partial gradient -> its shard of the sum (`reduced_spec`). A gradient
    that no dimension lets the group cut evenly is summed in float32 instead."""
    stages = summed_over(spec)
    dim = cut_dimension(sizes, spec, shape)
    with jax.named_scope(GRAD_EXCHANGE):
        if dim is None:
            return jax.lax.psum(g, _axes(spec)) if stages else g
        for stage in stages:
            g = sum_shards(g, stage, dim)
        return g


def _axes(spec: P) -> tuple[str, ...]:
    return tuple(a for stage in summed_over(spec) for a in stage)


def gather_sums(layout: Layout, grads, specs):
    """The summed shards (`step_gradients`) gathered back in float32 to their parameters'
    placement `specs`: a copy, not a sum, once per step, where the update reads them
    (left to XLA, the update ran on the shards and gathered parameters and both moments
    instead). Its own shard_map without the replication check: an all-gather's result is
    the same on every device of its group, which the check cannot see."""
    sizes = layout.mesh.shape
    shapes = jax.tree.map(lambda g: g.shape, grads)

    def gather(spec, g, shape):
        dim = cut_dimension(sizes, spec, shape)
        if dim is None or not _axes(spec):
            return g
        with jax.named_scope(GRAD_EXCHANGE):
            return jax.lax.all_gather(g, _axes(spec), axis=dim, tiled=True)

    body = lambda grads: jax.tree.map(gather, specs, grads, shapes, is_leaf=_is_spec)
    reduced = _reduced_specs(sizes, specs, shapes)
    return jax.shard_map(
        body, mesh=layout.mesh, in_specs=(reduced,), out_specs=specs, check_vma=False
    )(grads)


def gather_over_data(layout: Layout, w: jax.Array, dim: int) -> jax.Array:
    """FSDP's all-gather of a weight over 'data'; under 'bf16_a2a' its transpose (the
    gradient's reduce-scatter) is `sum_shards` instead."""
    gather = lambda w: jax.lax.all_gather(w, DATA, axis=dim, tiled=True)
    if layout.grad_exchange != "bf16_a2a":
        return gather(w)

    @jax.custom_vjp
    def gathered(w):
        return gather(w)

    def backward(_, g):
        with jax.named_scope(GRAD_EXCHANGE):
            return (sum_shards(g.astype(jnp.float32), (DATA,), dim).astype(w.dtype),)

    gathered.defvjp(lambda w: (gather(w), None), backward)
    return gathered(w)


def _mean_of(x: jax.Array) -> jax.Array:
    """The mean over all devices; over an axis `x` does not vary over it is itself."""
    axes = tuple(a for a in EVERY if a in varying_axes(x))
    return jax.lax.pmean(x, axes) if axes else x


def _mean(tree):
    return jax.tree.map(_mean_of, tree)


def mean_over_devices(loss_fn):
    """`loss_fn` (-> (loss, metrics) on one device's tokens) as the mean over all devices:
    the whole batch's loss, each device computing its share."""

    def mean_loss(*args):
        loss, metrics = loss_fn(*args)
        return _mean_of(loss), _mean(metrics)

    return mean_loss


def _step_batch(layout: Layout, batch):
    """(batch as the step's shard_map takes it, its spec, the per-device reshape)."""
    if layout.pipeline_run is not None:
        batch, spec = pipeline.microbatch_major(batch, layout)
        return batch, spec, pipeline.local_batch
    return batch, layout.activation_spec(rank=2), lambda b: b


def step_loss(layout: Layout, loss_fn, params, biases, batch, specs):
    """`loss_fn(params, biases, batch) -> (loss, metrics)` on one device's tokens, run per
    device in one shard_map over the mesh (as `step_gradients`); returns the mean metrics
    over all devices. What a pipelined model needs even without gradients."""
    batch, batch_spec, local = _step_batch(layout, batch)

    def body(params, biases, batch):
        with step_mapped():
            return mean_over_devices(loss_fn)(params, biases, local(batch))[1]

    bias_specs = jax.tree.map(lambda _: P(), biases)
    return jax.shard_map(
        body,
        mesh=layout.mesh,
        in_specs=(specs, bias_specs, jax.tree.map(lambda _: batch_spec, batch)),
        out_specs=P(),
    )(params, biases, batch)


def step_gradients(layout: Layout, gradients, params, biases, batch, specs):
    """`gradients(params, biases, batch, loss_of) -> (metrics, grads)` run per device in
    one shard_map over the mesh: `loss_of(loss_fn)` makes the mean over all devices of
    a loss computed on one device's tokens (`mean_over_devices`). Returns the metrics
    and the gradients summed over the devices that share their parameter: by `exchange`
    under 'bf16_a2a', each placed by `reduced_spec`; else by a float32 all-reduce, each
    placed as its parameter."""
    sizes = layout.mesh.shape
    shapes = jax.tree.map(lambda p: p.shape, params)
    batch, batch_spec, local = _step_batch(layout, batch)
    compressed = layout.grad_exchange == "bf16_a2a"

    def reduce(spec, g, shape):
        if compressed:
            return exchange(sizes, g, spec, shape)
        return jax.lax.psum(g, _axes(spec)) if _axes(spec) else g

    def body(params, biases, batch):
        def varying(spec, p):
            return jax.lax.pcast(p, _axes(spec), to="varying") if _axes(spec) else p

        params = jax.tree.map(varying, specs, params, is_leaf=_is_spec)
        with step_mapped():
            metrics, grads = gradients(params, biases, local(batch), mean_over_devices)
        return metrics, jax.tree.map(reduce, specs, grads, shapes, is_leaf=_is_spec)

    bias_specs = jax.tree.map(lambda _: P(), biases)
    grad_specs = _reduced_specs(sizes, specs, shapes) if compressed else specs
    return jax.shard_map(
        body,
        mesh=layout.mesh,
        in_specs=(specs, bias_specs, jax.tree.map(lambda _: batch_spec, batch)),
        out_specs=(P(), grad_specs),
    )(params, biases, batch)
