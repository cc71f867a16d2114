"""The command lines as a user types them, and two ways to run them (one CPU device, from a
directory of the test's choosing): a real subprocess, or a fork of one warm interpreter
(`tests.warm`: the same command, without Python's start-up and imports)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests import warm as warm_commands

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = {
    "train": ["-m", "moe_jax.train"],
    "plan": ["-m", "moe_jax.plan", "--gpus=8"],
    "comm_report": ["-m", "moe_jax.tools.comm_report"],
    "prepare": ["-m", "moe_jax.data.prepare"],
    "launch": [str(ROOT / "launch" / "local.py")],
    "convert": ["-m", "moe_jax.convert"],
    "sample": ["-m", "moe_jax.sample"],
    "evaluate": ["-m", "moe_jax.evaluate"],
}
CONFIG_COMMANDS = ("train", "plan", "comm_report")  # those that take --config flags
# The tiny model of the command-line tests (one CPU device, batch 4).
TINY = [
    "--config.model.embed_dim=32",
    "--config.model.head_dim=8",
    "--config.model.mlp_dim=64",
    "--config.moe.expert_mlp_dim=32",
    "--config.train.batch_size=4",
    "--config.train.seq_len=32",
    "--config.train.eval_batches=1",
    "--config.train.log_every=1",
]


# Every test program, in the test process and in each child it starts, is compiled at
# XLA:CPU's backend optimisation level 0: LLVM's optimiser is most of the compile time
# of these tiny programs (3x of the start-up program's, whose random-number code it
# optimises), and the tests read numbers, programs and memory, never speed. Level 0
# changes no HLO pass, buffer or collective.
COMPILE_FLAGS = "--xla_backend_optimization_level=0"


def xla_flags(devices: int | None = None) -> str:
    """XLA_FLAGS for a test process: `COMPILE_FLAGS`, and `devices` forced CPU devices."""
    forced = f" --xla_force_host_platform_device_count={devices}" if devices else ""
    return COMPILE_FLAGS + forced


def subprocess_env(**extra: str) -> dict[str, str]:
    """This process's environment for a child Python, with XLA_FLAGS less the forced
    device count of the test session (the child sets its own, or runs on one device),
    plus `extra`."""
    return {**os.environ, "XLA_FLAGS": xla_flags(), **extra}


def run_command(cwd: Path, command: str, args: list[str], timeout: int = 300, warm: bool = False):
    """`command` with `args`, run in `cwd` on one CPU device (no forced devices); with
    `warm`, forked from the warm interpreter of `tests.warm` instead of a new Python."""
    env = subprocess_env(JAX_PLATFORMS="cpu")
    if warm:
        return warm_commands.run(cwd, [*COMMANDS[command], *args], env, timeout)
    return subprocess.run(
        [sys.executable, *COMMANDS[command], *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
