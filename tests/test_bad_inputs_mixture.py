"""Bad mixtures (`data.sources`; the rules: `tests/bad_inputs.py`): the form, weights
that are negative or all zero, a name given twice, sources beside data.path or without
data.source=tokens, a missing or unprepared directory, sources prepared with different
tokenizers, and a source whose vocabulary exceeds model.vocab_size. Each is refused in
one line before anything compiles or is written."""

from __future__ import annotations

from pathlib import Path

import pytest

from moe_jax.data import prepare
from tests.bad_inputs import WORKDIR, Case, Place, check, names
from tests.bad_inputs import case as _c
from tests.commands import TINY

TOKENS = [*TINY, WORKDIR, "--config.data.source=tokens"]


def _sources(text: str) -> str:
    return f"--config.data.sources={text}"


def _two(place: Place) -> None:
    place.prepared("a")
    place.prepared("b")


def _byte_and_bpe(place: Place) -> None:
    """`a` prepared with the byte tokenizer, `b` with a small BPE."""
    from tests.test_data import train_bpe

    place.prepared("a")
    tokenizer = place.root / "bpe.json"
    train_bpe(tokenizer, ["<|endoftext|>"])
    text = place.file("bpe.txt", "".join(f"alpha beta gamma {i}\n\n" for i in range(200)))
    args = ["--input", str(text), "--output", str(place.root / "b"), "--tokenizer", str(tokenizer)]
    assert prepare.main(args) == 0


TWO = "{root}/a:1:web,{root}/b:1:code"
CASES = [
    _c(
        "sources_not_dir_weight_name",
        "train",
        [*TOKENS, _sources("{root}/a:web")],
        "data.sources=",
        "write DIR:WEIGHT:NAME",
    ),
    _c(
        "sources_negative_weight",
        "train",
        [*TOKENS, _sources("{root}/a:-1:web,{root}/b:1:code")],
        "the weight '-1' of 'web' must be a finite number >= 0",
    ),
    _c(
        "sources_weight_not_a_number",
        "train",
        [*TOKENS, _sources("{root}/a:lots:web")],
        "the weight 'lots' of 'web'",
    ),
    _c(
        "sources_all_weights_zero",
        "train",
        [*TOKENS, _sources("{root}/a:0:web,{root}/b:0.0:code")],
        "every weight is 0",
    ),
    _c(
        "sources_name_given_twice",
        "train",
        [*TOKENS, _sources("{root}/a:1:web,{root}/b:2:web")],
        "the name 'web' is given twice",
    ),
    _c(
        "sources_name_not_a_metric_key",
        "train",
        [*TOKENS, _sources("{root}/a:1:web pages")],
        "the name 'web pages' must be letters",
    ),
    _c(
        "sources_beside_data_path",
        "train",
        [*TOKENS, "--config.data.path={root}/a", _sources(TWO)],
        "data.path='{root}/a'",
        "ambiguous beside data.sources",
        setup=_two,
    ),
    _c(
        "sources_without_source_tokens",
        "train",
        [*TINY, WORKDIR, _sources(TWO)],
        "data.source='stdlib'",
        "--config.data.source=tokens",
    ),
    _c(
        "sources_directory_missing",
        "train",
        [*TOKENS, _sources("{root}/a:1:web,{root}/absent:1:code")],
        "source 'code' ({root}/absent) does not exist",
        setup=lambda place: place.prepared("a"),
    ),
    _c(
        "sources_directory_not_prepared",
        "train",
        [*TOKENS, _sources("{root}/a:1:web,{root}/raw:1:code")],
        "source 'code' ({root}/raw) is not prepared (no meta.json)",
        setup=lambda place: (place.prepared("a"), place.file("raw/notes.txt")),
    ),
    _c(
        "sources_different_tokenizers",
        "train",
        [*TOKENS, _sources(TWO)],
        "source 'code' ({root}/b) was prepared with another tokenizer than source 'web'",
        setup=_byte_and_bpe,
    ),
    _c(
        "sources_vocabulary_beyond_the_model",
        "train",
        [*TOKENS, "--config.model.vocab_size=200", _sources(TWO)],
        "source 'web' ({root}/a) has a vocabulary of 259, more than model.vocab_size=200",
        setup=_two,
    ),
]
REAL = {"sources_name_given_twice"}  # the command line itself, once


@pytest.mark.parametrize("case", CASES, ids=names(CASES))
def test_bad_mixture_is_one_line_and_changes_nothing(
    tmp_path: Path, bad_input_run: Path, case: Case
):
    check(tmp_path, bad_input_run, case, real=case.name in REAL)
