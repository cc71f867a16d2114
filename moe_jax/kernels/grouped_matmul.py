"""Grouped matrix multiplication: rows grouped by expert, one weight matrix per group.

Two implementations with different layouts of the rows:

* `ragged_gmm`: rows sorted by expert, unpadded, `group_sizes` per expert;
  XLA's own `lax.ragged_dot`, the natural GPU/TPU path. XLA:CPU lowers it
  densely (cost grows with the number of experts), so on CPU it is slow.
* `tiled_gmm`: rows sorted by expert with each group padded to a multiple of
  `tile` rows, so every tile belongs to one expert. A loop over the tiles in
  use multiplies each tile by its expert's weights. Cost is independent of the
  number of experts (apart from padding). Its backward runs the same loop and
  accumulates each expert's weight gradient in place, never materialising a
  copy of the weights per tile.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from moe_jax.kernels.varying import varying_like


def ragged_gmm(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """[M, d] x [E, d, f] -> [M, f] for rows grouped by `group_sizes` [E]."""
    return jax.lax.ragged_dot(x, w, group_sizes.astype(jnp.int32))


def _tile_loop(num_tiles: jax.Array, body, init, *refs):
    return jax.lax.fori_loop(0, num_tiles, body, varying_like(init, num_tiles, *refs))


def tiled_gmm(
    x: jax.Array, w: jax.Array, tile_expert: jax.Array, num_tiles: jax.Array, tile: int
) -> jax.Array:
    """[NT*tile, d] x [E, d, f] -> [NT*tile, f]; tile t uses w[tile_expert[t]].

    Only the first `num_tiles` tiles are computed; the rest of the output is zero.
    """
    # Inside shard_map, x and w may vary over different mesh axes (tokens over the
    # data axis, experts over the intra axis). Giving both the same type first lets
    # JAX's own transpose reduce w's gradient over the axes w does not vary on.
    x, w = varying_like(x, w), varying_like(w, x)
    return _tiled_gmm(x, w, tile_expert, num_tiles, tile)


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def _tiled_gmm(x, w, tile_expert, num_tiles, tile):
    return _tiled_forward(x, w, tile_expert, num_tiles, tile)


def _tiled_forward(x, w, tile_expert, num_tiles, tile):
    rows, d = x.shape
    xt = x.reshape(rows // tile, tile, d)

    def body(t, out):
        y = jnp.dot(xt[t], w[tile_expert[t]], preferred_element_type=jnp.float32)
        return jax.lax.dynamic_update_index_in_dim(out, y.astype(out.dtype), t, 0)

    out = jnp.zeros((rows // tile, tile, w.shape[-1]), x.dtype)
    return _tile_loop(num_tiles, body, out, x, w, tile_expert).reshape(rows, w.shape[-1])


def _tiled_fwd(x, w, tile_expert, num_tiles, tile):
    return _tiled_forward(x, w, tile_expert, num_tiles, tile), (x, w, tile_expert, num_tiles)


def _tiled_bwd(tile, residuals, dy):
    x, w, tile_expert, num_tiles = residuals
    rows, d = x.shape
    xt = x.reshape(rows // tile, tile, d)
    dyt = dy.reshape(rows // tile, tile, -1)

    def body(t, carry):
        dx, dw = carry
        e = tile_expert[t]
        dx_t = jnp.dot(dyt[t], w[e].T, preferred_element_type=jnp.float32)
        dx = jax.lax.dynamic_update_index_in_dim(dx, dx_t.astype(dx.dtype), t, 0)
        dw_e = jnp.dot(xt[t].T, dyt[t], preferred_element_type=jnp.float32)
        dw = jax.lax.dynamic_update_index_in_dim(dw, dw[e] + dw_e, e, 0)
        return dx, dw

    dx = jnp.zeros_like(xt)
    dw = jnp.zeros(w.shape, jnp.float32)
    dx, dw = _tile_loop(num_tiles, body, (dx, dw), x, w, tile_expert, dy)
    return dx.reshape(rows, d), dw.astype(w.dtype), None, None


_tiled_gmm.defvjp(_tiled_fwd, _tiled_bwd)
