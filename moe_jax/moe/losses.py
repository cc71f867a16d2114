"""Router losses. Each is returned on its own so it can be weighted and logged.

Conventions (the load-balancing losses equal 1.0 under perfectly uniform routing):
  f_i = assignments to expert i / (tokens * k)      (counted before capacity drops)
  P_i = mean over tokens of the normalised router probability of expert i
  aux = E * sum_i f_i * P_i                          (Switch Transformer, over the batch)
  seq_aux = the same per sequence, averaged over sequences  (DeepSeek-V3)
  z = mean over tokens of logsumexp(logits)^2        (ST-MoE router z-loss)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from moe_jax.moe.routing import Routing


def _balance(expert_index: jax.Array, probs: jax.Array, num_experts: int) -> jax.Array:
    """E * sum_i f_i P_i over the leading token axis of [..., T, k] and [..., T, E]."""
    one_hot = jax.nn.one_hot(expert_index, num_experts, dtype=jnp.float32)  # [..., T, k, E]
    fraction = one_hot.sum(-2).mean(-2) / expert_index.shape[-1]
    mean_prob = probs.mean(-2)
    return num_experts * (jax.lax.stop_gradient(fraction) * mean_prob).sum(-1)


def load_balancing_loss(routing: Routing) -> jax.Array:
    """Switch-style loss over all tokens of the call."""
    return _balance(routing.expert_index, routing.probs, routing.probs.shape[-1])


def sequence_balancing_loss(routing: Routing, batch_size: int) -> jax.Array:
    """Per-sequence variant: balance inside each of `batch_size` sequences, then average."""
    num_experts = routing.probs.shape[-1]
    index = routing.expert_index.reshape(batch_size, -1, routing.expert_index.shape[-1])
    probs = routing.probs.reshape(batch_size, -1, num_experts)
    return _balance(index, probs, num_experts).mean()


def router_z_loss(routing: Routing) -> jax.Array:
    """Penalises large router logits, which keeps the fp32 router numerically tame."""
    return jnp.mean(jnp.square(jax.nn.logsumexp(routing.logits, axis=-1)))


def _fraction_and_prob(expert_index: jax.Array, probs: jax.Array, num_experts: int):
    one_hot = jax.nn.one_hot(expert_index, num_experts, dtype=jnp.float32)
    return one_hot.sum(-2).mean(-2) / expert_index.shape[-1], probs.mean(-2)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RouterStats:
    """Per-group router statistics that average (or add) exactly across equal groups,
    so data-parallel groups can combine them into the whole batch's losses."""

    fraction: jax.Array  # [E] f_i
    mean_prob: jax.Array  # [E] P_i
    seq_aux: jax.Array  # mean over this group's sequences of the per-sequence loss
    z_loss: jax.Array
    load: jax.Array  # [E] assignments (a sum, not a mean)
    dropped_fraction: jax.Array

    def aux_loss(self) -> jax.Array:
        num_experts = self.fraction.shape[-1]
        return num_experts * (jax.lax.stop_gradient(self.fraction) * self.mean_prob).sum(-1)

    def seq_aux_loss(self) -> jax.Array:
        return self.seq_aux

    def combine(self, axis_name) -> RouterStats:
        """Combines equal-sized groups along a mapped mesh axis."""
        mean = lambda x: jax.lax.pmean(x, axis_name)
        return RouterStats(
            fraction=mean(self.fraction),
            mean_prob=mean(self.mean_prob),
            seq_aux=mean(self.seq_aux),
            z_loss=mean(self.z_loss),
            load=jax.lax.psum(self.load, axis_name),
            dropped_fraction=mean(self.dropped_fraction),
        )


def router_stats(routing: Routing, batch_size: int, load: jax.Array) -> RouterStats:
    fraction, mean_prob = _fraction_and_prob(
        routing.expert_index, routing.probs, routing.probs.shape[-1]
    )
    return RouterStats(
        fraction=fraction,
        mean_prob=mean_prob,
        seq_aux=sequence_balancing_loss(routing, batch_size),
        z_loss=router_z_loss(routing),
        load=load,
        dropped_fraction=1.0 - routing.keep.mean(),
    )
