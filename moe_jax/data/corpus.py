"""The embedded default corpus: the running interpreter's standard library source.

Every Python install carries it, so a run needs no download; with the same
Python version it is the same text, in the same order, on every machine.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sysconfig
from pathlib import Path

SPLITS = ("train", "val")
_EXCLUDED_DIRS = {"site-packages", "dist-packages"}


def is_val(key: str, val_fraction: float) -> bool:
    """Held out for validation, by a hash of a stable key (no RNG, no order dependence)."""
    bucket = int(hashlib.md5(key.encode("utf-8")).hexdigest(), 16) % 10_000
    return bucket < val_fraction * 10_000


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


@functools.lru_cache(maxsize=1)
def stdlib_paths() -> tuple[str, ...]:
    """Relative POSIX paths of the stdlib `.py` files, sorted (installed packages skipped)."""
    root = stdlib_root()
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]
        rel_dir = Path(dirpath).relative_to(root)
        paths.extend((rel_dir / f).as_posix() for f in filenames if f.endswith(".py"))
    if not paths:
        raise ValueError(f"data.source='stdlib' found no .py files under {root}")
    return tuple(sorted(paths))


def split_paths(split: str, val_fraction: float) -> list[str]:
    """The stdlib files of one split, in corpus order."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is invalid: valid splits are {SPLITS}")
    want_val = split == "val"
    return [p for p in stdlib_paths() if is_val(p, val_fraction) == want_val]


@functools.lru_cache(maxsize=1)
def _texts() -> dict[str, str]:
    root = stdlib_root()
    return {p: (root / p).read_text(encoding="utf-8", errors="replace") for p in stdlib_paths()}


def stdlib_documents(split: str, val_fraction: float) -> list[str]:
    """The source text of each file of one split (files are read once per process)."""
    texts = _texts()
    return [texts[p] for p in split_paths(split, val_fraction)]
