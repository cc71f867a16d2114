"""Windows of a token stream, each read checked against the model's vocabulary.

Why a module of its own: the single-source pipeline and the mixture both read
windows; the ids are checked where they are read, the one place that knows the file
and the offset of each token.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from moe_jax.data import shards


class PackedSequences:
    """Random-access source of non-overlapping windows of seq_len + 1 tokens (int32)."""

    def __init__(
        self,
        tokens: np.ndarray,
        seq_len: int,
        name: str = "the split",
        file: str = "",
        vocab_size: int = 0,
    ) -> None:
        """`file` and `vocab_size` given, every window read is checked against the
        vocabulary (`check_ids`): the stored max_id is what prepare wrote, not what the
        file holds now."""
        window = seq_len + 1
        self._file, self._vocab_size = file, vocab_size
        if len(tokens) < window:
            raise ValueError(
                f"{name} has {len(tokens)} tokens, fewer than one sequence of "
                f"train.seq_len={seq_len} + 1"
            )
        self._tokens = tokens
        self._window = window
        self._len = len(tokens) // window

    def __len__(self) -> int:
        return self._len

    @property
    def window(self) -> int:
        """Tokens per window: train.seq_len + 1."""
        return self._window

    def __getitem__(self, index: int) -> np.ndarray:
        index = int(index)
        if not 0 <= index < self._len:
            raise IndexError(f"window {index} out of range [0, {self._len})")
        start = index * self._window
        return np.asarray(self._tokens[start : start + self._window], np.int32)

    def rows(self, indices: np.ndarray) -> np.ndarray:
        """The windows at `indices`, stacked into [len(indices), seq_len + 1]."""
        windows = np.stack([self[i] for i in indices])
        if self._vocab_size:
            starts = np.asarray(indices) * self._window
            check_ids(windows, starts, self._file, self._vocab_size, self._tokens)
        return windows


def check_ids(
    windows: np.ndarray, starts: np.ndarray, file: str, vocab_size: int, tokens=None
) -> None:
    """A one-line ValueError naming the file, offset and id of the first id outside the
    vocabulary in `windows` (rows read from token offsets `starts` of the split `tokens`,
    named `file`; the shard file and its offset where `tokens` is a split of shards): a
    max over the batch, so cheap enough for every batch."""
    if windows.size == 0 or int(windows.max()) < vocab_size:
        return
    row, column = np.argwhere(windows >= vocab_size)[0]
    offset = int(starts[row]) + int(column)
    if tokens is not None:
        shard, offset_in_shard = shards.locate(tokens, offset)
        if shard:
            file, offset = shard, offset_in_shard
    raise ValueError(
        f"{file} holds token id {int(windows[row, column])} at token offset {offset}, "
        f"outside model.vocab_size={vocab_size} (the file changed after prepare, or is "
        "damaged); stopped before the step that would read it: re-run prepare"
    )


def check_identity(state: dict[str, Any], identity: dict[str, Any], settings: str) -> None:
    """One ValueError naming the first field of what a saved iterator state is a stream
    of (`identity`) that this run's differs in; `settings`: what to keep the same."""
    for key, value in identity.items():
        if state.get(key) != value:
            raise ValueError(
                f"data iterator state has {key}={state.get(key)!r} but this run has "
                f"{value!r}; resume with the same {settings} and train.batch_size/seq_len/seed"
            )
