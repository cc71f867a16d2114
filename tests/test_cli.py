"""The command lines' shared flags, run from outside the repository: the default config
is found from the package, `--config_help` lists every setting with the given config
file's values, `--help` names it, and a config file that gives no config is one line.
(Bad flags are in test_bad_inputs*.py.)"""

from __future__ import annotations

import runpy

import pytest

from moe_jax import cli, config_help
from tests.commands import CONFIG_COMMANDS, ROOT, run_command

MIXTRAL = ROOT / "configs" / "mixtral_8x7b.py"


def test_default_config_is_found_from_any_directory(tmp_path):
    """Without --config the repository's configs/default.py is used, wherever the
    command runs (the planner needs nothing else)."""
    run = run_command(tmp_path, "plan", ["--config.train.batch_size=8", "--top=1"], 120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "plans on 8 x H800" in run.stdout


def _listed(stdout: str) -> dict[str, str]:
    """setting -> the value column of `--config_help`'s lines."""
    return {line.split()[0]: line.split()[1] for line in stdout.strip().splitlines()}


@pytest.mark.parametrize("command", CONFIG_COMMANDS)
def test_config_help_lists_every_setting_of_the_given_file(tmp_path, command: str):
    """Every setting, in order, with the value of the --config file and its overrides
    (read here from the file itself), not configs/default.py's."""
    args = [f"--config={MIXTRAL}", "--config.train.steps=7", "--config_help"]
    run = run_command(tmp_path, command, args, 120, warm=True)
    assert run.returncode == 0, run.stderr[-2000:]
    listed = _listed(run.stdout)
    assert list(listed) == [name for name, _, _ in config_help.rows()]
    raw = runpy.run_path(str(MIXTRAL))["get_config"]().to_dict()
    raw["train"]["steps"] = 7
    for section, values in raw.items():
        for key, value in values.items():
            assert listed[f"{section}.{key}"] == repr(value).split()[0], (section, key)
    assert listed["model.num_layers"] == "32" and listed["train.steps"] == "7"


@pytest.mark.parametrize("command", CONFIG_COMMANDS)
def test_help_names_config_help(tmp_path, command: str):
    run = run_command(tmp_path, command, ["--help"], 120, warm=True)
    text = " ".join(run.stdout.split())  # absl wraps the help at 80 columns
    assert "--config: Config file" in text, run.stdout[-2000:]
    assert "--config_help lists every setting with its value and meaning" in text


def test_given_values_are_the_files_with_the_overrides():
    argv = ["prog", f"--config={MIXTRAL}", "--config.moe.top_k=1", "--workdir=x", "--config_help"]
    want = runpy.run_path(str(MIXTRAL))["get_config"]().to_dict()
    want["moe"]["top_k"] = 1
    assert cli.given_values(argv) == want
    default = cli.given_values(["prog"])
    assert default["model"]["num_layers"] == 2 and default["train"]["steps"] == 200


@pytest.mark.parametrize(
    ("returned", "problem"),
    [
        ("None", "get_config() returned None, not a ConfigDict"),
        ("[1, 2]", "get_config() returned a list, not a ConfigDict"),
        ("'model'", "get_config() returned a str, not a ConfigDict"),
        ("{'train': {'steps': 3}}", None),
        ("__import__('ml_collections').ConfigDict({'train': {'steps': 3}})", None),
    ],
)
def test_get_config_must_return_a_config(tmp_path, returned: str, problem: str | None):
    mine = tmp_path / "mine.py"
    mine.write_text(f"def get_config():\n    return {returned}\n")
    found = cli.check_config_args(["prog", f"--config={mine}"])
    assert found == (problem and f"cannot load --config={mine}: {problem}")
