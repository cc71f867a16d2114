"""The command lines' shared flags, run from outside the repository: the default config
is found from the package, and `--config_help` lists every setting. (Bad flags are in
test_bad_inputs.py.)"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

COMMANDS = {
    "train": ["-m", "moe_jax.train"],
    "plan": ["-m", "moe_jax.plan", "--gpus=8"],
    "comm_report": ["-m", "moe_jax.tools.comm_report"],
}


def _run(tmp_path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    return subprocess.run(
        [sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )


def test_default_config_is_found_from_any_directory(tmp_path):
    """Without --config the repository's configs/default.py is used, wherever the
    command runs (the planner needs nothing else)."""
    run = _run(tmp_path, *COMMANDS["plan"], "--config.train.batch_size=8", "--top=1")
    assert run.returncode == 0, run.stderr[-2000:]
    assert "plans on 8 x H800" in run.stdout


@pytest.mark.parametrize("command", COMMANDS)
def test_config_help_lists_every_setting(tmp_path, command: str):
    from moe_jax.config_help import settings

    run = _run(tmp_path, *COMMANDS[command], "--config_help")
    assert run.returncode == 0, run.stderr[-2000:]
    listed = [line.split()[0] for line in run.stdout.strip().splitlines()]
    assert listed == [name for name, _, _ in settings()]
