"""Prepared token files: each split's token ids in shard files (`<split>-00000.bin`,
...; one flat `<split>.bin` in corpora prepared before shards) plus a `meta.json`.

Memory-mapped, so a corpus larger than RAM trains without loading; every file
is checked when opened so a corrupt or mismatched one fails before compilation.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from moe_jax.data.shards import HASH, ShardedTokens, file_checksum

FORMAT = "moe_jax.tokens.v1"
DTYPES = ("uint16", "uint32")
SPLITS = ("train", "val")
META = "meta.json"
TOKENIZER_FILE = "tokenizer.json"  # the copy of a corpus's tokenizer, beside its splits
PREPARE_HINT = "create it with python -m moe_jax.data.prepare"


def dtype_for(vocab_size: int) -> str:
    """The smallest stored dtype that holds every id of the vocabulary."""
    return "uint16" if vocab_size <= 65535 else "uint32"


def write_file(path: Path, data: bytes) -> None:
    """Writes `path` whole or not at all, with the umask's permissions."""
    _atomic_write(path, data)


def tokenizer_spec(directory: str | os.PathLike, meta: dict[str, Any]) -> str:
    """The tokenizer of a prepared corpus as `load_tokenizer` takes it: 'byte', or the
    tokenizer.json path meta.json names, resolved against the corpus directory (where
    prepare copies it; older corpora name an absolute path)."""
    spec = str(meta.get("tokenizer") or "byte")
    if spec == "byte":
        return spec
    return os.path.join(os.path.abspath(directory), spec)


def _atomic_write(path: Path, data: bytes) -> None:
    """Write-then-rename in the same directory, so readers never see a half-written file."""
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex}.tmp"
    # os.open rather than mkstemp, so the file gets the usual umask permissions, not 0600.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def write_split(directory: str | os.PathLike, split: str, tokens: np.ndarray) -> Path:
    """Writes `<split>.bin` atomically; `tokens` must already have the stored dtype."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is invalid: valid splits are {SPLITS}")
    if np.dtype(tokens.dtype).name not in DTYPES:
        raise ValueError(f"tokens for {split}.bin have dtype {tokens.dtype}; valid: {DTYPES}")
    path = Path(directory) / f"{split}.bin"
    _atomic_write(path, np.ascontiguousarray(tokens).tobytes())
    return path


def write_meta(directory: str | os.PathLike, meta: dict[str, Any]) -> Path:
    """Writes meta.json atomically (written last: its presence marks a finished directory)."""
    path = Path(directory) / META
    _atomic_write(path, (json.dumps(meta, indent=2, sort_keys=True) + "\n").encode("utf-8"))
    return path


def read_meta(directory: str | os.PathLike) -> dict[str, Any]:
    """meta.json of a prepared directory, with its format and dtype checked."""
    path = Path(directory) / META
    if not Path(directory).is_dir():
        raise ValueError(f"data.path={directory} does not exist; {PREPARE_HINT}")
    if not path.is_file():
        raise ValueError(f"data.path={directory} has no {META}; {PREPARE_HINT}")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(
            f"{path} is not valid JSON ({type(err).__name__}); {PREPARE_HINT}"
        ) from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise ValueError(f"{path} has format {found!r}; expected {FORMAT!r}")
    if meta.get("dtype") not in DTYPES:
        raise ValueError(f"{path} has dtype {meta.get('dtype')!r}; valid: {DTYPES}")
    for key in ("vocab_size", "bos_id", "eos_id"):
        if not isinstance(meta.get(key), int) or isinstance(meta.get(key), bool):
            raise ValueError(f"{path} has no integer {key!r}")
    return meta


def _split_entry(directory: str | os.PathLike, meta: dict[str, Any], split: str) -> dict:
    splits = meta.get("splits")
    entry = splits.get(split) if isinstance(splits, dict) else None
    return entry if isinstance(entry, dict) else {}


def split_files(directory: str | os.PathLike, split: str, meta: dict[str, Any]) -> list[Path]:
    """The files holding one split, in stream order: the shards meta.json lists, or
    `<split>.bin` for a corpus prepared before shards."""
    shards = _split_entry(directory, meta, split).get("shards")
    if shards is None:
        return [Path(directory) / f"{split}.bin"]
    if not isinstance(shards, list) or not all(
        isinstance(s, dict) and isinstance(s.get("file"), str) for s in shards
    ):
        raise ValueError(f"{Path(directory) / META} has a malformed shard list for {split}")
    for shard in shards:
        if Path(shard["file"]).name != shard["file"]:
            raise ValueError(f"{Path(directory) / META} names shard {shard['file']!r} outside it")
    return [Path(directory) / s["file"] for s in shards]


def _open_file(path: Path, dtype: np.dtype, expected: Any) -> np.ndarray:
    """One file of a split as a read-only memmap, its size checked against meta.json."""
    if not path.is_file():
        raise ValueError(f"{path} is missing; {PREPARE_HINT}")
    size = path.stat().st_size
    if size % dtype.itemsize:
        raise ValueError(
            f"{path} has {size} bytes, not a multiple of {dtype.name}'s {dtype.itemsize}"
        )
    num_tokens = size // dtype.itemsize
    if expected != num_tokens:
        raise ValueError(
            f"{path} holds {num_tokens} tokens but {path.parent / META} says {expected}"
        )
    if num_tokens == 0:
        return np.zeros(0, dtype)  # np.memmap cannot map an empty file
    return np.memmap(path, dtype=dtype, mode="r")


def open_split(directory: str | os.PathLike, split: str) -> tuple[Any, dict[str, Any]]:
    """The tokens of one split as one read-only 1-D array, and the directory's meta: a
    memmap for a single file, a `ShardedTokens` over several shards (never loaded)."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is invalid: valid splits are {SPLITS}")
    meta = read_meta(directory)
    dtype = np.dtype(meta["dtype"])
    entry = _split_entry(directory, meta, split)
    files = split_files(directory, split, meta)
    if "shards" not in entry:
        return _open_file(files[0], dtype, entry.get("num_tokens")), meta
    parts = [
        _open_file(path, dtype, shard.get("num_tokens"))
        for path, shard in zip(files, entry["shards"], strict=True)
    ]
    total = sum(p.size for p in parts)
    if entry.get("num_tokens") != total:
        raise ValueError(
            f"{Path(directory) / META} says {split} has {entry.get('num_tokens')} tokens but "
            f"its shards ({', '.join(p.name for p in files) or 'none'}) hold {total}"
        )
    if not parts:
        return np.zeros(0, dtype), meta
    if len(parts) == 1:
        return parts[0], meta
    return ShardedTokens(parts, files), meta


def verify_split(directory: str | os.PathLike, split: str, meta: dict[str, Any]) -> None:
    """`data.verify`: every shard of the split against the SHA-256 prepare stored; one
    ValueError naming the first shard that differs."""
    entry = _split_entry(directory, meta, split)
    shards = entry.get("shards")
    if not shards or not all(isinstance(s.get(HASH), str) for s in shards):
        if entry.get("num_tokens") == 0:
            return
        raise ValueError(
            f"data.verify=true but {Path(directory) / META} stores no checksums for {split} "
            "(prepared before they were stored): re-run moe_jax.data.prepare, or set "
            "data.verify=false"
        )
    for path, shard in zip(split_files(directory, split, meta), shards, strict=True):
        found = file_checksum(path)
        if found != shard[HASH]:
            raise ValueError(
                f"data.verify: {path} has {HASH} {found[:16]}..., but meta.json records "
                f"{shard[HASH][:16]}...: the shard changed after prepare; re-run prepare"
            )


SCAN_CHUNK = 1 << 24  # tokens per read when a split's largest id must be measured


def max_id(tokens: np.ndarray, entry: dict[str, Any] | None) -> int:
    """The largest token id of a split: the `max_id` prepare stored in meta.json, or
    (older corpora) measured in bounded chunks."""
    if isinstance(entry, dict) and isinstance(entry.get("max_id"), int):
        return entry["max_id"]
    found = -1
    for start in range(0, tokens.size, SCAN_CHUNK):
        found = max(found, int(tokens[start : start + SCAN_CHUNK].max()))
    return found


def split_version(path: str, split: str, meta: dict) -> tuple:
    """What identifies one version of a split's files: their names, sizes and mtimes."""
    files = [Path(path).absolute() / META, *split_files(Path(path).absolute(), split, meta)]
    return tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files)


_VERIFIED: set[tuple] = set()  # split versions whose checksums data.verify has checked


def verify_once(path: str, split: str) -> None:
    """data.verify: the split's shards against their checksums, once per file version."""
    meta = read_meta(path)
    key = split_version(path, split, meta)
    if key not in _VERIFIED:
        verify_split(path, split, meta)
        _VERIFIED.add(key)
