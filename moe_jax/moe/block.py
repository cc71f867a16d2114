"""The MoE feed-forward block: route -> dispatch -> expert compute -> combine.

Each step is a replaceable function (`routing.route`, `experts.IMPLS[...]`,
which use `dispatch`); this module only owns the parameters and wires them.
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
from moe_jax.moe.routing import expert_load, route


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


class MoE(nnx.Module):
    """E routed SwiGLU experts (+ optional always-on shared experts)."""

    def __init__(self, dim: int, cfg: MoEConfig, *, rngs: nnx.Rngs):
        e, f = cfg.num_experts, cfg.expert_mlp_dim
        self.cfg = cfg
        self.router = param(rngs, (dim, e), ("embed", None))
        self.bias = RouterBias(jnp.zeros((e,), jnp.float32))
        self.gate = param(rngs, (e, dim, f), ("experts", "embed", "mlp"), fan_in=dim)
        self.up = param(rngs, (e, dim, f), ("experts", "embed", "mlp"), fan_in=dim)
        self.down = param(rngs, (e, f, dim), ("experts", "mlp", "embed"), fan_in=f)
        shared = cfg.num_shared_experts * cfg.shared_mlp_dim
        self.shared = MLP(dim, shared, rngs=rngs) if shared else None

    def __call__(self, x: jax.Array) -> tuple[jax.Array, MoEStats]:
        batch, seq, dim = x.shape
        cfg, dtype = self.cfg, x.dtype
        tokens = x.reshape(batch * seq, dim)
        routing = route(tokens, self.router[...], self.bias[...], cfg)
        weights = experts.ExpertWeights(
            self.gate[...].astype(dtype), self.up[...].astype(dtype), self.down[...].astype(dtype)
        )
        impl = experts.IMPLS[experts.resolve_impl(cfg)]
        y = impl(tokens, routing, weights, cfg).reshape(batch, seq, dim)
        if self.shared is not None:
            y = y + self.shared(x)
        stats = MoEStats(
            aux_loss=losses.load_balancing_loss(routing),
            seq_aux_loss=losses.sequence_balancing_loss(routing, batch),
            z_loss=losses.router_z_loss(routing),
            load=expert_load(routing, cfg.num_experts).astype(jnp.float32),
            dropped_fraction=1.0 - routing.keep.mean(),
        )
        return constrain(y, ("batch", "seq", "embed")), stats
