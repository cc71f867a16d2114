"""Synthetic token streams for tests and benchmarks (no files needed)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np


def recurrence_tokens(batch: int, length: int, vocab: int, rng: np.random.Generator) -> np.ndarray:
    """Sequences following x[i+1] = (x[i] + 1 + x[i-1] % 3) % vocab from a random start.

    Fully predictable from two tokens of context, so a working model's loss
    falls towards zero; a broken one stays near log(vocab).
    """
    out = np.empty((batch, length), np.int32)
    out[:, :2] = rng.integers(0, vocab, size=(batch, 2))
    for i in range(2, length):
        out[:, i] = (out[:, i - 1] + 1 + out[:, i - 2] % 3) % vocab
    return out


def batches(batch: int, seq_len: int, vocab: int, seed: int) -> Iterator[dict[str, np.ndarray]]:
    """Endless {'inputs', 'targets'} batches of [batch, seq_len] next-token pairs."""
    rng = np.random.default_rng(seed)
    while True:
        tokens = recurrence_tokens(batch, seq_len + 1, vocab, rng)
        yield {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
