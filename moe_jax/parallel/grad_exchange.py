"""BF16 gradient exchange summed in float32 (`parallel.grad_exchange='bf16_a2a'`).

A ring reduce-scatter in bf16 rounds its running sum at every hop, n-1 times. Here each
device's float32 gradient is rounded to bf16 once, split into one shard per device,
sent to the shards' owners in one all-to-all, and the owner sums the n shards it
receives in float32: half the bytes of a float32 exchange, one rounding. A gradient
reduced over the intra group as well as over 'data' (weights replicated there) is
exchanged over the intra group first, then over 'data' (the paper's hierarchical form:
nodes are joined by the slower network, which then carries 1/n of the bytes).

To see the unreduced gradients at all, the step's loss and gradients run per device in
one `shard_map` over the whole mesh (`moe_jax.parallel.per_device_step`), which hands
each device's partial gradient to `exchange`. FSDP's weight gathers get the same
exchange as the transpose of their all-gather (`gather_over_data`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from moe_jax.parallel.layout import DATA, INTRA, STAGE, Layout, axes_of, split_size
from moe_jax.parallel.scopes import GRAD_EXCHANGE


def is_spec(s) -> bool:
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


def cut_dimension(
    sizes: Mapping[str, int], spec: P, shape: tuple[int, ...], start: int = 0
) -> int | None:
    """The first dimension from `start` on whose per-device size the exchange group
    divides (shards are cut there), or None. `sizes`: the mesh's axis sizes."""
    group = math.prod(split_size(stage, sizes) for stage in summed_over(spec))
    for dim, (size, entry) in enumerate(zip(shape, (*spec, *[None] * len(shape)), strict=False)):
        if dim >= start and (size // split_size(entry, sizes)) % group == 0:
            return dim
    return None


def reduced_spec(sizes: Mapping[str, int], spec: P, shape: tuple[int, ...], start: int = 0) -> P:
    """Where a reduced gradient lives: its parameter's spec, with the cut dimension (from
    `start` on) also split over the summed axes (the intra group major, as exchanged)."""
    stages = summed_over(spec)
    dim = cut_dimension(sizes, spec, shape, start)
    if not stages or dim is None:
        return spec
    full = [*spec, *[None] * (len(shape) - len(spec))]
    full[dim] = (*axes_of(full[dim]), *summed_axes(spec))
    return P(*full)


def reduced_specs(sizes: Mapping[str, int], specs, shapes, starts=None):
    """`reduced_spec` of every parameter of a tree (`starts`: a tree of each one's
    `start`, default 0)."""
    starts = jax.tree.map(lambda _: 0, shapes, is_leaf=_is_shape) if starts is None else starts
    place = lambda s, shape, start: reduced_spec(sizes, s, shape, start)
    return jax.tree.map(place, specs, shapes, starts, is_leaf=is_spec)


def _is_shape(x) -> bool:
    return isinstance(x, tuple) and all(isinstance(d, int) for d in x)


def sum_shards(g: jax.Array, axes: tuple[str, ...], dim: int) -> jax.Array:
    """Each device's float32 `g` cut along `dim` into one shard per device of `axes`,
    sent as bf16 in one all-to-all; returns the float32 sum of this device's shard."""
    n = math.prod(jax.lax.axis_size(a) for a in axes)
    parts = g.reshape(*g.shape[:dim], n, g.shape[dim] // n, *g.shape[dim + 1 :])
    received = jax.lax.all_to_all(parts.astype(jnp.bfloat16), axes, dim, dim)
    return received.astype(jnp.float32).sum(dim)


def exchange(
    sizes: Mapping[str, int], g: jax.Array, spec: P, shape: tuple[int, ...], start: int = 0
) -> jax.Array:
    """A device's partial gradient -> its shard of the sum (`reduced_spec`). A gradient
    that no dimension lets the group cut evenly is summed in float32 instead."""
    stages = summed_over(spec)
    dim = cut_dimension(sizes, spec, shape, start)
    with jax.named_scope(GRAD_EXCHANGE):
        if dim is None:
            return jax.lax.psum(g, summed_axes(spec)) if stages else g
        for stage in stages:
            g = sum_shards(g, stage, dim)
        return g


def summed_whole(g: jax.Array, spec: P) -> jax.Array:
    """`g` (any shape; a part of a gradient too) summed over the devices that share its
    parameter (placed by `spec`) as `exchange` sums it, bf16 shards summed in float32 a
    level at a time, then the summed float32 shards gathered back: flattened, padded to
    a multiple of the group."""
    axes = summed_axes(spec)
    if not axes:
        return g
    group = math.prod(jax.lax.axis_size(a) for a in axes)
    flat = g.astype(jnp.float32).reshape(-1)
    flat = jnp.pad(flat, (0, -flat.size % group))
    with jax.named_scope(GRAD_EXCHANGE):
        for stage in summed_over(spec):
            flat = sum_shards(flat, stage, 0)
        flat = jax.lax.all_gather(flat, axes, axis=0, tiled=True)  # the intra group major
    return flat[: g.size].reshape(g.shape)


def summed_axes(spec: P) -> tuple[str, ...]:
    return tuple(a for stage in summed_over(spec) for a in stage)


def gather_sums(layout: Layout, grads, specs, whole=None):
    """The summed shards (`exchange`) gathered back in float32 to their parameters'
    placement `specs`: a copy, not a sum, once per step, where the update reads them
    (left to XLA, the update ran on the shards and gathered parameters and both moments
    instead). Its own shard_map without the replication check: an all-gather's result is
    the same on every device of its group, which the check cannot see. `whole` (a tree of
    bools like `specs`, or None) marks gradients summed whole already (`summed_whole`)."""
    sizes = layout.mesh.shape
    shapes = jax.tree.map(lambda g: g.shape, grads)
    whole = jax.tree.map(lambda _: False, specs, is_leaf=is_spec) if whole is None else whole

    def gather(spec, g, shape, done):
        dim = cut_dimension(sizes, spec, shape)
        if done or dim is None or not summed_axes(spec):
            return g
        with jax.named_scope(GRAD_EXCHANGE):
            return jax.lax.all_gather(g, summed_axes(spec), axis=dim, tiled=True)

    body = lambda grads: jax.tree.map(gather, specs, grads, shapes, whole, is_leaf=is_spec)
    place = lambda spec, cut, done: spec if done else cut
    reduced = reduced_specs(sizes, specs, shapes)
    reduced = jax.tree.map(place, specs, reduced, whole, is_leaf=is_spec)
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
