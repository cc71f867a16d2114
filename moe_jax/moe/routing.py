"""Route: which experts each token goes to, with what weight, and what is dropped.

The router always works in float32. Selection may add the balancing bias
(aux-loss-free balancing), but the combine weights come from the unbiased
scores, so the bias steers load without changing what a chosen expert is worth.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from moe_jax.config import MoEConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Routing:
    """The router's decisions for T tokens and k choices each."""

    expert_index: jax.Array  # [T, k] int32
    weights: jax.Array  # [T, k] float32 combine weights, zero where dropped
    keep: jax.Array  # [T, k] bool, False where capacity dropped the assignment
    logits: jax.Array  # [T, E] float32
    probs: jax.Array  # [T, E] float32 scores normalised to sum to one per token


def _select(scores: jax.Array, cfg: MoEConfig) -> jax.Array:
    """Top-k expert indices, limited to the best `topk_groups` groups when grouped; the
    other groups' experts are masked with -inf (biased scores can be negative, so a
    mask of 0 would let them win)."""
    if cfg.n_groups > 1:
        num_tokens = scores.shape[0]
        grouped = scores.reshape(num_tokens, cfg.n_groups, -1)
        if cfg.group_score == "max":  # DeepSeek-V2's group_limited_greedy
            group_score = grouped.max(-1)
        else:  # DeepSeek-V3: the sum of the best two
            best = min(2, grouped.shape[-1])
            group_score = jax.lax.top_k(grouped, best)[0].sum(-1)
        _, groups = jax.lax.top_k(group_score, cfg.topk_groups)
        allowed = jnp.zeros((num_tokens, cfg.n_groups), bool)
        allowed = allowed.at[jnp.arange(num_tokens)[:, None], groups].set(True)
        allowed = jnp.broadcast_to(allowed[..., None], grouped.shape).reshape(scores.shape)
        scores = jnp.where(allowed, scores, -jnp.inf)
    return jax.lax.top_k(scores, cfg.top_k)[1]


def capacity_keep(expert_index: jax.Array, weights: jax.Array, num_experts: int, capacity: int):
    """Keeps, per expert, the `capacity` assignments with the largest weight.

    Ties go to the earlier token. Returns the keep mask and each assignment's
    rank inside its expert (0 = highest priority), both [T, k].
    """
    flat_e = expert_index.reshape(-1)
    flat_w = weights.reshape(-1)
    order = jnp.lexsort((-flat_w, flat_e))  # by expert, then by falling weight
    sorted_e = flat_e[order]
    counts = jnp.bincount(flat_e, length=num_experts)
    starts = jnp.cumsum(counts) - counts
    rank_sorted = jnp.arange(flat_e.shape[0]) - starts[sorted_e]
    rank = jnp.zeros_like(flat_e).at[order].set(rank_sorted)
    rank = rank.reshape(expert_index.shape)
    return rank < capacity, rank


def router_logits(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """[..., d] tokens -> [..., E] router logits, in float32."""
    return jnp.dot(x.astype(jnp.float32), kernel.astype(jnp.float32))


def route(
    x: jax.Array,
    kernel: jax.Array,
    bias: jax.Array,
    cfg: MoEConfig,
    logits: jax.Array | None = None,
) -> Routing:
    """Routes tokens `x` [T, d] with router `kernel` [d, E] and balancing `bias` [E];
    `logits` [T, E], when given, are the router's logits of these tokens computed where
    they were more precise (before a compressed exchange)."""
    logits = router_logits(x, kernel) if logits is None else logits
    if cfg.score_fn == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
        probs = scores
    else:
        scores = jax.nn.sigmoid(logits)
        probs = scores / scores.sum(-1, keepdims=True)
    expert_index = _select(scores + jax.lax.stop_gradient(bias), cfg)
    weights = jnp.take_along_axis(scores, expert_index, axis=-1)
    if cfg.renormalize:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    weights = weights * cfg.routed_scaling
    keep = jnp.ones(expert_index.shape, bool)
    if not cfg.dropless:
        capacity = cfg.capacity(x.shape[0])
        keep, _ = capacity_keep(expert_index, weights, cfg.num_experts, capacity)
        weights = jnp.where(keep, weights, 0.0)
    return Routing(expert_index.astype(jnp.int32), weights, keep, logits, probs)


def expert_load(routing: Routing, num_experts: int) -> jax.Array:
    """Assignments each expert received from the router, before any drop [E]."""
    return jnp.bincount(routing.expert_index.reshape(-1), length=num_experts)


def restrict(routing: Routing, first: int | jax.Array, count: int) -> Routing:
    """The assignments to experts [first, first + count), renumbered from zero: what a
    device holding those experts computes."""
    local = routing.expert_index - first
    mine = routing.keep & (local >= 0) & (local < count)
    return dataclasses.replace(
        routing,
        expert_index=jnp.where(mine, local, 0),
        weights=jnp.where(mine, routing.weights, 0.0),
        keep=mine,
    )
