"""Bad document-mask settings (`data.document_mask`; the rules: `tests/bad_inputs.py`),
each refused in one line before anything compiles. data.source=synthetic has no
documents: the setting does nothing there (docs/data.md), so it is no bad input."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bad_inputs import WORKDIR, Case, check, names
from tests.bad_inputs import case as _c
from tests.commands import TINY

CASES = [
    _c("train_cudnn_with_document_mask", "train",
       [*TINY, WORKDIR, "--config.model.attention_impl=cudnn", "--config.model.dtype=bfloat16"],
       "model.attention_impl='cudnn' is invalid", "cannot mask documents",
       "data.document_mask=false"),
    _c("train_document_mask_not_a_bool", "train",
       [*TINY, WORKDIR, "--config.data.document_mask=2"],
       "--config.data.document_mask=2", "Non-boolean argument to boolean flag"),
]  # fmt: skip


def test_the_cases_are_named_once():
    assert len(set(names(CASES))) == len(CASES) == 2


@pytest.mark.parametrize("case", CASES, ids=names(CASES))
def test_bad_document_setting_is_one_line_and_changes_nothing(
    tmp_path: Path, bad_input_run: Path, case: Case
):
    check(tmp_path, bad_input_run, case)
