"""Runs a script of `bench/` as a user would, and reads the JSON object it prints last."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.commands import subprocess_env

BENCH = Path(__file__).resolve().parents[1] / "bench"


def run_bench(script: str, *args: str) -> dict:
    """`python <script> <args>` in bench/ (no forced devices: the script sets its own)."""
    done = subprocess.run(
        [sys.executable, script, *args],
        cwd=BENCH,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
