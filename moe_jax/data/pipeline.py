"""Training and evaluation batches: packed windows of a token stream, served by grain.

Every process draws the same global batch of window indices and loads only
the rows its devices hold (`local_rows`), so the global batch does not depend
on the process count, and the iterator state (a batch counter) restores
exactly on any number of hosts.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import grain
import jax
import numpy as np

from moe_jax.config import Config, DataConfig
from moe_jax.config_sources import parse
from moe_jax.data import mixture
from moe_jax.data.corpus import stdlib_documents
from moe_jax.data.documents import document_fields, masked
from moe_jax.data.synthetic import recurrence_tokens
from moe_jax.data.token_files import (
    max_id,
    open_split,
    read_meta,
    split_files,
    split_version,
    verify_once,
)
from moe_jax.data.tokenizer import ByteTokenizer
from moe_jax.data.windows import PackedSequences, check_identity

_READ_OPTIONS = grain.ReadOptions(num_threads=2, prefetch_buffer_size=4)
_SPLIT_CODES = {"train": 0, "val": 1}


@functools.lru_cache(maxsize=4)
def _stdlib_tokens(split: str, val_fraction: float) -> np.ndarray:
    """Byte ids of each stdlib file followed by EOS, concatenated (cached: read at each start)."""
    encoded = [doc.encode("utf-8") for doc in stdlib_documents(split, val_fraction)]
    tokens = np.empty(sum(len(b) + 1 for b in encoded), np.uint16)
    pos = 0
    for data in encoded:
        tokens[pos : pos + len(data)] = np.frombuffer(data, np.uint8)
        tokens[pos + len(data)] = ByteTokenizer.eos_id
        pos += len(data) + 1
    tokens.flags.writeable = False
    return tokens


def token_stream(data_cfg: DataConfig, split: str, vocab_size: int) -> tuple[np.ndarray, str]:
    """The 1-D token ids of one split and the name of the tokenizer that made them."""
    if split not in _SPLIT_CODES:
        raise ValueError(f"split={split!r} is invalid: valid splits are {tuple(_SPLIT_CODES)}")
    if data_cfg.source == "stdlib":
        if vocab_size < ByteTokenizer.vocab_size:
            raise ValueError(
                f"model.vocab_size={vocab_size} is too small for data.source='stdlib': "
                f"the byte tokenizer needs {ByteTokenizer.vocab_size}"
            )
        return _stdlib_tokens(split, data_cfg.val_fraction), ByteTokenizer.name
    if data_cfg.source == "tokens":
        tokens, meta = open_split(data_cfg.path, split)
        if data_cfg.verify:
            verify_once(data_cfg.path, split)
        if meta["vocab_size"] > vocab_size:
            raise ValueError(
                f"model.vocab_size={vocab_size} is smaller than the vocab_size "
                f"{meta['vocab_size']} of data.path={data_cfg.path}"
            )
        largest = _largest_id(data_cfg.path, split, tokens)
        if largest >= vocab_size:  # meta.json understates the vocabulary: ids would be NaN
            raise ValueError(
                f"{_files_named(data_cfg.path, split, meta)} holds token id {largest}, outside "
                f"model.vocab_size={vocab_size} (its meta.json says vocab_size "
                f"{meta['vocab_size']}); set model.vocab_size > {largest} or re-run prepare"
            )
        return tokens, str(meta.get("tokenizer", ""))
    raise ValueError(f"data.source={data_cfg.source!r} has no token stream (valid: stdlib, tokens)")


def _files_named(path: str, split: str, meta: dict) -> str:
    """The file of a split, or its shards as a pattern when there are several."""
    files = split_files(path, split, meta)
    return str(files[0]) if len(files) == 1 else str(Path(path) / f"{split}-*.bin")


_LARGEST: dict[tuple, int] = {}  # (files, sizes, mtimes) -> the split's largest id


def _largest_id(path: str, split: str, tokens: np.ndarray) -> int:
    """The split's largest id, measured once per file version (evaluation reopens it)."""
    meta = read_meta(path)
    key = split_version(path, split, meta)
    if key not in _LARGEST:
        splits = meta.get("splits")
        _LARGEST[key] = max_id(tokens, splits.get(split) if isinstance(splits, dict) else None)
    return _LARGEST[key]


def _pairs(windows: np.ndarray) -> dict[str, np.ndarray]:
    """A batch of windows as {'inputs', 'targets'}: the one place windows become a batch."""
    return {"inputs": windows[:, :-1], "targets": windows[:, 1:]}


def _batch(eos_id: int | None, windows: np.ndarray) -> dict[str, np.ndarray]:
    """The windows' pairs, with their document fields when `eos_id` is given (one source
    or a mixture's)."""
    pairs = _pairs(windows)
    if eos_id is None:
        return pairs
    return {**pairs, **document_fields(pairs["inputs"], eos_id)}


def _packed_rows(
    source: PackedSequences, rows: np.ndarray, eos_id: int | None, indices: np.ndarray
) -> dict:
    return _batch(eos_id, source.rows(indices[rows]))


def eos_id(data_cfg: DataConfig) -> int | None:
    """The id that ends each document of the source, or None when its windows carry
    no document fields (data.document_mask off, or a source without documents)."""
    if not masked(data_cfg):
        return None
    if data_cfg.source == "stdlib":
        return ByteTokenizer.eos_id
    # A mixture's sources share one tokenizer (checked as they open): the first one's.
    path = parse(data_cfg.sources)[0].path if data_cfg.sources else data_cfg.path
    return int(read_meta(path)["eos_id"])


def _synthetic_rows(config: Config, split: str, rows: np.ndarray, index: int, _: Any) -> dict:
    """Batch `index` of the synthetic stream, a pure function of (seed, split, index)."""
    t = config.train
    rng = np.random.default_rng([t.seed % 2**32, _SPLIT_CODES[split], index])
    tokens = recurrence_tokens(t.batch_size, t.seq_len + 1, config.model.vocab_size, rng)
    return _pairs(tokens[rows])


class Batches:
    """An endless iterator of {'inputs', 'targets'} with a JSON-serialisable state."""

    def __init__(self, dataset: grain.IterDataset, identity: dict[str, Any]) -> None:
        self._iter = iter(dataset)
        self._identity = identity

    def __iter__(self) -> Batches:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        return next(self._iter)

    def get_state(self) -> dict[str, Any]:
        """Where the stream is, plus what it is a stream of (checked on restore)."""
        return {**self._identity, "position": self._iter.get_state()}

    def set_state(self, state: dict[str, Any]) -> None:
        """Continue exactly where the iterator that produced `state` would have."""
        if not isinstance(state, dict) or "position" not in state:
            raise ValueError(
                f"data iterator state must be a dict from get_state(), got {state!r:.80}"
            )
        check_identity(state, self._identity, "data")
        self._iter.set_state(state["position"])


def source_iterators(config: Config, rows: np.ndarray) -> dict[str, Any]:
    """A mixture's sources' val splits, each alone and in order (`val_loss/<name>`)."""
    return mixture.source_iterators(config, rows, functools.partial(_batch, eos_id(config.data)))


def local_rows(sharding: jax.sharding.Sharding, batch_size: int, seq_len: int) -> np.ndarray:
    """The global batch rows held by this process's devices, in order.

    With the batch split over processes these are a contiguous block; a plan
    that splits only the sequence across processes needs every row everywhere.
    """
    indices = sharding.addressable_devices_indices_map((batch_size, seq_len)).values()
    rows: set[int] = set()
    for index in indices:
        rows.update(range(*index[0].indices(batch_size)))
    return np.array(sorted(rows), np.int64)


def make_iterator(
    config: Config,
    split: str,
    rows: np.ndarray | None = None,
    shuffle: bool = True,
) -> Batches:
    """The rows `rows` (default: all; see `local_rows`) of each global batch.

    Opens and checks the data now, so bad inputs fail before anything compiles.
    """
    t, d = config.train, config.data
    if split not in _SPLIT_CODES:
        raise ValueError(f"split={split!r} is invalid: valid splits are {tuple(_SPLIT_CODES)}")
    rows = np.arange(t.batch_size) if rows is None else np.asarray(rows, np.int64)
    if rows.size == 0 or rows.min() < 0 or rows.max() >= t.batch_size:
        raise ValueError(f"rows {rows.tolist()} are not rows of train.batch_size={t.batch_size}")
    identity: dict[str, Any] = {
        "source": d.source,
        **({"document_mask": True} if eos_id(d) is not None else {}),
        "split": split,
        "batch_size": t.batch_size,
        "seq_len": t.seq_len,
        "seed": t.seed,
        "shuffle": shuffle,
    }
    if d.source == "synthetic":
        ds = grain.MapDataset.range(1).repeat(None)
        ds = ds.map_with_index(functools.partial(_synthetic_rows, config, split, rows))
        return Batches(ds.to_iter_dataset(_READ_OPTIONS), identity)
    if d.sources:  # a mixture: its windows become batches as these do (`_batch`)
        return mixture.make_iterator(
            config, split, rows, shuffle, functools.partial(_batch, eos_id(d))
        )
    tokens, _ = token_stream(d, split, config.model.vocab_size)
    where = f"data.path={d.path}" if d.source == "tokens" else f"data.source={d.source!r}"
    checked = {}
    if d.source == "tokens":
        checked = {
            "file": str(Path(d.path) / f"{split}.bin"),
            "vocab_size": config.model.vocab_size,
        }
    source = PackedSequences(tokens, t.seq_len, name=f"the {split} split of {where}", **checked)
    identity["num_sequences"] = len(source)
    ds = grain.MapDataset.range(len(source))
    if shuffle:
        ds = ds.shuffle(seed=t.seed % 2**32)
    # Endless in practice; a finite count because grain's length of an endless dataset
    # batched by 1 overflows (the same order: grain reseeds each epoch either way).
    ds = ds.repeat(2**62 // max(1, len(source))).batch(t.batch_size)
    ds = ds.map(functools.partial(_packed_rows, source, rows, eos_id(d)))
    return Batches(ds.to_iter_dataset(_READ_OPTIONS), identity)


def global_array(
    local_batch: dict[str, np.ndarray], sharding: jax.sharding.Sharding, batch_size: int = 0
) -> dict:
    """Each entry as one global jax.Array of `batch_size` rows (default: the rows given).

    `local_batch` holds exactly the rows that `local_rows(sharding, ...)` names.
    """

    def assemble(value: np.ndarray) -> jax.Array:
        shape = (batch_size or value.shape[0], *value.shape[1:])
        rows = local_rows(sharding, shape[0], shape[1])
        if len(rows) != value.shape[0]:
            raise ValueError(f"{value.shape[0]} local rows given; the sharding needs {len(rows)}")
        position = {int(row): i for i, row in enumerate(rows)}

        def shard(index: tuple[slice, ...]) -> np.ndarray:
            wanted = [position[row] for row in range(*index[0].indices(shape[0]))]
            return value[wanted][(slice(None), *index[1:])]

        return jax.make_array_from_callback(shape, sharding, shard)

    return {key: assemble(value) for key, value in local_batch.items()}


def unigram_entropy(tokens: np.ndarray) -> float:
    """Entropy of the token frequencies in nats per token: the loss of a context-free model."""
    flat = np.asarray(tokens).reshape(-1)
    counts = np.zeros(1, np.int64)
    chunk = 1 << 24  # bounded memory on large memory-mapped splits
    for start in range(0, flat.size, chunk):
        part = np.bincount(flat[start : start + chunk])
        if part.size > counts.size:
            counts = np.pad(counts, (0, part.size - counts.size))
        counts[: part.size] += part
    total = counts.sum()
    if total == 0:
        raise ValueError("unigram_entropy of an empty token array is undefined")
    p = counts[counts > 0] / total
    return float(-(p * np.log(p)).sum())
