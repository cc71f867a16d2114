"""Grouped matrix multiplication: rows grouped by expert, one weight matrix per group.

Two implementations with different layouts of the rows:

* `ragged_gmm`: rows sorted by expert, unpadded, `group_sizes` per expert;
  XLA's own `lax.ragged_dot`, the natural GPU/TPU path. XLA:CPU lowers it
  densely (cost grows with the number of experts), so on CPU it is slow.
* `tiled_gmm`: rows sorted by expert with each group padded to a multiple of
  `tile` rows (the CPU path). Each group's tiles are covered by one chunk per set
  bit of its tile count (a group of 7 tiles: chunks of 4, 2 and 1), and a loop per
  chunk size multiplies each chunk by its expert's weights. Every product is as
  large as the group allows, so small tiles (little padding) cost no extra loop
  trips; cost is independent of the number of experts apart from padding. The
  backward runs the same loops for the input gradient and adds each chunk's
  weight gradient into its expert's, never materialising weights per tile.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp

from moe_jax.kernels.varying import vary_like, varying_like, varying_zeros


def ragged_gmm(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """[M, d] x [E, d, f] -> [M, f] for rows grouped by `group_sizes` [E]."""
    return jax.lax.ragged_dot(x, w, group_sizes.astype(jnp.int32))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Chunks:
    """How runs of whole tiles cover each expert's group: group e of `tiles[e]` tiles
    from row `starts[e]` is one chunk of `tile << j` rows per set bit j of its tile
    count (largest first), listed in `start`/`expert`/`level`, the first `count` real."""

    tiles: jax.Array  # [E]
    starts: jax.Array  # [E]
    start: jax.Array  # [levels * E]
    expert: jax.Array  # [levels * E]
    level: jax.Array  # [levels * E]
    count: jax.Array  # []


def _levels(rows: int, tile: int) -> int:
    """Chunk sizes tile, 2·tile, ... up to the largest that fits in `rows`."""
    return max(1, (rows // tile).bit_length())


def chunks(group_sizes: jax.Array, tile: int, rows: int) -> Chunks:
    """The chunks covering groups of `group_sizes` rows (multiples of `tile`)."""
    levels = _levels(rows, tile)
    sizes = group_sizes.astype(jnp.int32)
    tiles, starts = sizes // tile, jnp.cumsum(sizes) - sizes
    j = jnp.arange(levels, dtype=jnp.int32)[:, None]
    has = ((tiles[None, :] >> j) & 1).reshape(-1)  # [levels * E]
    start = (starts[None, :] + ((tiles[None, :] >> (j + 1)) << (j + 1)) * tile).reshape(-1)
    order = jnp.argsort(1 - has, stable=True)  # real chunks first
    expert = jnp.broadcast_to(jnp.arange(sizes.shape[0], dtype=jnp.int32), (levels, sizes.shape[0]))
    level = jnp.broadcast_to(j, (levels, sizes.shape[0]))
    return Chunks(
        tiles=tiles,
        starts=starts,
        start=start[order],
        expert=expert.reshape(-1)[order],
        level=level.reshape(-1)[order],
        count=has.sum(),
    )


def _over_chunks(plan: Chunks, tile: int, rows: int, body, init, *refs):
    """`init` through `body(size, start, expert, carry)` for every chunk: one loop, the
    chunk's size chosen by a switch (each size a static shape)."""
    branches = [partial(body, tile << j) for j in range(_levels(rows, tile))]

    def step(i, carry):
        return jax.lax.switch(plan.level[i], branches, plan.start[i], plan.expert[i], carry)

    return jax.lax.fori_loop(0, plan.count, step, varying_like(init, plan.count, *refs))


def tiled_gmm(x: jax.Array, w: jax.Array, group_sizes: jax.Array, tile: int) -> jax.Array:
    """[R, d] x [E, d, f] -> [R, f] for groups of `group_sizes` rows (multiples of
    `tile`) in expert order; rows past the groups come out zero."""
    # Inside shard_map, x and w may vary over different mesh axes (tokens over the
    # data axis, experts over the intra axis). Giving both the same type first lets
    # JAX's own transpose reduce w's gradient over the axes w does not vary on.
    x, w = vary_like(x, w), vary_like(w, x)
    return _tiled_gmm(x, w, chunks(group_sizes, tile, x.shape[0]), tile)


def _rows_times(a: jax.Array, w: jax.Array, plan: Chunks, tile: int, transpose: bool):
    """Each chunk of `a`'s rows times its expert's `w` (or `w`^T), in place."""
    out_dim = w.shape[1] if transpose else w.shape[2]

    def body(size, start, e, out):
        chunk = jax.lax.dynamic_slice_in_dim(a, start, size, 0)
        weight = w[e].T if transpose else w[e]
        y = jnp.dot(chunk, weight, preferred_element_type=jnp.float32).astype(out.dtype)
        return jax.lax.dynamic_update_slice_in_dim(out, y, start, 0)

    out = jnp.zeros((a.shape[0], out_dim), a.dtype)
    return _over_chunks(plan, tile, a.shape[0], body, out, a, w)


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _tiled_gmm(x, w, plan, tile):
    return _rows_times(x, w, plan, tile, transpose=False)


def _tiled_fwd(x, w, plan, tile):
    return _rows_times(x, w, plan, tile, transpose=False), (x, w, plan)


def _tiled_bwd(tile, residuals, dy):
    x, w, plan = residuals
    dx = _rows_times(dy, w, plan, tile, transpose=True)
    return dx, _weight_grads(x, dy, plan, tile).astype(w.dtype), jax.tree.map(lambda a: None, plan)


def _weight_grads(x: jax.Array, dy: jax.Array, plan: Chunks, tile: int) -> jax.Array:
    """[E, d, f] float32: each expert's x^T dy over its chunks, computed and written once
    per expert (no zero-filled buffer, no read-modify-write per chunk)."""
    levels = _levels(x.shape[0], tile)
    zeros = varying_zeros((x.shape[1], dy.shape[1]), jnp.float32, x, dy, plan.count)

    def product(start, size):
        a = jax.lax.dynamic_slice_in_dim(x, start, size, 0)
        b = jax.lax.dynamic_slice_in_dim(dy, start, size, 0)
        return jnp.dot(a.T, b, preferred_element_type=jnp.float32) + zeros

    def expert(_, e):
        tiles, first = plan.tiles[e], plan.starts[e]
        top = 32 - jax.lax.clz(tiles)  # bits of the tile count; 0 for an empty group
        at = lambda j: first + ((tiles >> (j + 1)) << (j + 1)) * tile  # chunk of bit j
        largest = [lambda: zeros] + [
            partial(lambda j: product(at(j), tile << j), j) for j in range(levels)
        ]
        grad = jax.lax.switch(top, largest)
        for j in range(levels - 1):
            present = (j < top - 1) & (((tiles >> j) & 1) == 1)
            grad = jax.lax.cond(
                present, lambda g, j=j: g + product(at(j), tile << j), lambda g: g, grad
            )
        return None, grad

    return jax.lax.scan(expert, None, jnp.arange(plan.tiles.shape[0]))[1]


_tiled_gmm.defvjp(_tiled_fwd, _tiled_bwd)
