"""Puts the repository root on `sys.path`, so `python bench/<script>.py` imports this
checkout's `moe_jax` with no install (a GPU machine gets a plain checkout, offline).

Running a script puts only `bench/` on the path; the scripts import this module
before `moe_jax` (it sorts into the third-party block, which precedes first-party).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(1, str(ROOT))  # after bench/ itself, before site-packages
