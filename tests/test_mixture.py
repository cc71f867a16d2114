"""Mixtures (`data.sources`): windows drawn by weight, the same global batch on every
process, exact resume through wraps, and every batch's ids checked against the model's
vocabulary, counted against plain references (letters that tell the sources apart, a
loop over the uninterrupted stream)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from moe_jax import config_sources
from moe_jax.config import load
from moe_jax.data import pipeline, prepare
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


def flip(file: Path, offset: int) -> None:
    """Token `offset` of a uint16 token file set to 60000 in place, as a bit flip would
    (meta.json untouched: its stored max_id still says all is well)."""
    with file.open("r+b") as f:
        f.seek(2 * offset)
        f.write(np.uint16(60000).tobytes())


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


def test_a_config_file_may_give_the_sources_as_a_list(three):
    listed = [[str(three["web"]), 2, "web"], (str(three["code"]), 0.5, "code")]
    config = load({"data": {"source": "tokens", "sources": listed}})
    assert config.data.sources == f"{three['web']}:2:web,{three['code']}:0.5:code"
    assert config_sources.parse(config.data.sources)[1] == (str(three["code"]), 0.5, "code")


def test_mixed_batches_carry_the_document_fields_of_their_windows(three):
    """With data.document_mask on (the default) each mixed window's segment ids,
    positions and loss mask are those its own tokens give; off, a batch is the pairs."""
    from moe_jax.data.documents import document_fields
    from moe_jax.data.tokenizer import ByteTokenizer

    sources = sources_text(three, {"web": 3, "code": 2, "math": 1})
    batch = next(pipeline.make_iterator(config_of(sources), "train"))
    fields = document_fields(batch["inputs"], ByteTokenizer.eos_id)
    assert sorted(batch) == sorted(["inputs", "targets", *fields])
    for key, value in fields.items():
        np.testing.assert_array_equal(batch[key], value)
    off = make_config(
        {
            "data.source": "tokens",
            "data.sources": sources,
            "train.seq_len": 16,
            "data.document_mask": False,
        }
    )
    assert sorted(next(pipeline.make_iterator(off, "train"))) == ["inputs", "targets"]


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
    alone = pipeline.source_iterators(config, np.arange(2))
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
            got, want = next(it), next(reference)
            assert sorted(got) == sorted(want)  # the document fields too (masks are on)
            for key in want:
                np.testing.assert_array_equal(got[key], want[key])


@pytest.mark.parametrize("mixed", [False, True])
def test_an_id_changed_after_prepare_stops_the_batch_that_reads_it(tmp_path, mixed):
    dirs = prepare_sources(tmp_path, {"web": 10, "code": 10})
    offset = 17 * 5 + 3  # window 5's fourth token (windows of seq_len + 1 = 17)
    flip(dirs["code"] / "train-00000.bin", offset)
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
    assert (
        f"{dirs['code'] / 'train-00000.bin'} holds token id 60000 at token offset {offset}"
        in message
    )


def test_a_flipped_id_stops_the_run_before_the_step_that_reads_it(tmp_path):
    """The command line on a train.bin patched after prepare (meta.json's stored max_id
    still says all is well): steps 1-2 run and are saved, step 3's batch holds the id,
    so the run stops in one line naming the file, offset and id, exit status 1, and no
    checkpoint or metrics row of step 3 exists."""
    from moe_jax.checkpoint import Checkpointer
    from moe_jax.metrics import read_rows
    from tests.commands import TINY
    from tests.test_trainer import _train_cli

    text = tmp_path / "numbered.txt"  # every window differs: found again by its tokens
    text.write_text("".join(f"line {i} of a numbered text\n" for i in range(300)))
    data = tmp_path / "data"
    assert prepare.main(["--input", str(text), "--output", str(data)]) == 0
    overrides = {"data.source": "tokens", "data.path": str(data)}
    config = make_config({**overrides, "train.batch_size": 4, "train.seq_len": 32})
    it = pipeline.make_iterator(config, "train")
    third = [next(it) for _ in range(3)][2]["inputs"][0]  # step 3's first row
    raw = np.fromfile(data / "train-00000.bin", np.uint16)
    windows = raw[: len(raw) // 33 * 33].reshape(-1, 33)[:, :-1]
    window = int(np.flatnonzero((windows == third).all(1))[0])
    del it  # its reading threads map the file
    flip(data / "train-00000.bin", window * 33 + 5)

    run = tmp_path / "run"
    settings = ["--config.train.steps=6", "--config.train.checkpoint_every=1"]
    done = _train_cli(
        run,
        *TINY,
        *settings,
        "--config.train.eval_every=0",
        "--config.data.source=tokens",
        f"--config.data.path={data}",
        warm=True,
    )
    assert done.returncode == 1, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        f"error: {data / 'train-00000.bin'} holds token id 60000 at token offset "
        f"{window * 33 + 5}, "
        "outside model.vocab_size=259 (the file changed after prepare, or is damaged); "
        "stopped before the step that would read it: re-run prepare"
    )
    checkpoints = Checkpointer(run / "checkpoints", 3)
    assert checkpoints.steps() == [2, 1]
    checkpoints.close()
    assert max(row["step"] for row in read_rows(run / "metrics.jsonl")) == 2
