"""The command lines as a user types them, and one way to run them in a subprocess
(one CPU device, from a directory of the test's choosing)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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


def run_command(cwd: Path, command: str, args: list[str], timeout: int = 300):
    """`command` with `args`, run in `cwd` on one CPU device (no forced devices)."""
    env = subprocess_env(JAX_PLATFORMS="cpu")
    return subprocess.run(
        [sys.executable, *COMMANDS[command], *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
