"""Dispatch and combine: move token copies into an expert-ordered buffer and back.

A `RowMap` says which buffer row each (token, choice) assignment occupies and
which token feeds each row. Dispatch is then one gather and combine one
weighted gather, with static shapes whatever the routing:

* `sorted_layout`: rows sorted by expert, each expert's group padded to a
  multiple of `tile` (tile=1: no padding, the `ragged_dot` contract).
  With a capacity, at most that many rows per expert in a buffer no larger than
  `[E, C]` buckets (capacity mode's expert compute: only kept rows are multiplied).
* `capacity_layout`: a fixed bucket of `capacity` rows per expert, `[E, C]`,
  filled in priority order; assignments past capacity were dropped by routing,
  or get no row (the all-to-all's bounded per-destination buffers).

Expert-parallel token dispatchers (`moe_jax.moe.dispatcher`) exchange these
buffers between devices without changing the router or the expert computation.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from moe_jax.moe.routing import Routing, capacity_keep


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowMap:
    row: jax.Array  # [T, k] buffer row of each assignment; num_rows where dropped
    source: jax.Array  # [R] token feeding each row; T marks an empty (zero) row
    group_sizes: jax.Array  # [E] rows owned by each expert (padding included)


def _round_up(x, multiple):
    return (x + multiple - 1) // multiple * multiple


def sorted_layout(
    routing: Routing, num_experts: int, tile: int = 1, capacity: int | None = None
) -> RowMap:
    """Rows grouped by expert in expert order, each group padded to `tile` rows. With
    `capacity`, each expert keeps at most that many rows (its first assignments in
    token order; capacity-mode routing never keeps more) in a buffer of at most
    `num_experts * capacity` rows plus the padding: what fixed [E, C] buckets hold."""
    num_tokens, k = routing.expert_index.shape
    assignments = num_tokens * k
    held = assignments if capacity is None else min(assignments, num_experts * capacity)
    num_rows = _round_up(held + num_experts * (tile - 1), tile)
    expert = jnp.where(routing.keep, routing.expert_index, num_experts).reshape(-1)
    order = jnp.argsort(expert, stable=True)
    counts = jnp.bincount(expert, length=num_experts + 1)[:num_experts]
    starts = jnp.cumsum(counts) - counts
    if capacity is not None:
        counts = jnp.minimum(counts, capacity)
    padded = _round_up(counts, tile)
    padded_ends = jnp.cumsum(padded)
    padded_starts = padded_ends - padded
    sorted_expert = expert[order]
    safe = jnp.minimum(sorted_expert, num_experts - 1)
    rank = jnp.arange(assignments) - starts[safe]
    placed = (sorted_expert < num_experts) & (rank < counts[safe])
    row_sorted = jnp.where(placed, padded_starts[safe] + rank, num_rows)
    row = jnp.zeros(assignments, jnp.int32).at[order].set(row_sorted.astype(jnp.int32))
    token = jnp.arange(assignments, dtype=jnp.int32) // k
    source = jnp.full(num_rows, num_tokens, jnp.int32).at[row].set(token, mode="drop")
    return RowMap(
        row=row.reshape(num_tokens, k), source=source, group_sizes=padded.astype(jnp.int32)
    )


def capacity_layout(routing: Routing, num_experts: int, capacity: int) -> RowMap:
    """A `[num_experts, capacity]` bucket per expert, best-weighted kept assignments
    first (ties to the earlier token). A kept assignment past its bucket gets no row
    (`num_rows`, as if dropped): callers whose routing may overflow read that as a drop."""
    num_tokens = routing.expert_index.shape[0]
    num_rows = num_experts * capacity
    priority = jnp.where(routing.keep, routing.weights, -1.0)  # dropped ones rank last
    fits, rank = capacity_keep(routing.expert_index, priority, num_experts, capacity)
    row = jnp.where(routing.keep & fits, routing.expert_index * capacity + rank, num_rows)
    token = jnp.broadcast_to(jnp.arange(num_tokens, dtype=jnp.int32)[:, None], row.shape)
    source = jnp.full(num_rows, num_tokens, jnp.int32)
    source = source.at[row.reshape(-1)].set(token.reshape(-1), mode="drop")
    return RowMap(
        row=row.astype(jnp.int32),
        source=source,
        group_sizes=jnp.full(num_experts, capacity, jnp.int32),
    )


def dispatch(x: jax.Array, rows: RowMap) -> jax.Array:
    """Token rows [T, d] -> expert-ordered buffer [R, d] (empty rows are zero)."""
    return _dispatch(x, rows.source, rows.row)


@jax.custom_vjp
def _dispatch(x, source, row):
    return _gather_rows(x, source)


def _gather_rows(a: jax.Array, index: jax.Array) -> jax.Array:
    """a[index], where an index of len(a) reads a zero row."""
    return jnp.concatenate([a, jnp.zeros((1, a.shape[-1]), a.dtype)])[index]


def _dispatch_fwd(x, source, row):
    return _gather_rows(x, source), row


def _dispatch_bwd(row, grad):
    """Each token's gradient is the sum of its k rows': a gather by `row`, where the
    plain transpose of the forward's gather would be a scatter-add (slow on CPU)."""
    dx = jnp.sum(_gather_rows(grad, row), axis=1, dtype=jnp.float32).astype(grad.dtype)
    return dx, None, None


_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


def row_weights(rows: RowMap, routing: Routing) -> jax.Array:
    """[R] the routing weight of each buffer row's assignment (zero for empty rows)."""
    return _row_weights(rows.row, routing.weights, rows.source.shape[0])


def _row_weights(row: jax.Array, weights: jax.Array, num_rows: int) -> jax.Array:
    empty = jnp.zeros(num_rows, weights.dtype)
    return empty.at[row.reshape(-1)].set(weights.reshape(-1), mode="drop")


def combine(y: jax.Array, rows: RowMap, routing: Routing) -> jax.Array:
    """Buffer [R, d] -> tokens [T, d]: the routing-weighted sum of each token's rows."""
    return _combine(y, routing.weights.astype(y.dtype), rows.source, rows.row)


def _weighted_sum(y, weights, row):
    picked = _gather_rows(y, row)  # [T, k, d]; dropped assignments read the zero row
    out = jnp.einsum("tk,tkd->td", weights, picked, preferred_element_type=jnp.float32)
    return out.astype(y.dtype), picked


@jax.custom_vjp
def _combine(y, weights, source, row):
    return _weighted_sum(y, weights, row)[0]


def _combine_fwd(y, weights, source, row):
    out, picked = _weighted_sum(y, weights, row)
    return out, (picked, weights, source, row)


def _combine_bwd(residuals, grad):
    """Row r's gradient is its assignment's weight times its token's gradient: a gather
    by `source` (the forward's transpose would scatter-add into the rows)."""
    picked, weights, source, row = residuals
    row_weight = _row_weights(row, weights, source.shape[0])
    dy = (_gather_rows(grad, source) * row_weight[:, None]).astype(picked.dtype)
    dweights = jnp.einsum("td,tkd->tk", grad, picked, preferred_element_type=jnp.float32)
    return dy, dweights.astype(weights.dtype), None, None


_combine.defvjp(_combine_fwd, _combine_bwd)
