"""A small real file system (a tmpfs) for full-disk tests. Mounting needs root (CI runs
as root); elsewhere the tests that need one are skipped."""

from __future__ import annotations

import contextlib
import subprocess
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_disk(path: Path, size: str = "1m", read_only: bool = False):
    """`path`, with a fresh file system of `size` bytes mounted on it (read-only if asked)."""
    path.mkdir(parents=True, exist_ok=True)
    options = f"size={size}" + (",ro" if read_only else "")
    mount = ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)]
    try:
        mounted = subprocess.run(mount, capture_output=True, text=True, timeout=30)
    except OSError as error:
        pytest.skip(f"cannot mount a tmpfs here: {error}")
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "--lazy", str(path)], capture_output=True, timeout=30)
