"""The MoE feed-forward block: route -> dispatch -> expert compute -> combine.

Each step is a replaceable function (`routing.route`, `experts.IMPLS[...]`,
which use `dispatch`); `moe_forward` wires them for one group of tokens and a
contiguous range of experts, and the block's `Layout` decides where that runs
(one device, or inside an expert-parallel collective in `moe_jax.parallel`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from moe_jax.config import MoEConfig
from moe_jax.model.axes import constrain, param
from moe_jax.model.layers import MLP
from moe_jax.moe import experts, losses
from moe_jax.moe.routing import Routing, route
from moe_jax.parallel.layout import SINGLE_DEVICE, Layout


class RouterBias(nnx.Variable):
    """Aux-loss-free balancing bias: steers selection, updated outside the optimizer."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MoEStats:
    """What one MoE layer reports; stacked over layers by the model's scan."""

    aux_loss: jax.Array
    seq_aux_loss: jax.Array
    z_loss: jax.Array
    load: jax.Array  # [E] assignments per expert, before drops
    dropped_fraction: jax.Array

    def max_over_mean(self) -> jax.Array:
        """Load of the busiest expert over the mean load (1.0 = perfectly balanced)."""
        return self.load.max(-1) / jnp.maximum(self.load.mean(-1), 1e-9)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MoEParams:
    router: jax.Array  # [d, E]
    bias: jax.Array  # [E]
    experts: experts.ExpertWeights  # [E_local, ...]: this device's experts


def _only_experts(routing: Routing, first: int, count: int) -> Routing:
    """The assignments to experts [first, first + count), renumbered from zero."""
    local = routing.expert_index - first
    mine = routing.keep & (local >= 0) & (local < count)
    return dataclasses.replace(
        routing,
        expert_index=jnp.where(mine, local, 0),
        weights=jnp.where(mine, routing.weights, 0.0),
        keep=mine,
    )


def moe_forward(
    tokens: jax.Array, params: MoEParams, cfg: MoEConfig, batch: int, first_expert=0
) -> tuple[jax.Array, losses.RouterStats]:
    """Routed experts for `tokens` [T, d] from `batch` whole sequences.

    Computes only the experts present in `params.experts` (numbered from
    `first_expert`); the caller sums the partial outputs of all expert owners.
    """
    routing = route(tokens, params.router, params.bias, cfg)
    local = params.experts.gate.shape[0]
    compute_cfg = dataclasses.replace(cfg, num_experts=local)
    impl = experts.IMPLS[experts.resolve_impl(compute_cfg)]
    y = impl(tokens, _only_experts(routing, first_expert, local), params.experts, compute_cfg)
    stats = losses.router_stats(routing, batch)
    return y, stats


class MoE(nnx.Module):
    """E routed SwiGLU experts (+ optional always-on shared experts)."""

    def __init__(self, dim: int, cfg: MoEConfig, *, rngs: nnx.Rngs, layout: Layout = SINGLE_DEVICE):
        e, f = cfg.num_experts, cfg.expert_mlp_dim
        self.cfg = cfg
        self.layout = layout
        self.router = param(rngs, (dim, e), ("embed", None))
        self.bias = RouterBias(jnp.zeros((e,), jnp.float32))
        self.gate = param(rngs, (e, dim, f), experts.AXES.gate, fan_in=dim)
        self.up = param(rngs, (e, dim, f), experts.AXES.up, fan_in=dim)
        self.down = param(rngs, (e, f, dim), experts.AXES.down, fan_in=f)
        shared = cfg.num_shared_experts * cfg.shared_mlp_dim
        self.shared = MLP(dim, shared, rngs=rngs, layout=layout) if shared else None

    def __call__(self, x: jax.Array) -> tuple[jax.Array, MoEStats]:
        dtype = x.dtype
        weights = experts.ExpertWeights(
            self.gate[...].astype(dtype), self.up[...].astype(dtype), self.down[...].astype(dtype)
        )
        params = MoEParams(self.router[...], self.bias[...], weights)
        y, router_stats = self.layout.moe(moe_forward, x, params, self.cfg)
        if self.shared is not None:
            y = y + self.shared(x)
        stats = MoEStats(
            aux_loss=router_stats.aux_loss(),
            seq_aux_loss=router_stats.seq_aux_loss(),
            z_loss=router_stats.z_loss,
            load=router_stats.load.astype(jnp.float32),
            dropped_fraction=router_stats.dropped_fraction,
        )
        return constrain(y, ("batch", "seq", "embed")), stats
