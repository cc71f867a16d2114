"""Bad input to `train` around resuming and its settings (the rules: `tests/bad_inputs.py`):
every setting a checkpoint cannot take listed in one refusal, a JSON config (a run's
config.json) checked as any config is, a run's own saved settings checked before they
are used, and W&B online without credentials refused before anything is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moe_jax.metrics import wandb_credentials
from tests.bad_inputs import WORKDIR, Case, Place, check, names
from tests.bad_inputs import case as _c
from tests.commands import ROOT, TINY


def _json(text: str):
    return lambda place: place.file("c.json", text)


def _saved_setting(section: str, key: str, value) -> object:
    def setup(place: Place) -> None:
        path = place.trained() / "config.json"
        saved = json.loads(path.read_text())
        saved[section][key] = value
        path.write_text(json.dumps(saved, indent=2) + "\n")

    return setup


NO_CREDENTIALS = "train.wandb='online' needs W&B credentials and none were found"

CASES = [
    _c(
        "resume_batch_and_seq_len_at_once",
        "train",
        [WORKDIR, "--config.train.batch_size=8", "--config.train.seq_len=16"],
        "holds a checkpoint (step 4) that these settings cannot resume",
        "train.batch_size=8 here but 4 there, train.seq_len=16 here but 32 there "
        "(the data position cannot carry over)",
        setup=Place.trained,
    ),
    _c(
        "resume_model_and_seed_at_once",
        "train",
        [WORKDIR, "--config.model.num_layers=3", "--config.train.seed=7"],
        "model.num_layers=3 here but 2 there (another model); "
        "train.seed=7 here but 0 there (the data position cannot carry over)",
        setup=Place.trained,
    ),
    _c(
        "resume_with_an_explicit_other_config",
        "train",
        [f"--config={ROOT}/configs/default.py", WORKDIR],
        "model.embed_dim=",
        "moe.expert_mlp_dim=",
        "train.batch_size=",
        "train.seq_len=",
        setup=Place.trained,
    ),
    _c(
        "json_config_not_json",
        "train",
        ["--config={root}/c.json", WORKDIR],
        "cannot load --config=",
        "c.json: not JSON (line 1",
        setup=_json("{not json"),
    ),
    _c(
        "json_config_a_list",
        "train",
        ["--config={root}/c.json", WORKDIR],
        "c.json: not a config: a JSON object of sections",
        setup=_json("[1, 2]\n"),
    ),
    _c(
        "json_config_unknown_setting",
        "train",
        ["--config={root}/c.json", WORKDIR],
        "c.json: unknown setting train.stepz",
        setup=_json('{"train": {"stepz": 3}}\n'),
    ),
    _c(
        "json_config_bad_value",
        "train",
        ["--config={root}/c.json", WORKDIR],
        "c.json: train.batch_size=0 is invalid",
        setup=_json('{"train": {"batch_size": 0}}\n'),
    ),
    _c(
        "json_config_missing",
        "train",
        ["--config={root}/nope.json", WORKDIR],
        "nope.json: no such file",
    ),
    _c(
        "saved_settings_invalid",
        "train",
        [WORKDIR],
        "run/config.json: train.batch_size=0 is invalid",
        "give --config=FILE",
        setup=_saved_setting("train", "batch_size", 0),
    ),
    _c(
        "saved_settings_of_a_wrong_type",
        "train",
        [WORKDIR, "--config.train.steps=6"],
        "run/config.json: train.seq_len='32' is invalid: must be of type int",
        setup=_saved_setting("train", "seq_len", "32"),
    ),
    _c(
        "saved_settings_with_a_bad_override",
        "train",
        [WORKDIR, "--config.train.steps=0"],
        "train.steps=0 is invalid",
        setup=Place.trained,
    ),
    _c(
        "wandb_online_without_credentials",
        "train",
        [*TINY, WORKDIR, "--config.train.wandb=online"],
        NO_CREDENTIALS,
        "train.wandb='offline'",
    ),
    _c(
        "wandb_online_resume_without_credentials",
        "train",
        [WORKDIR, "--config.train.steps=6", "--config.train.wandb=online"],
        NO_CREDENTIALS,
        setup=Place.trained,
    ),
]

REAL = {"resume_batch_and_seq_len_at_once", "json_config_not_json"}


@pytest.mark.parametrize("case", CASES, ids=names(CASES))
def test_bad_train_input_is_one_line_and_changes_nothing(
    tmp_path: Path, bad_input_run: Path, case: Case
):
    # The environment is left as it is: the warm server is one per environment.
    if case.name.startswith("wandb") and wandb_credentials():
        pytest.skip("this machine has W&B credentials")
    check(tmp_path, bad_input_run, case, real=case.name in REAL)
    if case.name.startswith("wandb"):
        assert not (tmp_path / "run" / "wandb").exists()
