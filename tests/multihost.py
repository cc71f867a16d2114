"""What the multi-process tests share: one small run configuration, the 8-device
single-process run they are all compared with (conftest's `single_process_run`,
STEPS + MORE_STEPS steps), and helpers to start runs."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from moe_jax.metrics import read_rows
from tests.commands import xla_flags

ROOT = Path(__file__).resolve().parents[1]
STEPS = 20  # the multi-process runs
MORE_STEPS = 3  # the single-process run goes on, for runs that resume and continue
MODEL = {
    "model.num_heads": 8,  # Ulysses over 8 devices splits the heads 8 ways
    "model.embed_dim": 32,
    "model.head_dim": 8,
    "model.mlp_dim": 64,
    "moe.expert_mlp_dim": 32,
    "train.batch_size": 8,
    "train.seq_len": 32,
    "train.log_every": 1,
    "train.eval_every": 0,
    "train.eval_batches": 1,
    "train.checkpoint_every": 10,
    # Warm-up covers the first 20 steps, so they see the same learning rates
    # whether a run stops at 20 or goes on to 23.
    "train.warmup_steps": STEPS,
    "data.source": "synthetic",
}
# Sequence-parallel attention over all 8 devices: with 2 processes the data axis
# is 1, so each process must load every row of the batch (and half the sequence).
SAVED_PLAN = {"parallel.attention": "sp", "parallel.experts": "ep_ag", "parallel.intra": 8}


def flags(settings: dict, steps: int = STEPS) -> list[str]:
    return [f"--config.{k}={v}" for k, v in {**settings, "train.steps": steps}.items()]


def losses(workdir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_rows(workdir / "metrics.jsonl") if "loss" in r}


def run(command: list[str], devices: int) -> subprocess.CompletedProcess:
    """`command` from the repository root, with `devices` forced CPU devices per process."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = xla_flags(devices)
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
