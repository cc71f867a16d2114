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

from moe_jax.moe.routing import Routing, expert_load


def _fraction_and_prob(expert_index: jax.Array, probs: jax.Array, num_experts: int):
    """(f, P) over the token axis of [..., T, k] expert indices and [..., T, E] probs."""
    one_hot = jax.nn.one_hot(expert_index, num_experts, dtype=jnp.float32)
    return one_hot.sum(-2).mean(-2) / expert_index.shape[-1], probs.mean(-2)


def _balance(fraction: jax.Array, mean_prob: jax.Array) -> jax.Array:
    """E * sum_i f_i P_i; f counts decisions, so only P carries gradient."""
    return fraction.shape[-1] * (jax.lax.stop_gradient(fraction) * mean_prob).sum(-1)


def load_balancing_loss(routing: Routing) -> jax.Array:
    """Switch-style loss over all tokens of the call."""
    return router_stats(routing, 1).aux_loss()


def sequence_balancing_loss(routing: Routing, batch_size: int) -> jax.Array:
    """Per-sequence variant: balance inside each of `batch_size` sequences, then average."""
    return router_stats(routing, batch_size).seq_aux_loss()


def router_z_loss(routing: Routing) -> jax.Array:
    """Penalises large router logits, which keeps the fp32 router numerically tame."""
    return jnp.mean(jnp.square(jax.nn.logsumexp(routing.logits, axis=-1)))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RouterStats:
    """Router statistics of one shard of tokens, kept as means (and one sum) so that
    shards of equal size combine exactly into the statistics of the whole batch."""

    fraction: jax.Array  # [E] f_i over the shard's tokens
    mean_prob: jax.Array  # [E] P_i
    seq_fraction: jax.Array  # [B, E] f_i per sequence (of this shard's part of it)
    seq_prob: jax.Array  # [B, E] P_i per sequence
    z_loss: jax.Array
    load: jax.Array  # [E] assignments (a sum, not a mean)
    dropped_fraction: jax.Array

    def aux_loss(self) -> jax.Array:
        return _balance(self.fraction, self.mean_prob)

    def seq_aux_loss(self) -> jax.Array:
        return _balance(self.seq_fraction, self.seq_prob).mean(-1)

    def combine(self, batch_axes=(), seq_axes=(), copy_axes=()) -> RouterStats:
        """Whole-batch statistics from equal shards spread over mesh axes.

        `batch_axes` hold different sequences, `seq_axes` different tokens of the
        same sequences, `copy_axes` identical copies (averaged, which also marks
        the result replicated and spreads its gradient evenly over the copies).
        Every statistic is written as a sum over all those axes (the per-sequence
        rows placed at their shard's offset), so that the whole combine is one
        all-reduce per layer rather than one per kind of statistic.
        """
        every = (*batch_axes, *seq_axes, *copy_axes)
        if not every:
            return self
        mean = lambda x, axes: x / jax.lax.psum(1, axes) if axes else x  # of a psum
        placed = lambda x: _placed_rows(x, batch_axes) if batch_axes else x
        total = jax.lax.psum(
            dataclasses.replace(
                self, seq_fraction=placed(self.seq_fraction), seq_prob=placed(self.seq_prob)
            ),
            every,
        )
        within = (*seq_axes, *copy_axes)  # the shards of each sequence's statistics
        return RouterStats(
            fraction=mean(total.fraction, every),
            mean_prob=mean(total.mean_prob, every),
            seq_fraction=mean(total.seq_fraction, within),
            seq_prob=mean(total.seq_prob, within),
            z_loss=mean(total.z_loss, every),
            load=mean(total.load, copy_axes),
            dropped_fraction=mean(total.dropped_fraction, every),
        )


def merge_chunks(chunks: list[RouterStats]) -> RouterStats:
    """The statistics of equal chunks of the same sequences (each chunk holds the same
    number of positions of every sequence): means averaged, the load summed."""
    mean = lambda *xs: sum(xs) / len(xs)
    merged = jax.tree.map(mean, *chunks)
    return dataclasses.replace(merged, load=sum(chunk.load for chunk in chunks))


def _placed_rows(x: jax.Array, axes) -> jax.Array:
    """`x` at its shard's rows of a zero [shards * rows, ...] array (in mesh order), so
    that a psum over `axes` stacks all shards' rows."""
    index = jax.lax.axis_index(axes)
    full = jnp.zeros((jax.lax.psum(1, axes) * x.shape[0], *x.shape[1:]), x.dtype)
    return jax.lax.dynamic_update_slice_in_dim(full, x, index * x.shape[0], 0)


def router_stats(routing: Routing, batch_size: int) -> RouterStats:
    """The statistics of `routing` over `batch_size` whole sequences."""
    num_experts = routing.probs.shape[-1]
    fraction, mean_prob = _fraction_and_prob(routing.expert_index, routing.probs, num_experts)
    k = routing.expert_index.shape[-1]
    seq_fraction, seq_prob = _fraction_and_prob(
        routing.expert_index.reshape(batch_size, -1, k),
        routing.probs.reshape(batch_size, -1, num_experts),
        num_experts,
    )
    return RouterStats(
        fraction=fraction,
        mean_prob=mean_prob,
        seq_fraction=seq_fraction,
        seq_prob=seq_prob,
        z_loss=router_z_loss(routing),
        load=expert_load(routing, num_experts),
        dropped_fraction=1.0 - routing.keep.mean(),
    )
