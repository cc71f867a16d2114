"""The token-dispatcher interface: how routed tokens reach their experts and come back.

Every expert layout runs the same MoE forward (`moe_jax.moe.block.moe_forward`):

    group   = gather(x)                      tokens to route (all-gather form: the group's)
    routing = route(group)                   router, top-k, capacity drops
    sent    = dispatch(group, routing)       rows for this device's experts (all-to-all)
    out     = expert compute(sent)           grouped SwiGLU on the local experts
    y       = scatter(combine(out, sent))    rows back to their tokens, weighted and summed
    stats   = reduce(router statistics)      equal to one device's over the whole batch

(`run` wires gather, the routed middle, scatter and reduce; a dispatcher that pipelines
its exchange with the compute, as the ring of `parallel.collective_matmul`, runs the
middle on one block of tokens at a time instead.)

so routing, router statistics, drop accounting and the combine are written once, and a
layout is a dispatcher (Megatron-Core's token dispatchers are the model). This base
class is the single-device dispatcher: all experts are here and nothing moves.
Exchanging dispatchers live in `moe_jax.parallel`; later variants (chunked,
compressed, fused) are new dispatchers, not copies of the forward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from moe_jax.config import MoEConfig
from moe_jax.moe.losses import RouterStats
from moe_jax.moe.routing import Routing


@dataclasses.dataclass(frozen=True)
class Dispatched:
    """What `dispatch` hands the expert compute, and keeps for `combine`.

    `rows` [R, d] with `routing` over the local experts (R = T and k choices when the
    tokens stay put; one choice of weight one per received row otherwise); `slots`
    overrides the capacity per expert of the `capacity` implementation when drops
    were decided over more experts than this device holds; `state` is the
    dispatcher's own.
    """

    rows: jax.Array
    routing: Routing
    slots: int | None = None
    state: Any = None


class TokenDispatcher:
    """Single device: every expert is local, every exchange is the identity."""

    def __init__(self, cfg: MoEConfig):
        self.cfg = cfg

    @property
    def compute_cfg(self) -> MoEConfig:
        """The config of the local expert compute (its `num_experts` are the local ones)."""
        return self.cfg

    def run(
        self, routed: Callable, x: jax.Array, logits_of: Callable
    ) -> tuple[jax.Array, RouterStats, jax.Array]:
        """`routed(tokens [b', s', d], logits or None) -> (partial y, statistics, rows)` on
        the tokens to route, and back: (y like `x`, the whole batch's statistics, the
        rows). A dispatcher that pipelines its exchange with the compute runs `routed` on
        blocks; one that compresses the tokens it moves computes their router logits
        first (`logits_of(x)`, float32) and moves those beside them, so that routing never
        sees the compressed tokens."""
        y, stats, rows = routed(self.gather(x))
        return self.scatter(y), self.reduce(stats), rows

    def gather(self, x: jax.Array) -> jax.Array:
        """[b, s, d] as the attention layout left it -> the tokens to route, [b', s', d]."""
        return x

    def dispatch(self, tokens: jax.Array, routing: Routing) -> Dispatched:
        """Routed tokens [T, d] -> rows for this device's experts."""
        return Dispatched(tokens, routing)

    def delivered(self, routing: Routing, sent: Dispatched) -> Routing:
        """`routing` less the assignments `dispatch` had no room for (bounded static
        buffers), so that the router statistics count them as drops."""
        return routing

    def combine(self, out: jax.Array, sent: Dispatched) -> jax.Array:
        """Expert outputs of `sent.rows` -> [T, d] for the routed tokens (partial sums
        where other devices hold the other experts)."""
        return out

    def scatter(self, y: jax.Array) -> jax.Array:
        """The inverse of `gather`: [b', s', d] -> [b, s, d] of this device's tokens."""
        return y

    def reduce(self, stats: RouterStats) -> RouterStats:
        """Router statistics of the routed tokens -> those of the whole batch."""
        return stats
