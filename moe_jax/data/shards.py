"""A split stored as numbered shard files (`train-00000.bin`, ...), written and read.

Why shards: a corpus larger than memory (and over 4 GB) is written as it is
tokenised, one bounded file at a time, each with its token count, largest id and
SHA-256 recorded for meta.json; the reader serves the shards as one 1-D stream of
token ids without loading them, so the loader never sees where one file ends.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import numpy as np

HASH = "sha256"
HASH_CHUNK = 1 << 24  # bytes read at a time when a shard's checksum is checked


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}.bin"


class ShardWriter:
    """Appends token ids to `<split>-NNNNN.bin` files of at most `shard_tokens` each.

    The files are written at their final names; they count as a corpus only once
    meta.json (written last, by the caller) lists them.
    """

    def __init__(self, directory: Path, split: str, dtype: str, shard_tokens: int) -> None:
        if shard_tokens < 1:
            raise ValueError(f"--shard_tokens={shard_tokens} is invalid: must be at least 1")
        self.directory, self.split = Path(directory), split
        self.dtype, self.shard_tokens = np.dtype(dtype), shard_tokens
        self.entries: list[dict[str, Any]] = []
        self.written: list[Path] = []  # every file opened, for the caller's cleanup
        self.max_id = -1
        self._file: Any = None
        self._hash: Any = None
        self._count = 0

    @property
    def num_tokens(self) -> int:
        return sum(e["num_tokens"] for e in self.entries) + self._count

    def write(self, tokens: np.ndarray) -> None:
        """Appends `tokens` (already of the stored dtype), starting new shards as needed."""
        tokens = np.ascontiguousarray(tokens, self.dtype)
        if tokens.size:
            self.max_id = max(self.max_id, int(tokens.max()))
        while tokens.size:
            if self._file is None:
                path = self.directory / shard_name(self.split, len(self.entries))
                self.written.append(path)
                self._file = path.open("xb")
                self._hash, self._count = hashlib.new(HASH), 0
            part = tokens[: self.shard_tokens - self._count]
            data = memoryview(part).cast("B")
            self._file.write(data)
            self._hash.update(data)
            self._count += part.size
            tokens = tokens[part.size :]
            if self._count == self.shard_tokens:
                self._finish()

    def _finish(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        name = shard_name(self.split, len(self.entries))
        self.entries.append({"file": name, "num_tokens": self._count, HASH: self._hash.hexdigest()})
        self._file, self._count = None, 0

    def close(self) -> dict[str, Any]:
        """Finishes the last shard; the split's meta.json entry."""
        if self._file is not None:
            self._finish()
        return {"num_tokens": self.num_tokens, "max_id": self.max_id, "shards": self.entries}

    def abort(self) -> None:
        """Closes the open shard (if any) without recording it; the caller removes files."""
        if self._file is not None:
            self._file.close()
            self._file, self._count = None, 0


class ShardedTokens:
    """Several memory-mapped shards as one read-only 1-D array of token ids: `len`,
    integer and contiguous-slice indexing (a slice returns a new ndarray), `dtype`."""

    ndim = 1

    def __init__(self, parts: list[np.ndarray], paths: list[Path]) -> None:
        self._parts, self.paths = parts, paths
        self._starts = np.cumsum([0] + [p.size for p in parts])
        self.dtype = parts[0].dtype
        self.size = int(self._starts[-1])
        self.shape = (self.size,)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, key: int | slice) -> Any:
        if isinstance(key, slice):
            start, stop, step = key.indices(self.size)
            if step != 1:
                raise IndexError("ShardedTokens supports contiguous slices only")
            return self._range(start, max(start, stop))
        index = int(key) + (self.size if int(key) < 0 else 0)
        if not 0 <= index < self.size:
            raise IndexError(f"token {key} out of range [0, {self.size})")
        shard = int(np.searchsorted(self._starts, index, side="right")) - 1
        return self._parts[shard][index - self._starts[shard]]

    def _range(self, start: int, stop: int) -> np.ndarray:
        out = np.empty(stop - start, self.dtype)
        first = int(np.searchsorted(self._starts, start, side="right")) - 1
        pos = start
        for shard in range(max(first, 0), len(self._parts)):
            if pos >= stop:
                break
            lo = pos - self._starts[shard]
            hi = min(stop, self._starts[shard + 1]) - self._starts[shard]
            out[pos - start : pos - start + hi - lo] = self._parts[shard][lo:hi]
            pos += hi - lo
        return out

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        whole = self._range(0, self.size)
        return whole if dtype is None else whole.astype(dtype)

    def locate(self, index: int) -> tuple[Path, int]:
        """The shard file holding token `index` of the stream, and its offset there."""
        shard = int(np.searchsorted(self._starts, index, side="right")) - 1
        return self.paths[shard], int(index - self._starts[shard])


def locate(tokens: Any, index: int) -> tuple[str, int]:
    """The file and offset within it of token `index` of a split `open_split` returned
    (a single memmap or ShardedTokens); ('', index) for an in-memory array."""
    if isinstance(tokens, ShardedTokens):
        path, offset = tokens.locate(index)
        return str(path), offset
    return str(getattr(tokens, "filename", "") or ""), int(index)


def file_checksum(path: Path) -> str:
    """The SHA-256 of a file, read in bounded chunks."""
    digest = hashlib.new(HASH)
    with path.open("rb") as f:
        while chunk := f.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
