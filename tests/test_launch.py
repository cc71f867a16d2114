"""Multi-process training on this machine: `launch/local.py -n 2` (two JAX processes of
4 CPU devices each, joined by jax.distributed over gloo) logs the same losses as one
process with 8 devices."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from moe_jax.metrics import read_rows

ROOT = Path(__file__).resolve().parents[1]
ARGS = [
    "--config.train.steps=4",
    "--config.train.log_every=1",
    "--config.train.eval_every=0",
    "--config.data.source=synthetic",
    "--config.parallel.intra=4",
    "--config.parallel.attention=sp",
]


def _losses(workdir: Path) -> list[float]:
    return [row["loss"] for row in read_rows(workdir / "metrics.jsonl") if "loss" in row]


def _run(cmd: list[str], devices: int) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_two_local_processes_match_one(tmp_path):
    two, one = tmp_path / "two", tmp_path / "one"
    launch = [sys.executable, "launch/local.py", "-n", "2", "--devices", "4", "--"]
    run = _run([*launch, f"--workdir={two}", *ARGS], devices=4)
    assert run.returncode == 0, run.stderr[-3000:]
    run = _run([sys.executable, "-m", "moe_jax.train", f"--workdir={one}", *ARGS], devices=8)
    assert run.returncode == 0, run.stderr[-3000:]
    got, want = _losses(two), _losses(one)
    assert len(got) == 4  # one writer: process 0 alone logs
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert (two / "checkpoints" / "4").is_dir()


def test_incomplete_distributed_flags_are_one_line():
    run = _run(
        [sys.executable, "-m", "moe_jax.train", "--num_processes=2", "--config.train.steps=1"],
        devices=1,
    )
    assert run.returncode == 1
    error = run.stderr.strip().splitlines()[-1]
    assert error.startswith("error: --coordinator=''") and "process_id" in error
