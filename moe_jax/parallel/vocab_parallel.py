"""Vocabulary-parallel embedding, output head and cross-entropy (Megatron-LM's), over the
intra group.

With `parallel.vocab_parallel` the embedding table and the output head are stored
split over the vocabulary on the intra group, so their weights, gradients and AdamW
moments take 1/n of the memory, and neither is ever gathered:

* the lookup gathers the intra group's token ids (int32, small), each device takes
  the rows its vocabulary shard holds (zeros elsewhere), and a reduce-scatter sums
  them and hands each device its own tokens;
* the loss runs per chunk of the sequence (`moe_jax.model.loss`): each device
  gathers the chunk's hidden states of its group, multiplies them by its [d, V/n]
  slice of the head, and the softmax cross-entropy is reduced across the group (the
  row maximum and the sum of exponentials over the vocabulary, and the target's
  logit from the one device whose slice holds it). Only [tokens, V/n] float32
  logits exist on a device; the gather's transpose sums the devices' partial input
  gradients and hands each its own tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from moe_jax.model.layers import cast_like
from moe_jax.parallel.layout import DATA, INTRA
from moe_jax.parallel.scopes import LOSS_EXCHANGE, TOKEN_EXCHANGE
from moe_jax.parallel.spec import VocabSpec


def _token_axis(layout) -> int:
    """Which dimension of [batch, seq, ...] the layout splits over the intra group."""
    return 1 if set(INTRA) & set(layout.seq_axes) else 0


def _gather_group(x: jax.Array, axis: int) -> jax.Array:
    return jax.lax.all_gather(x, INTRA, axis=axis, tiled=True)


def _local(ids: jax.Array, width: int) -> tuple[jax.Array, jax.Array]:
    """Indices of `ids` in this device's vocabulary shard of `width` rows, and whether
    the shard holds them."""
    local = ids - jax.lax.axis_index(INTRA) * width
    return jnp.clip(local, 0, width - 1), (local >= 0) & (local < width)


def embed(layout, table: jax.Array, tokens: jax.Array) -> jax.Array:
    """Rows of `table` [V, d] (split over the vocabulary) for `tokens` [b, s]."""
    axis = _token_axis(layout)
    spec = layout.activation_spec()

    def body(table, tokens):
        with jax.named_scope(TOKEN_EXCHANGE):
            tokens = _gather_group(tokens, axis)
        index, here = _local(tokens, table.shape[0])
        rows = jnp.where(here[..., None], jnp.take(table, index, axis=0), 0.0)
        with jax.named_scope(TOKEN_EXCHANGE):
            return jax.lax.psum_scatter(rows, INTRA, scatter_dimension=axis, tiled=True)

    in_specs = (P(INTRA, None), P(*spec[:2]))
    return layout.block_map(body, in_specs, spec)(table, tokens)


def cross_entropy(
    layout, x: jax.Array, head: jax.Array, targets: jax.Array, weights: jax.Array | None = None
) -> jax.Array:
    """Summed cross-entropy of logits `x @ head` ([b, c, d] x [d, V] as stored, float32
    logits) against `targets` [b, c], with the vocabulary split over the intra group;
    each token's times its weight where `weights` [b, c] are given. The head is cast
    inside, so its gradient is reduced over 'data' in float32."""
    axis = _token_axis(layout)
    spec = layout.activation_spec()

    def body(x, head, targets, *weights):
        with jax.named_scope(LOSS_EXCHANGE):
            x, targets = _gather_group(x, axis), _gather_group(targets, axis)
        logits = jnp.einsum(
            "bsd,dv->bsv", x, cast_like(head, x), preferred_element_type=jnp.float32
        )
        index, here = _local(targets, logits.shape[-1])
        picked = jnp.where(here, jnp.take_along_axis(logits, index[..., None], -1)[..., 0], 0.0)
        # The maximum only keeps exp() in range; its gradient cancels, so none flows.
        top = jax.lax.stop_gradient(logits).max(-1)
        with jax.named_scope(LOSS_EXCHANGE):
            top = jax.lax.pmax(top, INTRA)
            total = jax.lax.psum(jnp.exp(logits - top[..., None]).sum(-1), INTRA)
            target = jax.lax.psum(picked, INTRA)
            losses = jnp.log(total) + top - target
            group = _weighted(losses, weights[0], axis) if weights else losses.sum()
            # group: the group's sum, on each of its n
            if layout.per_device:  # one device's share: the step's mean adds the rest
                return group / layout.size(INTRA)
            return jax.lax.psum(group, DATA)

    given = () if weights is None else (weights,)
    in_specs = (spec, P(None, INTRA), *[P(*spec[:2])] * (1 + len(given)))
    return layout.block_map(body, in_specs, P())(x, head, targets, *given)


def _weighted(losses: jax.Array, weights: jax.Array, axis: int) -> jax.Array:
    """The group's weighted sum of `losses` (of all the group's tokens, on each device)
    with each device's `weights` of its own tokens: its slice, weighted, summed over
    the group (a scalar, where gathering the weights would be [b, c])."""
    size = weights.shape[axis]
    start = jax.lax.axis_index(INTRA) * size
    own = jax.lax.dynamic_slice_in_dim(losses, start, size, axis)
    return jax.lax.psum((own * weights).sum(), INTRA)


def _problems(config) -> list[str]:
    p, m = config.parallel, config.model
    if not p.vocab_parallel:
        return []
    if p.intra == 1:
        return [
            "parallel.vocab_parallel splits the vocabulary over the intra group; it needs "
            "parallel.intra > 1"
        ]
    if m.vocab_size % p.intra:
        return [
            f"model.vocab_size={m.vocab_size} must be divisible by parallel.intra={p.intra} "
            "for parallel.vocab_parallel (pad the vocabulary to a multiple)"
        ]
    return []


VOCAB_PARALLEL = VocabSpec(
    name="vocab_parallel",
    embed=embed,
    cross_entropy=cross_entropy,
    rules=(("vocab", INTRA),),
    problems=_problems,
)
