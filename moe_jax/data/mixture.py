"""A mixture of prepared directories (`data.sources`): windows drawn by weight.

Why this shape: the source of each window is chosen by stride scheduling (each window
goes to the source furthest below its share of the windows drawn so far), so every
prefix of the stream holds each source within one window of its weight, and a batch
holds the mixture, not a run of one source; the rows of a batch are then shuffled from
(train.seed, batch). Each source reads its windows in a fresh seeded order per epoch
and wraps when it runs out (one line says so). Every process draws the whole global
batch and loads only its rows (`pipeline.local_rows`), and the state (the batch count
and the windows each source has given) is plain JSON, so a resume is exact on any
number of processes.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from moe_jax.config import Config
from moe_jax.config_sources import Source, parse
from moe_jax.data.token_files import (
    META,
    PREPARE_HINT,
    max_id,
    open_split,
    tokenizer_spec,
    verify_once,
)
from moe_jax.data.windows import PackedSequences, check_identity

_MIX_SALT = 0x6D6978  # seeds the order of a batch's rows apart from the window orders


def _tokenizer_identity(directory: str, meta: dict[str, Any]) -> str:
    """What makes two prepared directories' ids mean the same tokens: 'byte', or the
    hash of the tokenizer.json each names (every corpus keeps its own copy)."""
    spec = tokenizer_spec(directory, meta)
    if spec == "byte":
        return spec
    try:
        return hashlib.sha256(Path(spec).read_bytes()).hexdigest()
    except OSError:
        raise ValueError(
            f"data.sources: {directory}'s tokenizer {spec} is not readable; {PREPARE_HINT}"
        ) from None


def open_sources(config: Config, split: str) -> list[tuple[Source, PackedSequences]]:
    """Every source's `split` as windows checked on each read, after the checks that
    need the files: prepared, one tokenizer for all, ids within model.vocab_size."""
    vocab = config.model.vocab_size
    opened, first = [], None
    for source in parse(config.data.sources):
        where = f"data.sources: source {source.name!r} ({source.path})"
        if not Path(source.path).is_dir():
            raise ValueError(f"{where} does not exist; {PREPARE_HINT}")
        if not (Path(source.path) / META).is_file():
            raise ValueError(f"{where} is not prepared (no {META}); {PREPARE_HINT}")
        try:
            tokens, meta = open_split(source.path, split)
            if config.data.verify:
                verify_once(source.path, split)
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None
        identity = (_tokenizer_identity(source.path, meta), meta["eos_id"])
        if first is None:
            first = (source, identity)
        elif identity != first[1]:
            raise ValueError(
                f"{where} was prepared with another tokenizer than source "
                f"{first[0].name!r} ({first[0].path}); prepare every source with one tokenizer"
            )
        largest = _stored_max(meta, split, tokens)
        if meta["vocab_size"] > vocab or largest >= vocab:
            raise ValueError(
                f"{where} has a vocabulary of {max(meta['vocab_size'], largest + 1)}, more "
                f"than model.vocab_size={vocab}; set model.vocab_size >= "
                f"{max(meta['vocab_size'], largest + 1)}"
            )
        file = str(Path(source.path) / f"{split}.bin")
        windows = PackedSequences(
            tokens, config.train.seq_len, f"the {split} split of {where}", file, vocab
        )
        opened.append((source, windows))
    return opened


def _stored_max(meta: dict[str, Any], split: str, tokens: np.ndarray) -> int:
    """The split's largest id as prepare stored it (measured for older corpora); each
    batch is checked again as it is read."""
    splits = meta.get("splits")
    return max_id(tokens, splits.get(split) if isinstance(splits, dict) else None)


class Mixture:
    """An endless iterator of batches drawn from several sources, with a JSON state."""

    def __init__(
        self,
        sources: list[tuple[Source, PackedSequences]],
        batch_size: int,
        rows: np.ndarray,
        seed: int,
        shuffle: bool,
        identity: dict[str, Any],
        to_batch: Callable[[np.ndarray], dict[str, np.ndarray]],
    ) -> None:
        """`to_batch`: how windows become a batch, the single-source pipeline's own."""
        self._to_batch = to_batch
        self._sources = [s for s, _ in sources]
        self._windows = [w for _, w in sources]
        weights = np.array([s.weight for s in self._sources], np.float64)
        self._share = weights / weights.sum()
        self._batch_size, self._rows = batch_size, rows
        self._seed, self._shuffle = seed % 2**32, shuffle
        self._identity = {**identity, "sizes": {s.name: len(w) for s, w in sources}}
        self._batch = 0
        self._drawn = np.zeros(len(sources), np.int64)
        self._orders: dict[int, tuple[int, np.ndarray]] = {}  # source -> (epoch, order)
        self._wrapped: set[int] = set()

    def __iter__(self) -> Mixture:
        return self

    def _choose(self) -> np.ndarray:
        """The source of each of the next batch_size windows, advancing the counts."""
        chosen = np.empty(self._batch_size, np.int64)
        for slot in range(self._batch_size):
            total = self._drawn.sum() + 1
            best = int(np.argmax(self._share * total - self._drawn))
            chosen[slot] = best
            self._drawn[best] += 1
        return chosen

    def _window(self, source: int, drawn: int) -> int:
        """The index of the `drawn`-th window source `source` gives (0-based, over epochs)."""
        size = len(self._windows[source])
        epoch, position = divmod(drawn, size)
        if not self._shuffle:
            return position
        cached = self._orders.get(source)
        if cached is None or cached[0] != epoch:
            name = self._sources[source].name.encode()
            rng = np.random.default_rng([self._seed, zlib.crc32(name), epoch])
            cached = (epoch, rng.permutation(size))
            self._orders[source] = cached
        return int(cached[1][position])

    def __next__(self) -> dict[str, np.ndarray]:
        before = self._drawn.copy()
        chosen = self._choose()
        if self._shuffle:
            rng = np.random.default_rng([self._seed, _MIX_SALT, self._batch])
            chosen = chosen[rng.permutation(self._batch_size)]
        self._batch += 1
        self._say_wraps(before)
        # The k-th row of source s in this batch is its (before[s] + k)-th window overall.
        nth = np.empty(self._batch_size, np.int64)
        for source in np.unique(chosen):
            where = np.flatnonzero(chosen == source)
            nth[where] = before[source] + np.arange(where.size)
        local, ours = chosen[self._rows], nth[self._rows]
        windows = np.empty((len(self._rows), self._windows[0].window), np.int32)
        for source in np.unique(local):
            where = np.flatnonzero(local == source)
            indices = [self._window(int(source), int(k)) for k in ours[where]]
            windows[where] = self._windows[source].rows(np.array(indices))
        return self._to_batch(windows)

    def _say_wraps(self, before: np.ndarray) -> None:
        for i, (source, windows) in enumerate(zip(self._sources, self._windows, strict=True)):
            size = len(windows)
            wrapped = self._drawn[i] // size > before[i] // size
            said = i in self._wrapped or not self._shuffle  # evaluation repeats in silence
            if wrapped and not said and jax.process_index() == 0:
                self._wrapped.add(i)  # once per source; metrics.jsonl counts the epochs
                print(
                    f"data: source {source.name!r} ran out after {size} windows and wraps: "
                    "each epoch reads them again in a new order (epochs/<name> in metrics.jsonl)",
                    flush=True,
                )

    def epochs(self) -> dict[str, float]:
        """Epochs each source has given so far (windows drawn / windows it holds)."""
        return {
            f"epochs/{s.name}": float(d) / len(w)
            for s, w, d in zip(self._sources, self._windows, self._drawn, strict=True)
        }

    def get_state(self) -> dict[str, Any]:
        """Where the stream is (each source's windows drawn), plus what it is a stream of."""
        drawn = {s.name: int(d) for s, d in zip(self._sources, self._drawn, strict=True)}
        return {**self._identity, "position": {"batch": self._batch, "drawn": drawn}}

    def set_state(self, state: dict[str, Any]) -> None:
        """Continue exactly where the iterator that produced `state` would have."""
        position = state.get("position") if isinstance(state, dict) else None
        if not isinstance(position, dict) or not isinstance(position.get("drawn"), dict):
            raise ValueError(
                f"data iterator state must be a mixture's get_state(), got {state!r:.80}"
            )
        check_identity(state, self._identity, "data.sources")
        self._batch = int(position["batch"])
        self._drawn = np.array([int(position["drawn"][s.name]) for s in self._sources], np.int64)


def make_iterator(
    config: Config, split: str, rows: np.ndarray, shuffle: bool, to_batch: Callable
) -> Mixture:
    """The mixture's batches of `split` (rows `rows` of each global batch)."""
    t = config.train
    identity = {
        "sources": [[s.name, s.weight] for s in parse(config.data.sources)],
        "split": split,
        "batch_size": t.batch_size,
        "seq_len": t.seq_len,
        "seed": t.seed,
        "shuffle": shuffle,
    }
    opened = open_sources(config, split)
    return Mixture(opened, t.batch_size, rows, t.seed, shuffle, identity, to_batch)


def source_iterators(config: Config, rows: np.ndarray, to_batch: Callable) -> dict[str, Mixture]:
    """Each source's val split alone, in order: what `val_loss/<name>` averages over."""
    t = config.train
    found = {}
    for source, windows in open_sources(config, "val"):
        alone = Source(source.path, 1.0, source.name)
        identity = {"sources": source.name, "split": "val", "seed": t.seed}
        found[source.name] = Mixture(
            [(alone, windows)], t.batch_size, rows, t.seed, False, identity, to_batch
        )
    return found
