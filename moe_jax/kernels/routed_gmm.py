"""The MoE's two routed products as differentiable ops over the Pallas kernels.

Rows are the (token, choice) assignments sorted by expert; `token` [M] names the
token of each sorted row (>= T: an empty row) and `group_sizes` [E] how many rows
each expert owns.

* `gather_gmm`: the up-projections, y_r = x[token_r] . w[e(r)]. The dispatch
  gather is the kernel's prologue, so the permuted [M, d] copy of the tokens is
  never written. Backward: dx accumulates each row's dy . w^T straight into token
  order (the kernel's atomic epilogue, no scatter-add pass), and dw is the
  transposed kernel reading x through the same map.
* `gmm_scatter`: the down-projection and combine, out[token_r] += c_r h_r . w[e(r)].
  The combine weight and the return to token order are the epilogue, so the
  unpermuted copy is never written either. Backward: g_r = dout[token_r] . w^T
  (gather prologue), dh = c g, dc = <g, h>, and dw reads dout through the map,
  scaled by c.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from moe_jax.kernels.pallas_gmm import grouped_matmul, transposed_grouped_matmul
from moe_jax.kernels.varying import vary_like


def gather_gmm(x: jax.Array, w: jax.Array, token: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """[T, K] tokens x [E, K, N] -> [M, N] sorted rows (zero where no expert owns a row)."""
    x, w = vary_like(x, w), vary_like(w, x)
    return _gather_gmm(x, w, token, group_sizes)


def gmm_scatter(
    h: jax.Array,
    w: jax.Array,
    token: jax.Array,
    weight: jax.Array,
    group_sizes: jax.Array,
    num_tokens: int,
) -> jax.Array:
    """[M, K] sorted rows x [E, K, N] -> [T, N] tokens, each the weighted sum of its rows."""
    h, w, weight = (
        vary_like(h, w, weight),
        vary_like(w, h, weight),
        vary_like(weight, h, w),
    )
    return _gmm_scatter(h, w, token, weight, group_sizes, num_tokens)


@jax.custom_vjp
def _gather_gmm(x, w, token, group_sizes):
    return grouped_matmul(x, w, group_sizes, lhs_rows=token)


def _gather_fwd(x, w, token, group_sizes):
    return _gather_gmm(x, w, token, group_sizes), (x, w, token, group_sizes)


def _gather_bwd(residuals, dy):
    x, w, token, group_sizes = residuals
    dx = grouped_matmul(
        dy, w, group_sizes, out_rows=token, num_out_rows=x.shape[0], transpose_rhs=True
    )
    dw = transposed_grouped_matmul(x, dy, group_sizes, rows=token.shape[0], lhs_rows=token)
    return dx.astype(x.dtype), dw.astype(w.dtype), None, None


_gather_gmm.defvjp(_gather_fwd, _gather_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(5,))
def _gmm_scatter(h, w, token, weight, group_sizes, num_tokens):
    out = grouped_matmul(
        h, w, group_sizes, out_rows=token, out_scale=weight, num_out_rows=num_tokens
    )
    return out.astype(h.dtype)


def _scatter_fwd(h, w, token, weight, group_sizes, num_tokens):
    out = _gmm_scatter(h, w, token, weight, group_sizes, num_tokens)
    return out, (h, w, token, weight, group_sizes)


def _scatter_bwd(num_tokens, residuals, dout):
    h, w, token, weight, group_sizes = residuals
    rows = token.shape[0]
    g = grouped_matmul(dout, w, group_sizes, rows=rows, lhs_rows=token, transpose_rhs=True)
    g = g.astype(jnp.float32)
    dh = (g * weight.astype(jnp.float32)[:, None]).astype(h.dtype)
    dweight = jnp.sum(g * h.astype(jnp.float32), axis=-1).astype(weight.dtype)
    dw = transposed_grouped_matmul(
        h, dout, group_sizes, rows=rows, rhs_rows=token, rhs_scale=weight
    )
    return dh, dw.astype(w.dtype), None, dweight, None


_gmm_scatter.defvjp(_scatter_fwd, _scatter_bwd)
