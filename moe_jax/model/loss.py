"""Next-token cross-entropy computed over chunks of the sequence, so that the float32
[batch, seq, vocab] logits never exist: each chunk's logits are made, reduced to a loss
and dropped, and rebuilt from the chunk's hidden states in the backward pass.

Chunk c holds sequence positions c, c + C, c + 2C, ... of every sequence. Where a
layout splits the sequence into contiguous blocks over devices, every device then
holds its own share of every chunk, so chunking moves no data between devices.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import optax

from moe_jax.kernels.varying import varying_zeros

if TYPE_CHECKING:
    from moe_jax.config import Config

# Auto chunking keeps one chunk's float32 logits (for the whole batch) under this size,
# and chunks at least this many positions long.
MAX_CHUNK_LOGITS_BYTES = 256 * 2**20
MIN_CHUNK_POSITIONS = 64


def auto_chunks(batch: int, seq: int, vocab: int) -> int:
    """The fewest power-of-two chunks dividing `seq` whose logits fit the bound above,
    without chunks shorter than MIN_CHUNK_POSITIONS (1 when the whole fits)."""
    chunks = 1
    while (
        batch * (seq // chunks) * vocab * 4 > MAX_CHUNK_LOGITS_BYTES
        and seq % (2 * chunks) == 0
        and seq // (2 * chunks) >= MIN_CHUNK_POSITIONS
    ):
        chunks *= 2
    return chunks


def loss_chunks(config: Config, batch: int, seq: int) -> int:
    """`train.loss_chunks`, or with 0 the automatic choice for this micro-batch."""
    return config.train.loss_chunks or auto_chunks(batch, seq, config.model.vocab_size)


def cross_entropy_sum(
    x: jax.Array, head: jax.Array, targets: jax.Array, weights: jax.Array | None = None
) -> jax.Array:
    """Summed cross-entropy of float32 logits `x @ head` against `targets`, each token's
    times its weight where `weights` [b, s] are given (multi-token prediction masks the
    positions whose target lies past the sequence)."""
    logits = jnp.einsum("bsd,dv->bsv", x, head, preferred_element_type=jnp.float32)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return (losses if weights is None else losses * weights).sum()


def with_loss_weights(batch: dict) -> dict:
    """`batch` with float32 'weights' [b, s] from its 'loss_mask' (a document mask's):
    mask · b·s / (masked targets), so that a mean over all b·s positions is the mean
    over the counted targets. Made where the whole batch is, so that micro-batches and
    devices, each dividing by its own b·s, still average to that mean. Unchanged
    without a loss mask or with weights already."""
    if "loss_mask" not in batch or "weights" in batch:
        return batch
    mask = jnp.asarray(batch["loss_mask"]).astype(jnp.float32)
    return {**batch, "weights": mask * (mask.size / jnp.maximum(mask.sum(), 1.0))}


# (x, head, targets[, weights]) -> the chunk's summed (weighted) cross-entropy
ChunkLoss = Callable[..., jax.Array]


def chunked_cross_entropy(
    x: jax.Array,
    head: jax.Array,
    targets: jax.Array,
    chunks: int,
    chunk_loss: ChunkLoss = cross_entropy_sum,
    weights: jax.Array | None = None,
) -> jax.Array:
    """Mean cross-entropy of logits `x @ head` ([b, s, d] x [d, V], float32 logits)
    against `targets` [b, s], over `chunks` strided chunks of the sequence; `chunk_loss`
    sums one chunk's (a layout may split it over the vocabulary). With `weights` [b, s]
    each token's loss is weighted (the sum is still divided by b * s)."""
    b, s, d = x.shape
    xs = x.reshape(b, s // chunks, chunks, d).transpose(2, 0, 1, 3)
    strided = lambda t: t.reshape(b, s // chunks, chunks).transpose(2, 0, 1)
    parts = (xs, strided(targets)) if weights is None else (xs, strided(targets), strided(weights))
    # Keep only the chunk's inputs; its logits are rebuilt in the backward.
    one_chunk = jax.checkpoint(lambda x, *rest: chunk_loss(x, head, *rest))

    def body(total, chunk):
        return total + one_chunk(*chunk), None

    total, _ = jax.lax.scan(body, varying_zeros((), jnp.float32, x, head), parts)
    return total / (b * s)
