"""Bad flags on the real command lines, typed as a user would and run from outside the
repository: one `error:` line naming the setting or file, exit status 1, no traceback.
"""

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
CASES = [
    ("--config.trian.steps=1", "unknown setting trian.steps (did you mean train.steps?)"),
    ("--config.train.stepz=1", "unknown setting train.stepz (did you mean train.steps?)"),
    ("--config.model.foo=1", "unknown setting model.foo; valid settings of model: ["),
    ("--config=nope.py", "cannot load --config=nope.py: no such file"),
    ("--config.train.steps=abc", "--config.train.steps=abc"),
    ("--no_such_flag=1", "no_such_flag"),
]


def _run(tmp_path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    return subprocess.run(
        [sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("flag,message", CASES, ids=[c[0] for c in CASES])
def test_bad_flag_is_one_line(tmp_path, command: str, flag: str, message: str):
    run = _run(tmp_path, *COMMANDS[command], flag)
    assert run.returncode == 1, run.stderr[-2000:]
    assert "Traceback" not in run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and message in last, run.stderr[-2000:]
    assert not list(tmp_path.iterdir())  # nothing written where it was run


def test_default_config_is_found_from_any_directory(tmp_path):
    """Without --config the repository's configs/default.py is used, wherever the
    command runs (the planner needs nothing else)."""
    run = _run(tmp_path, *COMMANDS["plan"], "--config.train.batch_size=8", "--top=1")
    assert run.returncode == 0, run.stderr[-2000:]
    assert "plans on 8 x H800" in run.stdout


def test_comm_report_compare_on_one_device_says_what_it_needs(tmp_path):
    run = _run(tmp_path, *COMMANDS["comm_report"], "--compare=tp+etp,sp+ep_a2a")
    assert run.returncode == 1 and "Traceback" not in run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert "parallel.intra=1" in last and "xla_force_host_platform_device_count" in last


@pytest.mark.parametrize("command", COMMANDS)
def test_config_help_lists_every_setting(tmp_path, command: str):
    from moe_jax.config_help import settings

    run = _run(tmp_path, *COMMANDS[command], "--config_help")
    assert run.returncode == 0, run.stderr[-2000:]
    listed = [line.split()[0] for line in run.stdout.strip().splitlines()]
    assert listed == [name for name, _, _ in settings()]
