"""The command lines' shared flags, run from outside the repository: the default config
is found from the package, and `--config_help` lists every setting. (Bad flags are in
test_bad_inputs.py.)"""

from __future__ import annotations

import pytest

from tests.commands import CONFIG_COMMANDS, run_command


def test_default_config_is_found_from_any_directory(tmp_path):
    """Without --config the repository's configs/default.py is used, wherever the
    command runs (the planner needs nothing else)."""
    run = run_command(tmp_path, "plan", ["--config.train.batch_size=8", "--top=1"], 120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "plans on 8 x H800" in run.stdout


@pytest.mark.parametrize("command", CONFIG_COMMANDS)
def test_config_help_lists_every_setting(tmp_path, command: str):
    from moe_jax.config_help import rows

    run = run_command(tmp_path, command, ["--config_help"], 120)
    assert run.returncode == 0, run.stderr[-2000:]
    listed = [line.split()[0] for line in run.stdout.strip().splitlines()]
    assert listed == [name for name, _, _ in rows()]
