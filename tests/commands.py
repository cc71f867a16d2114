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


def subprocess_env(**extra: str) -> dict[str, str]:
    """This process's environment for a child Python, less the forced device count of the
    test session (the child sets its own, or runs on one device), plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return {**env, **extra}


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
