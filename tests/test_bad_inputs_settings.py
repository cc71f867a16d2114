"""Bad settings through the front door that `train`, `plan` and `comm_report` share
(`moe_jax.cli` and `moe_jax.config.load`; the rules: `tests/bad_inputs.py`): floats
that are not finite, counts and windows that make no sense, a setting another setting
turns off, a config file whose `get_config()` gives no config, and `convert`'s shard
size. Each is refused in one line before anything compiles or is written (a fresh
workdir is never created, a trained one stays byte-identical)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bad_inputs import TRAINED, WORKDIR, Case, Place, check, names
from tests.bad_inputs import case as _c
from tests.commands import CONFIG_COMMANDS, TINY


def _returns(value: str):
    """A setup writing `mine.py`, a config file whose get_config() returns `value`."""
    return lambda place: place.file("mine.py", f"def get_config():\n    return {value}\n")


MINE = "--config={root}/mine.py"
INF = "is invalid: must be finite"
DATA_PATH = ["--config.data.path={root}/data"]

CASES = [
    # train: floats that are not finite, on a fresh workdir and on a trained run
    _c("train_lr_inf", "train", [*TINY, WORKDIR, "--config.train.learning_rate=inf"],
       f"train.learning_rate=inf {INF}"),
    _c("train_weight_decay_inf", "train", [*TINY, WORKDIR, "--config.train.weight_decay=inf"],
       f"train.weight_decay=inf {INF}"),
    _c("train_eps_nan", "train", [*TINY, WORKDIR, "--config.train.eps=nan"],
       f"train.eps=nan {INF}"),
    _c("train_norm_eps_inf", "train", [*TINY, WORKDIR, "--config.model.norm_eps=inf"],
       f"model.norm_eps=inf {INF}"),
    _c("train_rope_theta_inf", "train", [*TINY, WORKDIR, "--config.model.rope_theta=inf"],
       f"model.rope_theta=inf {INF}"),
    _c("train_capacity_factor_inf", "train",
       [*TINY, WORKDIR, "--config.moe.impl=capacity", "--config.moe.capacity_factor=inf"],
       f"moe.capacity_factor=inf {INF}"),
    _c("train_routed_scaling_inf", "train", [*TINY, WORKDIR, "--config.moe.routed_scaling=inf"],
       f"moe.routed_scaling=inf {INF}"),
    _c("train_z_loss_inf", "train", [*TINY, WORKDIR, "--config.moe.z_loss_coef=inf"],
       f"moe.z_loss_coef=inf {INF}"),
    _c("train_resume_lr_inf", "train",
       [*TRAINED, WORKDIR, "--config.train.steps=6", "--config.train.learning_rate=inf"],
       f"train.learning_rate=inf {INF}", setup=Place.trained),
    # train: values that make no sense, settings another setting turns off
    _c("train_vocab_one", "train", [*TINY, WORKDIR, "--config.model.vocab_size=1"],
       "model.vocab_size=1 is invalid: must be >= 2"),
    _c("train_profile_beyond_run", "train",
       [*TINY, WORKDIR, "--config.train.steps=4", "--config.profile.steps=2,10"],
       "profile.steps='2,10' is invalid", "train.steps=4", "stop <= 5"),
    _c("train_data_path_without_tokens", "train", [*TINY, WORKDIR, *DATA_PATH],
       "data.path=", "data.source='stdlib' here", "add --config.data.source=tokens",
       setup=Place.prepared),
    _c("train_data_path_with_synthetic", "train",
       [*TINY, WORKDIR, "--config.data.source=synthetic", *DATA_PATH],
       "data.path=", "data.source='synthetic' here", setup=Place.prepared),
    _c("train_microbatches_without_pipeline", "train",
       [*TINY, WORKDIR, "--config.parallel.microbatches=2"],
       "parallel.microbatches=2 is invalid", "parallel.stages > 1", "train.grad_accum"),
    _c("train_schedule_without_pipeline", "train",
       [*TINY, WORKDIR, "--config.parallel.schedule=1f1b"],
       "parallel.schedule='1f1b' is invalid", "parallel.stages > 1"),
    _c("train_stash_depth_without_zero_bubble", "train",
       [*TINY, WORKDIR, "--config.parallel.stash_depth=1"],
       "parallel.stash_depth=1 is invalid", "parallel.schedule=zero_bubble"),
    _c("train_schedule_unknown", "train",
       [*TINY, WORKDIR, "--config.parallel.schedule=dualpipe"],
       "parallel.schedule='dualpipe' is invalid", "gpipe", "1f1b", "zero_bubble"),
    _c("train_optimizer_unknown", "train",
       [*TINY, WORKDIR, "--config.train.optimizer=sgd"],
       "train.optimizer='sgd' is invalid", "adamw", "muon"),
    _c("train_muon_momentum_one", "train",
       [*TINY, WORKDIR, "--config.train.optimizer=muon", "--config.train.muon_momentum=1.0"],
       "train.muon_momentum=1.0 is invalid", "[0, 1)"),
    _c("train_moment_dtype_float16", "train",
       [*TINY, WORKDIR, "--config.train.moment_dtype=float16"],
       "train.moment_dtype='float16' is invalid", "float32", "bfloat16"),
    _c("train_qk_clip_threshold_zero", "train",
       [*TINY, WORKDIR, "--config.train.qk_clip=true", "--config.train.qk_clip_threshold=0"],
       "train.qk_clip_threshold=0.0 is invalid", "> 0"),
    _c("train_tile_size_without_tiles", "train",
       [*TINY, WORKDIR, "--config.moe.impl=ragged_dot", "--config.moe.tile_size=32"],
       "moe.tile_size=32 is invalid", "moe.impl='ragged_dot' here"),
    _c("train_wandb_without_project", "train",
       [*TINY, WORKDIR, "--config.train.wandb=offline", "--config.train.wandb_project="],
       "train.wandb_project='' is invalid"),
    _c("train_rope_theta_one", "train", [*TINY, WORKDIR, "--config.model.rope_theta=1"],
       "model.rope_theta=1.0 is invalid: must be > 1"),
    _c("train_seed_negative", "train", [*TINY, WORKDIR, "--config.train.seed=-1"],
       "train.seed=-1 is invalid: must be in [0, 2**32"),
    # train: a config file that gives no config
    _c("train_config_returns_none", "train", [MINE, WORKDIR],
       "cannot load --config=", "mine.py: get_config() returned None, not a ConfigDict",
       setup=_returns("None")),
    _c("train_config_returns_list", "train", [MINE, WORKDIR],
       "get_config() returned a list, not a ConfigDict", setup=_returns("[1, 2]")),
    # plan and comm_report read the same settings through the same door
    *(
        case
        for command in ("plan", "comm_report")
        for case in (
            _c(f"{command}_lr_inf", command, ["--config.train.learning_rate=inf"],
               f"train.learning_rate=inf {INF}"),
            _c(f"{command}_capacity_factor_inf", command,
               ["--config.moe.impl=capacity", "--config.moe.capacity_factor=inf"],
               f"moe.capacity_factor=inf {INF}"),
            _c(f"{command}_aux_loss_nan", command, ["--config.moe.aux_loss_coef=nan"],
               f"moe.aux_loss_coef=nan {INF}"),
            _c(f"{command}_vocab_one", command, ["--config.model.vocab_size=1"],
               "model.vocab_size=1 is invalid"),
            _c(f"{command}_data_path_without_tokens", command, DATA_PATH,
               "data.path=", "add --config.data.source=tokens"),
            _c(f"{command}_profile_beyond_run", command, ["--config.profile.steps=150,300"],
               "profile.steps='150,300' is invalid", "stop <= 201"),
            _c(f"{command}_config_returns_none", command, [MINE],
               "get_config() returned None, not a ConfigDict", setup=_returns("None")),
            _c(f"{command}_config_returns_an_int", command, [MINE],
               "get_config() returned an int, not a ConfigDict", setup=_returns("7")),
        )
    ),
    _c("comm_report_config_help_of_no_config", "comm_report", [MINE, "--config_help"],
       "get_config() returned None, not a ConfigDict", setup=_returns("None")),
    _c("plan_config_help_bad_override", "plan", ["--config.train.steps=abc", "--config_help"],
       "bad --config override", "--config.train.steps=abc"),
    # convert export: a shard size of zero bytes (or not finite) is no size
    *(
        _c(f"convert_shard_gb_{name}", "convert",
           ["export", WORKDIR, "--hf={root}/hf", f"--shard_gb={value}"],
           f"--shard_gb={shown}: must be a finite size in GiB", setup=Place.trained)
        for name, value, shown in (("zero", "0", "0.0"), ("inf", "inf", "inf"))
    ),
    # launch/local.py checks the config flags with the same code before starting anything
    _c("launch_config_returns_none", "launch", ["-n", "2", "--", MINE, WORKDIR],
       "get_config() returned None, not a ConfigDict", setup=_returns("None")),
]  # fmt: skip

# A real subprocess: the command line itself refuses learning_rate=inf (in 0.4 s, before
# jax is imported); plan's and comm_report's own real cases are in test_bad_inputs.py.
REAL = {"train_lr_inf"}


def test_the_cases_cover_the_config_commands():
    assert len(CASES) >= 15 and len(set(names(CASES))) == len(CASES)
    for command in CONFIG_COMMANDS:
        assert sum(case.command == command for case in CASES) >= 3, command
    assert set(names(CASES)) >= REAL


@pytest.mark.parametrize("case", CASES, ids=names(CASES))
def test_bad_setting_is_one_line_and_changes_nothing(
    tmp_path: Path, bad_input_run: Path, case: Case
):
    check(tmp_path, bad_input_run, case, real=case.name in REAL)
