"""Router losses. Each is returned on its own so it can be weighted and logged.

Conventions (the load-balancing losses equal 1.0 under perfectly uniform routing):
  f_i = assignments to expert i / (tokens * k)      (counted before capacity drops)
  P_i = mean over tokens of the normalised router probability of expert i
  aux = E * sum_i f_i * P_i                          (Switch Transformer, over the batch)
  seq_aux = the same per sequence, averaged over sequences  (DeepSeek-V3)
  z = mean over tokens of logsumexp(logits)^2        (ST-MoE router z-loss)
"""

from __future__ import annotations

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
