"""Bad multi-token prediction settings (`model.mtp_depth`, `train.mtp_loss_weight`;
the rules: `tests/bad_inputs.py`), each refused in one line before anything compiles,
by `train` and by `plan`, which read them through the same door."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bad_inputs import WORKDIR, Case, check, names
from tests.bad_inputs import case as _c
from tests.commands import ROOT, TINY

CASES = [
    _c("train_mtp_depth_negative", "train", [*TINY, WORKDIR, "--config.model.mtp_depth=-1"],
       "model.mtp_depth=-1 is invalid: must be >= 0"),
    _c("train_mtp_depth_past_the_sequence", "train",
       [*TINY, WORKDIR, "--config.model.mtp_depth=32"],
       "model.mtp_depth=32 is invalid", "must be < train.seq_len=32"),
    _c("train_mtp_loss_weight_nan", "train",
       [*TINY, WORKDIR, "--config.model.mtp_depth=1", "--config.train.mtp_loss_weight=nan"],
       "train.mtp_loss_weight=nan is invalid: must be finite"),
    _c("train_mtp_loss_weight_negative", "train",
       [*TINY, WORKDIR, "--config.model.mtp_depth=1", "--config.train.mtp_loss_weight=-0.1"],
       "train.mtp_loss_weight=-0.1 is invalid: must be >= 0"),
    _c("plan_mtp_loss_weight_inf", "plan",
       ["--config.model.mtp_depth=1", "--config.train.mtp_loss_weight=inf"],
       "train.mtp_loss_weight=inf is invalid: must be finite"),
    _c("plan_mtp_depth_past_the_sequence", "plan",
       ["--config.train.seq_len=16", "--config.model.mtp_depth=16"],
       "model.mtp_depth=16 is invalid", "must be < train.seq_len=16"),
    # DeepSeek-V2-Lite as published (15.7B parameters, 4608 x 4096 tokens a step) on this
    # machine: refused by the memory check before anything compiles.
    _c("train_deepseek_v2_lite_on_this_machine", "train",
       [f"--config={ROOT}/configs/deepseek_v2_lite.py", WORKDIR],
       "error: the plan needs", "GB per device", "GB are available"),
]  # fmt: skip


def test_the_cases_are_named_once():
    assert len(set(names(CASES))) == len(CASES) == 7


@pytest.mark.parametrize("case", CASES, ids=names(CASES))
def test_bad_mtp_setting_is_one_line_and_changes_nothing(
    tmp_path: Path, bad_input_run: Path, case: Case
):
    check(tmp_path, bad_input_run, case)
