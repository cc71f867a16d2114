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


def shrink_to_fit(path: Path, spare: int) -> None:
    """Shrink the file system mounted on `path` to what it holds now plus `spare` bytes, so
    a test can fill it at a chosen write whatever size the earlier writes came to."""
    used = sum(f.stat().st_blocks * 512 for f in path.rglob("*") if f.is_file())
    size = f"size={(used + spare) // 1024 + 1}k"
    remount = ["mount", "-o", f"remount,{size}", str(path)]
    subprocess.run(remount, capture_output=True, text=True, timeout=30, check=True)
