"""Mixtures (`data.sources`): windows drawn by weight, the same global batch on every
process, exact resume through wraps, and every batch's ids checked against the model's
vocabulary, counted against plain references (letters that tell the sources apart, a
loop over the uninterrupted stream)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from moe_jax.data import mixture, pipeline, prepare
from moe_jax.data.tokenizer import ByteTokenizer
from tests.settings import make_config

LETTERS = {"web": "w", "code": "c", "math": "m"}


def prepare_sources(root: Path, sizes: dict[str, int]) -> dict[str, Path]:
    """One prepared directory per name, each of documents of its own letter only, so a
    window's first token names its source; `sizes`: documents per source."""
    made = {}
    for name, documents in sizes.items():
        text = root / f"{name}.txt"
        text.write_text("".join(LETTERS[name] * 40 + "\n\n" for _ in range(documents)))
        made[name] = root / name
        assert prepare.main(["--input", str(text), "--output", str(made[name])]) == 0
    return made


def sources_text(dirs: dict[str, Path], weights: dict[str, float]) -> str:
    return ",".join(f"{dirs[n]}:{w}:{n}" for n, w in weights.items())


@pytest.fixture(scope="module")
def three(tmp_path_factory) -> dict[str, Path]:
    return prepare_sources(tmp_path_factory.mktemp("mix"), {"web": 60, "code": 20, "math": 8})


def config_of(sources: str, **train):
    overrides = {"data.source": "tokens", "data.sources": sources, "train.seq_len": 16}
    return make_config({**overrides, **{f"train.{k}": v for k, v in train.items()}})


def which(batch: dict[str, np.ndarray]) -> list[str]:
    by_letter = {ord(letter): name for name, letter in LETTERS.items()}
    # A window starts at any byte of a document; newlines and EOS are not letters.
    return [by_letter[next(t for t in row if t in by_letter)] for row in batch["inputs"]]


def test_drawn_proportions_match_the_weights(three):
    weights = {"web": 0.5, "code": 0.3, "math": 0.2}
    it = pipeline.make_iterator(config_of(sources_text(three, weights), batch_size=40), "train")
    drawn = [name for _ in range(10_000 // 40) for name in which(next(it))]
    assert len(drawn) == 10_000
    for name, weight in weights.items():
        assert abs(drawn.count(name) / len(drawn) - weight) < 0.01, (name, drawn.count(name))
    # Every batch holds the mixture, not a run of one source.
    assert set(which(next(it))) == set(weights)


def test_resume_is_exact_through_wraps_on_any_rows(three, capsys):
    config = config_of(sources_text(three, {"web": 1, "code": 1, "math": 2}), batch_size=8)
    straight = pipeline.make_iterator(config, "train")
    expected = [next(straight) for _ in range(30)]
    wraps = capsys.readouterr().out
    assert "data: source 'math' ran out after 18 windows and wraps" in wraps, wraps
    assert wraps.count("'math' ran out") == 1, wraps  # one line, however many epochs
    assert straight.epochs()["epochs/math"] > 1

    halves = [pipeline.make_iterator(config, "train", np.arange(4) + 4 * p) for p in range(2)]
    for _ in range(12):
        parts = [next(h) for h in halves]
    state = json.loads(json.dumps(halves[1].get_state()))
    assert state == json.loads(json.dumps(halves[0].get_state()))  # the same on every process
    for rows in (np.arange(8), np.array([1, 3, 5, 7])):
        restored = pipeline.make_iterator(config, "train", rows)
        restored.set_state(state)
        for want in expected[12:]:
            got = next(restored)
            for key in ("inputs", "targets"):
                np.testing.assert_array_equal(got[key], want[key][rows])
    np.testing.assert_array_equal(
        np.concatenate([p["inputs"] for p in parts]), expected[11]["inputs"]
    )

    other = pipeline.make_iterator(config_of(config.data.sources, batch_size=8, seed=1), "train")
    with pytest.raises(ValueError, match="seed"):
        other.set_state(state)


def test_val_per_source_reads_that_source_in_order(three):
    config = config_of(sources_text(three, {"web": 1, "code": 1, "math": 1}), batch_size=2)
    alone = mixture.source_iterators(config, np.arange(2))
    assert list(alone) == ["web", "code", "math"]
    for name, it in alone.items():
        single = make_config(
            {
                "data.source": "tokens",
                "data.path": str(three[name]),
                "train.batch_size": 2,
                "train.seq_len": 16,
            }
        )
        reference = pipeline.make_iterator(single, "val", shuffle=False)
        for _ in range(3):
            np.testing.assert_array_equal(next(it)["inputs"], next(reference)["inputs"])


@pytest.mark.parametrize("mixed", [False, True])
def test_an_id_changed_after_prepare_stops_the_batch_that_reads_it(tmp_path, mixed):
    dirs = prepare_sources(tmp_path, {"web": 10, "code": 10})
    raw = np.fromfile(dirs["code"] / "train.bin", np.uint16)
    offset = 17 * 5 + 3  # window 5's fourth token (windows of seq_len + 1 = 17)
    raw[offset] = 60000
    raw.tofile(dirs["code"] / "train.bin")
    if mixed:
        config = config_of(sources_text(dirs, {"web": 1, "code": 1}), batch_size=4)
    else:
        config = make_config(
            {
                "data.source": "tokens",
                "data.path": str(dirs["code"]),
                "train.seq_len": 16,
                "train.batch_size": 4,
            }
        )
    assert ByteTokenizer.vocab_size == config.model.vocab_size
    it = pipeline.make_iterator(config, "train")
    with pytest.raises(ValueError) as excinfo:
        for _ in range(100):
            next(it)
    message = str(excinfo.value)
    assert "\n" not in message
    assert f"{dirs['code'] / 'train.bin'} holds token id 60000 at token offset {offset}" in message
