"""Bad corpora given to `prepare` (parquet files, saved `datasets` folders, workers) and a
shard changed after prepare under `data.verify` (the rules: `tests/bad_inputs.py`):
each refused in one line naming the path or setting, nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.bad_inputs import TOKENS, WORKDIR, Case, Place, check, names
from tests.bad_inputs import case as _c
from tests.commands import TINY

OUT = "--output={root}/out"


def _parquet(place: Place, table: pa.Table) -> None:
    pq.write_table(table, place.root / "corpus.parquet")


def _datasets_without_arrow(place: Place) -> None:
    folder = place.root / "saved"
    folder.mkdir()
    (folder / "state.json").write_text(json.dumps({"_data_files": [], "_split": "train"}))
    (folder / "dataset_info.json").write_text("{}")


def _changed_shard(place: Place) -> None:
    shard = place.prepared() / "train-00000.bin"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0x01  # the size and meta.json stay as prepare wrote them
    shard.write_bytes(bytes(data))


CASES = [
    _c(
        "parquet_without_the_text_column",
        "prepare",
        ["--input={root}/corpus.parquet", OUT],
        "corpus.parquet has no column 'text' (--text_key); its columns: id, body",
        setup=lambda p: _parquet(p, pa.table({"id": [1, 2], "body": ["a", "b"]})),
    ),
    _c(
        "parquet_empty_file",
        "prepare",
        ["--input={root}/corpus.parquet", OUT],
        "corpus.parquet is not a readable parquet file",
        setup=lambda p: p.file("corpus.parquet", ""),
    ),
    _c(
        "parquet_without_rows",
        "prepare",
        ["--input={root}/corpus.parquet", OUT],
        "--input has no documents",
        setup=lambda p: _parquet(p, pa.table({"text": pa.array([], pa.string())})),
    ),
    _c(
        "workers_zero",
        "prepare",
        ["--input={root}/corpus.parquet", OUT, "--workers=0"],
        "--workers=0 is invalid: must be at least 1",
        setup=lambda p: _parquet(p, pa.table({"text": ["a"]})),
    ),
    _c(
        "datasets_folder_without_arrow_files",
        "prepare",
        ["--input={root}/saved", OUT],
        "saved is a saved datasets folder but holds no .arrow files",
        setup=_datasets_without_arrow,
    ),
    _c(
        "shard_checksum_differs_under_verify",
        "train",
        [*TINY, *TOKENS, WORKDIR, "--config.data.verify=true"],
        "data.verify:",
        "train-00000.bin has sha256",
        "the shard changed after prepare",
        setup=_changed_shard,
    ),
    _c(
        "verify_without_token_files",
        "train",
        [*TINY, WORKDIR, "--config.data.verify=true"],
        "data.verify=True",
        "only prepared token files have checksums",
    ),
]


def test_the_cases_are_named_once():
    assert len(set(names(CASES))) == len(CASES) == 7


@pytest.mark.parametrize("case", CASES, ids=names(CASES))
def test_bad_corpus_is_one_line_and_changes_nothing(tmp_path: Path, case: Case):
    check(tmp_path, tmp_path / "no-run", case)  # no case needs a trained run
