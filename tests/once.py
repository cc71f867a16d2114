"""A directory made once per test session, even when pytest-xdist runs the tests that use
it in different worker processes: the first to ask makes it (under a file lock), the
others wait for it and read it. For runs that several test files only read."""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest


def made_once(
    tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[Path], None]
) -> Path:
    """`root/name`, made by `make(path)` by the first worker of this session to ask (a
    `make` that raised is tried again, from nothing, by the next to ask)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the session's, above each worker's own
    path, done = root / name, root / f".{name}.done"
    with open(root / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(path, ignore_errors=True)
            make(path)
            done.touch()
    return path
