"""Corpora as they come: parquet and saved `datasets` folders give the same token files
as the same texts in .jsonl, with any number of workers and shards; prepare streams
(peak memory bounded as the corpus grows); an interrupted prepare is never taken for a
finished one; data.verify catches a shard changed after prepare."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from moe_jax.data import pipeline, prepare, token_files
from tests.commands import subprocess_env
from tests.settings import make_config

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
WORDS = ["alpha", "beta", "gamma", "délta", "expert", "router", "token", "shard", "日本"]


def texts(count: int, seed: int = 0, words: int = 40) -> list[str]:
    rng = np.random.default_rng(seed)
    return [f"doc {i}: " + " ".join(rng.choice(WORDS, words)) for i in range(count)]


def write_jsonl(path: pathlib.Path, docs: list[str]) -> pathlib.Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs), "utf-8")
    return path


def write_parquet_folder(folder: pathlib.Path, docs: list[str], files: int, group: int) -> None:
    """`docs` cut into `files` parquet files of row groups of `group` rows, plus an id
    column (the text column is chosen by name)."""
    folder.mkdir()
    for i, part in enumerate(np.array_split(np.arange(len(docs)), files)):
        table = pa.table({"id": part, "text": [docs[j] for j in part]})
        pq.write_table(
            table, folder / f"train-{i:05d}-of-{files:05d}.parquet", row_group_size=group
        )
        assert pq.ParquetFile(folder / f"train-{i:05d}-of-{files:05d}.parquet").num_row_groups > 1


def write_datasets_folder(folder: pathlib.Path, docs: list[str], files: int) -> None:
    """What `datasets.Dataset.save_to_disk` writes: Arrow IPC stream files of record
    batches, state.json listing them, dataset_info.json."""
    folder.mkdir()
    names = []
    for i, part in enumerate(np.array_split(np.arange(len(docs)), files)):
        name = f"data-{i:05d}-of-{files:05d}.arrow"
        table = pa.table({"text": [docs[j] for j in part], "n": part})
        with (
            pa.OSFile(str(folder / name), "wb") as sink,
            pa.ipc.new_stream(sink, table.schema) as w,
        ):
            for batch in table.to_batches(max_chunksize=7):
                w.write_batch(batch)
        names.append({"filename": name})
    (folder / "state.json").write_text(json.dumps({"_data_files": names, "_split": "train"}))
    (folder / "dataset_info.json").write_text(json.dumps({"features": {}}))


def splits_of(out: pathlib.Path) -> dict[str, np.ndarray]:
    return {s: np.asarray(token_files.open_split(out, s)[0]) for s in ("train", "val")}


def test_parquet_and_datasets_folders_give_the_jsonl_token_files(tmp_path):
    """The same 60 texts as one .jsonl file, as 3 parquet files of 2+ row groups each (2
    workers, 500-token shards) and as a saved datasets folder of 2 Arrow files: the same
    train and val streams; the sharded one serves the same batches."""
    docs = texts(60)
    reference = tmp_path / "ref"
    assert (
        prepare.main(
            ["--input", str(write_jsonl(tmp_path / "d.jsonl", docs)), "--output", str(reference)]
        )
        == 0
    )
    want = splits_of(reference)
    assert want["train"].size and want["val"].size

    write_parquet_folder(tmp_path / "pq", docs, files=3, group=8)
    sharded = tmp_path / "pq_out"
    args = ["--input", str(tmp_path / "pq"), "--output", str(sharded), "--workers", "2"]
    assert prepare.main([*args, "--shard_tokens", "500"]) == 0
    write_datasets_folder(tmp_path / "ds", docs, files=2)
    assert (
        prepare.main(["--input", str(tmp_path / "ds"), "--output", str(tmp_path / "ds_out")]) == 0
    )

    for out in (sharded, tmp_path / "ds_out"):
        got = splits_of(out)
        for split in ("train", "val"):
            np.testing.assert_array_equal(got[split], want[split])
    meta = token_files.read_meta(sharded)
    shards = meta["splits"]["train"]["shards"]
    assert len(shards) == -(-want["train"].size // 500) and shards[0]["num_tokens"] == 500
    assert meta["splits"]["train"]["max_id"] == int(want["train"].max())
    assert (
        token_files.read_meta(tmp_path / "ds_out")["splits"]
        == token_files.read_meta(reference)["splits"]
    )

    overrides = {"data.source": "tokens", "train.seq_len": 48, "train.batch_size": 4}
    one = pipeline.make_iterator(make_config({**overrides, "data.path": str(reference)}), "train")
    many = pipeline.make_iterator(make_config({**overrides, "data.path": str(sharded)}), "train")
    for _ in range(3):  # windows that cross shard boundaries come out whole
        a, b = next(one), next(many)
        np.testing.assert_array_equal(a["inputs"], b["inputs"])
        np.testing.assert_array_equal(a["targets"], b["targets"])


# VmHWM, not getrusage's ru_maxrss: that keeps the forking parent's peak across exec.
PEAK_RSS = """
import sys
from moe_jax.data import encode, prepare, readers
encode.BATCH_BYTES, readers.BATCH_ROWS = 1 << 16, 16  # the bound, scaled to a small corpus
assert prepare.main(sys.argv[1:]) == 0
print(open("/proc/self/status").read().split("VmHWM:")[1].split()[0])
"""


def _peak_rss(source: pathlib.Path, out: pathlib.Path) -> int:
    """Peak resident bytes of a fresh process that prepares `source`."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", PEAK_RSS, "--input", str(source), "--output", str(out)],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return int(done.stdout.split()[-1]) * 1024


def test_peak_memory_stays_bounded_as_the_corpus_grows(tmp_path):
    """0.5 MB and 14 MB of text in one parquet file (row groups of 32 rows; tasks of
    64 KB): held whole, the larger would need at least 3 bytes more per byte of text
    grown (the text, and its uint16 tokens), over 39 MB; streamed, its peak RSS grows by
    less than the text itself (measured: 0 to 8 MB, the allocator's noise, either way)."""
    base = " ".join(np.random.default_rng(0).choice(WORDS, 4000))
    grown, peak = 0, []
    for count in (64, 1728):
        docs = [f"doc {i}: " + base[i % 97 :][:8000] for i in range(count)]
        path = tmp_path / f"{count}.parquet"
        pq.write_table(pa.table({"text": docs}), path, row_group_size=32)
        grown = sum(len(t.encode()) for t in docs) - grown
        peak.append(_peak_rss(path, tmp_path / f"out{count}"))
    assert grown > 13e6
    assert peak[1] - peak[0] < grown, (peak, grown)


def test_an_interrupted_prepare_is_never_taken_for_a_finished_one(tmp_path):
    """prepare SIGKILLed with every shard written and meta.json not yet: loading the
    output and preparing into it again are both refused in one line naming it."""
    source = write_jsonl(tmp_path / "d.jsonl", texts(40))
    out = tmp_path / "out"
    # A child process (not a fork of this multithreaded one) dies at the worst moment,
    # as under a power cut.
    child = (
        "import os, signal, sys; from moe_jax.data import prepare; "
        "prepare.write_meta = lambda *_: os.kill(os.getpid(), signal.SIGKILL); "
        "prepare.main(sys.argv[1:])"
    )
    args = ["--input", str(source), "--output", str(out), "--shard_tokens", "300"]
    done = subprocess.run([sys.executable, "-c", child, *args], env=subprocess_env(), timeout=120)
    assert done.returncode == -signal.SIGKILL
    assert (out / "train-00000.bin").is_file() and not (out / "meta.json").exists()
    with pytest.raises(ValueError, match=r"has no meta\.json") as excinfo:
        token_files.open_split(out, "train")
    assert "\n" not in str(excinfo.value)
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(ValueError, match="interrupted prepare") as excinfo:
        prepare.prepare(source, out, "byte", 0.05, "text")
    assert "train-00000.bin" in str(excinfo.value) and "\n" not in str(excinfo.value)
    assert sorted(p.name for p in out.iterdir()) == before


def test_verify_catches_a_changed_shard(tmp_path):
    """One byte of the second shard changed (its size kept): opened as before without
    data.verify; with it, refused in one line naming that shard."""
    out = tmp_path / "out"
    source = write_jsonl(tmp_path / "d.jsonl", texts(40))
    assert (
        prepare.main(["--input", str(source), "--output", str(out), "--shard_tokens", "400"]) == 0
    )
    shard = out / "train-00001.bin"
    data = bytearray(shard.read_bytes())
    data[10] ^= 0x01
    shard.write_bytes(bytes(data))
    overrides = {"data.source": "tokens", "data.path": str(out), "train.seq_len": 16}
    pipeline.make_iterator(make_config(overrides), "train")
    pipeline.make_iterator(make_config({**overrides, "data.verify": True}), "val")
    with pytest.raises(ValueError) as excinfo:
        pipeline.make_iterator(make_config({**overrides, "data.verify": True}), "train")
    message = str(excinfo.value)
    assert "\n" not in message and str(shard) in message and "data.verify" in message


def test_a_single_document_held_out_across_shards(tmp_path):
    """One .txt file (no hash split possible): val is the stream's last 5% of tokens, the
    same with 100-token shards as with one shard, and the shards' checksums hold."""
    (tmp_path / "book.txt").write_text("Grüße, naïve café 🙂 " * 120, "utf-8")
    outs = {}
    for shard_tokens in (100, 1 << 20):
        out = tmp_path / f"out{shard_tokens}"
        args = ["--input", str(tmp_path / "book.txt"), "--output", str(out)]
        assert prepare.main([*args, "--shard_tokens", str(shard_tokens)]) == 0
        outs[shard_tokens] = splits_of(out)
        meta = token_files.read_meta(out)
        for split in ("train", "val"):
            token_files.verify_split(out, split, meta)
    stream = np.concatenate([outs[1 << 20]["train"], outs[1 << 20]["val"]])
    assert outs[100]["val"].size == -(-stream.size * 5 // 100)
    for split in ("train", "val"):
        np.testing.assert_array_equal(outs[100][split], outs[1 << 20][split])
    assert not list(tmp_path.glob("out*/.stream"))
