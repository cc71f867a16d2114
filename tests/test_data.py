"""Data pipeline: tokenizers, prepared token files, the stdlib corpus and resumable batches."""

import hashlib
import json
import math
import os
import pathlib
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from moe_jax.config import Config
from moe_jax.data import corpus, pipeline, prepare, token_files
from moe_jax.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from tests.settings import make_config

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
TEXT = "Grüße, naïve café — 日本語のテキスト 🙂\nline two\ttab\n"
WORDS = ["alpha", "beta", "gamma", "delta", "expert", "router", "token", "shard", "mesh"]


def run_prepare(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "moe_jax.data.prepare", *map(str, args)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def one_line_error(excinfo: pytest.ExceptionInfo, *fragments: str) -> str:
    message = str(excinfo.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    return message


def documents_of(directory: pathlib.Path, eos_id: int, decode) -> list[str]:
    """Decoded documents of both splits (each ends with EOS)."""
    docs = []
    for split in ("train", "val"):
        tokens, _ = token_files.open_split(directory, split)
        cuts = np.flatnonzero(np.asarray(tokens) == eos_id)
        assert cuts.size and cuts[-1] == len(tokens) - 1
        docs += [decode(piece) for piece in np.split(np.asarray(tokens), cuts + 1)[:-1]]
    return docs


def snapshot(directory: pathlib.Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


@pytest.fixture
def text_dir(tmp_path: pathlib.Path) -> tuple[pathlib.Path, list[str]]:
    """A directory of .txt/.md/.py/.jsonl documents, with the documents it holds."""
    root = tmp_path / "text"
    (root / "sub").mkdir(parents=True)
    docs = []
    for i in range(12):
        body = f"document {i}: {TEXT}" + " ".join(WORDS[j % len(WORDS)] for j in range(i * 7))
        suffix = (".txt", ".md", ".py")[i % 3]
        (root / ("sub" if i % 2 else "") / f"doc{i:02d}{suffix}").write_text(body, "utf-8")
        docs.append(body)
    lines = [f"record {i} ünïcode {WORDS[i % len(WORDS)]}" for i in range(10)]
    (root / "records.jsonl").write_text(
        "\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(lines)) + "\n", "utf-8"
    )
    (root / "ignored.csv").write_text("not,a,document\n", "utf-8")
    return root, docs + lines


@pytest.fixture
def prepared(text_dir, tmp_path: pathlib.Path) -> pathlib.Path:
    out = tmp_path / "tokens"
    assert prepare.main(["--input", str(text_dir[0]), "--output", str(out)]) == 0
    return out


def train_bpe(path: pathlib.Path, special_tokens: list[str]) -> int:
    """Trains a ~300-token byte-level BPE on generated text, saves it; returns its vocab size."""
    rng = np.random.default_rng(0)
    lines = [" ".join(rng.choice(WORDS, size=8)) + f" {i} naïve" for i in range(400)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer)
    tok.save(str(path))
    return tok.get_vocab_size(with_added_tokens=True)


def test_byte_tokenizer_round_trip_is_exact():
    tok = ByteTokenizer()
    ids = tok.encode(TEXT)
    assert ids.dtype == np.int32 and ids.max() < 256
    assert len(ids) == len(TEXT.encode("utf-8"))
    assert tok.decode(ids) == TEXT
    specials = [tok.bos_id, *ids.tolist(), tok.eos_id, tok.pad_id]
    assert tok.decode(specials) == TEXT
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id) == (259, 256, 257, 258)
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)


def test_load_tokenizer_missing_file(tmp_path):
    with pytest.raises(ValueError) as excinfo:
        load_tokenizer(str(tmp_path / "nope.json"))
    one_line_error(excinfo, "nope.json")


def test_prepare_cli_round_trip(text_dir, tmp_path):
    root, docs = text_dir
    out = tmp_path / "out"
    result = run_prepare("--input", root, "--output", out, "--val_fraction", "0.3")
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.strip().splitlines()) == 1 and "train" in result.stdout
    meta = token_files.read_meta(out)
    assert meta["format"] == "moe_jax.tokens.v1" and meta["dtype"] == "uint16"
    assert (meta["vocab_size"], meta["eos_id"], meta["tokenizer"]) == (259, 257, "byte")
    assert all(meta["splits"][s]["num_tokens"] > 0 for s in ("train", "val"))
    decoded = documents_of(out, ByteTokenizer.eos_id, ByteTokenizer().decode)
    assert sorted(decoded) == sorted(docs)
    assert not list(out.glob("*.tmp"))


def test_prepare_single_text_file_holds_out_its_tail(tmp_path):
    source = tmp_path / "book.txt"
    source.write_text(TEXT * 50, "utf-8")
    out = tmp_path / "out"
    assert prepare.main(["--input", str(source), "--output", str(out)]) == 0
    train, _ = token_files.open_split(out, "train")
    val, _ = token_files.open_split(out, "val")
    assert len(val) > 0 and len(train) > len(val)
    assert ByteTokenizer().decode(np.concatenate([train, val])) == TEXT * 50


def test_bpe_tokenizer_end_to_end(tmp_path):
    tok_path = tmp_path / "tokenizer.json"
    vocab = train_bpe(tok_path, ["<|endoftext|>"])
    tok = HFTokenizer(str(tok_path))
    assert tok.vocab_size == vocab and tok.eos_id == tok.bos_id
    sample = "alpha router naïve 42"
    assert tok.decode(tok.encode(sample)) == sample

    corpus_file = tmp_path / "corpus.jsonl"
    rng = np.random.default_rng(1)
    corpus_file.write_text(
        "".join(json.dumps({"body": " ".join(rng.choice(WORDS, 30))}) + "\n" for _ in range(300)),
        "utf-8",
    )
    out = tmp_path / "bpe_tokens"
    args = ["--input", str(corpus_file), "--output", str(out), "--tokenizer", str(tok_path)]
    assert prepare.main([*args, "--text_key", "body"]) == 0
    tokens, meta = token_files.open_split(out, "train")
    assert meta["vocab_size"] == vocab and meta["eos_id"] == tok.eos_id
    assert tokens.max() < vocab and (np.asarray(tokens) == tok.eos_id).any()

    overrides = {"data.source": "tokens", "data.path": str(out), "model.vocab_size": vocab}
    config = make_config({**overrides, "train.batch_size": 4, "train.seq_len": 16})
    batch = next(pipeline.make_iterator(config, "train"))
    assert batch["inputs"].shape == batch["targets"].shape == (4, 16)
    assert batch["inputs"].dtype == np.int32 and batch["inputs"].max() < vocab
    np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
    assert next(pipeline.make_iterator(config, "val", shuffle=False))["inputs"].shape == (4, 16)

    small = make_config({**overrides, "model.vocab_size": 259})
    with pytest.raises(ValueError) as excinfo:
        pipeline.make_iterator(small, "train")
    one_line_error(excinfo, "model.vocab_size=259", str(out))


def test_tokenizer_without_eos_is_refused(tmp_path):
    tok_path = tmp_path / "no_eos.json"
    train_bpe(tok_path, [])
    with pytest.raises(ValueError) as excinfo:
        load_tokenizer(str(tok_path))
    one_line_error(excinfo, str(tok_path), "<|endoftext|>", "</s>")


def test_missing_data_path(tmp_path):
    missing = tmp_path / "nowhere"
    config = make_config({"data.source": "tokens", "data.path": str(missing)})
    with pytest.raises(ValueError) as excinfo:
        pipeline.make_iterator(config, "train")
    one_line_error(excinfo, f"data.path={missing}", "moe_jax.data.prepare")
    missing.mkdir()
    with pytest.raises(ValueError) as excinfo:
        pipeline.make_iterator(config, "train")
    one_line_error(excinfo, "meta.json", "moe_jax.data.prepare")


def test_corrupt_bin_is_refused(prepared):
    with (prepared / "train-00000.bin").open("ab") as f:
        f.write(b"\x00")
    size = (prepared / "train-00000.bin").stat().st_size
    with pytest.raises(ValueError) as excinfo:
        token_files.open_split(prepared, "train")
    one_line_error(excinfo, "train-00000.bin", f"{size} bytes", "uint16's 2")


def test_meta_token_count_mismatch_is_refused(prepared):
    meta = json.loads((prepared / "meta.json").read_text())
    meta["splits"]["val"]["num_tokens"] += 3
    (prepared / "meta.json").write_text(json.dumps(meta))
    config = make_config({"data.source": "tokens", "data.path": str(prepared)})
    with pytest.raises(ValueError) as excinfo:
        pipeline.make_iterator(config, "val")
    one_line_error(excinfo, "val-00000.bin", str(meta["splits"]["val"]["num_tokens"]))


@pytest.mark.parametrize(
    ("edit", "fragment"),
    [
        ({"format": "other.v0"}, "format"),
        ({"dtype": "float32"}, "dtype"),
    ],
)
def test_bad_meta_is_refused(prepared, edit, fragment):
    meta = json.loads((prepared / "meta.json").read_text())
    (prepared / "meta.json").write_text(json.dumps({**meta, **edit}))
    with pytest.raises(ValueError) as excinfo:
        token_files.open_split(prepared, "train")
    one_line_error(excinfo, "meta.json", fragment)


def test_split_shorter_than_a_sequence(prepared):
    val_tokens = token_files.read_meta(prepared)["splits"]["val"]["num_tokens"]
    config = make_config(
        {"data.source": "tokens", "data.path": str(prepared), "train.seq_len": val_tokens}
    )
    with pytest.raises(ValueError) as excinfo:
        pipeline.make_iterator(config, "val")
    one_line_error(excinfo, "val split", f"train.seq_len={val_tokens}")


def test_prepare_refuses_a_prepared_directory(text_dir, prepared):
    before = snapshot(prepared)
    result = run_prepare("--input", text_dir[0], "--output", prepared)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "new directory" in result.stderr and str(prepared) in result.stderr
    assert snapshot(prepared) == before


def test_prepare_refuses_a_missing_input(tmp_path):
    out = tmp_path / "out"
    result = run_prepare("--input", tmp_path / "absent.txt", "--output", out)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and "absent.txt" in result.stderr
    assert not out.exists()


@pytest.mark.parametrize("source", ["stdlib", "tokens", "synthetic"])
def test_iterator_resumes_exactly(source, prepared):
    overrides = {"data.source": source, "train.seq_len": 32}
    if source == "tokens":  # only tokens reads data.path (config.load refuses it otherwise)
        overrides["data.path"] = str(prepared)
    config = make_config({**overrides, "train.seed": 3})
    it = pipeline.make_iterator(config, "train")
    for _ in range(3):
        next(it)
    state = json.loads(json.dumps(it.get_state()))
    expected = [next(it) for _ in range(3)]
    restored = pipeline.make_iterator(config, "train")
    restored.set_state(state)
    for want in expected:
        got = next(restored)
        for key in ("inputs", "targets"):
            np.testing.assert_array_equal(got[key], want[key])
    other = pipeline.make_iterator(make_config({**overrides, "train.seed": 4}), "train")
    with pytest.raises(ValueError) as excinfo:
        other.set_state(state)
    one_line_error(excinfo, "seed")


@pytest.mark.parametrize("source", ["stdlib", "synthetic"])
def test_global_batch_is_independent_of_process_count(source):
    config = make_config({"data.source": source, "train.batch_size": 8, "train.seq_len": 32})
    single = pipeline.make_iterator(config, "train")
    halves = [pipeline.make_iterator(config, "train", np.arange(4) + 4 * p) for p in range(2)]
    odd = pipeline.make_iterator(config, "train", np.array([1, 3, 5, 7]))
    for _ in range(3):
        whole = next(single)
        parts = [next(h) for h in halves]
        assert parts[0]["inputs"].shape == (4, 32)
        for key in ("inputs", "targets"):
            np.testing.assert_array_equal(np.concatenate([p[key] for p in parts]), whole[key])
        np.testing.assert_array_equal(next(odd)["inputs"], whole["inputs"][1::2])
    with pytest.raises(ValueError) as excinfo:
        pipeline.make_iterator(config, "train", np.array([7, 8]))
    one_line_error(excinfo, "train.batch_size=8")


def test_val_iterates_in_order_and_repeats(prepared):
    config = make_config(
        {"data.source": "tokens", "data.path": str(prepared), "train.batch_size": 2}
    )
    tokens, _ = token_files.open_split(prepared, "val")
    source = pipeline.PackedSequences(tokens, config.train.seq_len)
    it = pipeline.make_iterator(config, "val", shuffle=False)
    rows = np.concatenate([next(it)["inputs"] for _ in range(len(source) + 1)])
    order = [i % len(source) for i in range(len(rows))]
    np.testing.assert_array_equal(rows, np.stack([source[i][:-1] for i in order]))


def test_stdlib_split_is_deterministic_disjoint_and_sized():
    train = corpus.split_paths("train", 0.05)
    val = corpus.split_paths("val", 0.05)
    assert train and val and not set(train) & set(val)
    assert sorted(train + val) == list(corpus.stdlib_paths())
    assert not any("site-packages" in p or "dist-packages" in p for p in train + val)
    assert 0.025 < len(val) / (len(train) + len(val)) < 0.075
    assert len(corpus.stdlib_documents("val", 0.05)) == len(val)
    code = (
        "import hashlib; from moe_jax.data import corpus;"
        "print(hashlib.md5('\\n'.join(corpus.split_paths('val', 0.05)).encode()).hexdigest())"
    )
    env = {**os.environ, "PYTHONHASHSEED": "123"}
    fresh = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    assert fresh.stdout.strip() == hashlib.md5("\n".join(val).encode()).hexdigest()


def test_stdlib_token_stream():
    tokens, name = pipeline.token_stream(Config().data, "val", 259)
    assert name == "byte" and tokens.dtype == np.uint16
    eos = int((tokens == ByteTokenizer.eos_id).sum())
    assert eos == len(corpus.split_paths("val", 0.05)) and tokens[-1] == ByteTokenizer.eos_id
    with pytest.raises(ValueError) as excinfo:
        pipeline.token_stream(Config().data, "train", 100)
    one_line_error(excinfo, "model.vocab_size=100")


def test_packed_sequences_reassemble_the_stream():
    tokens = np.arange(103, dtype=np.uint16)
    windows = pipeline.PackedSequences(tokens, seq_len=9)
    assert len(windows) == 10 and windows[0].dtype == np.int32
    np.testing.assert_array_equal(np.concatenate([windows[i] for i in range(10)]), tokens[:100])
    with pytest.raises(IndexError):
        windows[10]
    with pytest.raises(ValueError) as excinfo:
        pipeline.PackedSequences(tokens[:5], seq_len=9, name="the val split")
    one_line_error(excinfo, "val split", "train.seq_len=9")


def test_unigram_entropy():
    assert math.isclose(pipeline.unigram_entropy(np.array([0, 0, 1, 1])), math.log(2))
    assert math.isclose(pipeline.unigram_entropy(np.arange(4, dtype=np.uint16)), math.log(4))
    assert pipeline.unigram_entropy(np.full(7, 5)) == 0.0


def test_global_array_matches_the_local_batch():
    batch = next(pipeline.make_iterator(make_config({"data.source": "synthetic"}), "train"))
    single = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    mesh = jax.make_mesh((len(jax.devices()),), ("data",))
    spread = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    grid = jax.make_mesh((2, len(jax.devices()) // 2), ("data", "seq"))
    tiles = jax.sharding.NamedSharding(grid, jax.sharding.PartitionSpec("data", "seq"))
    for sharding in (single, spread, tiles):
        np.testing.assert_array_equal(pipeline.local_rows(sharding, 8, 16), np.arange(8))
        arrays = pipeline.global_array(batch, sharding)
        for key, value in batch.items():
            assert arrays[key].sharding == sharding
            np.testing.assert_array_equal(np.asarray(arrays[key]), value)


def test_token_files_round_trip_large_vocab(tmp_path):
    assert token_files.dtype_for(65535) == "uint16" and token_files.dtype_for(65536) == "uint32"
    tokens = np.array([0, 70_000, 1, 99_999], np.uint32)
    token_files.write_split(tmp_path, "train", tokens)
    splits = {"train": {"num_tokens": 4}, "val": {"num_tokens": 0}}
    meta = {"format": token_files.FORMAT, "dtype": "uint32", "vocab_size": 100_000}
    token_files.write_meta(tmp_path, {**meta, "bos_id": 1, "eos_id": 1, "splits": splits})
    opened, _ = token_files.open_split(tmp_path, "train")
    np.testing.assert_array_equal(opened, tokens)
    with pytest.raises(ValueError) as excinfo:
        token_files.open_split(tmp_path, "val")
    one_line_error(excinfo, "val.bin", "missing")


@pytest.mark.parametrize("kind", ["under_a_file", "no_space"])
def test_prepare_refuses_an_output_it_cannot_write_in_one_line(tmp_path, monkeypatch, capsys, kind):
    import collections

    from moe_jax import workdir
    from moe_jax.data import prepare

    (tmp_path / "a.txt").write_text("hello world " * 100)
    output = tmp_path / "out"
    if kind == "under_a_file":
        (tmp_path / "blocker").write_text("")
        output = tmp_path / "blocker" / "out"
    else:
        usage = collections.namedtuple("usage", "total used free")
        monkeypatch.setattr(workdir.shutil, "disk_usage", lambda path: usage(1, 1, 10))
    code = prepare.main(["--input", str(tmp_path / "a.txt"), "--output", str(output)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith(f"error: --output={output}")
    assert ("lies under" if kind == "under_a_file" else "MB needed") in err[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_during_prepare_leaves_nothing(tmp_path, monkeypatch, capsys, signum):
    """SIGINT and SIGTERM alike: the signal arrives (for real, sent to this process) as
    meta.json is about to be written; the splits and the tokenizer copy already written
    go, with the directory prepare made; one line, exit status 130."""
    tok_path = tmp_path / "tok.json"
    train_bpe(tok_path, ["<|endoftext|>"])
    (tmp_path / "text.txt").write_text(TEXT * 20)
    real_write_meta = prepare.write_meta

    def signalled(directory, meta):
        assert {p.name for p in directory.iterdir()} >= {"train-00000.bin", "tokenizer.json"}
        os.kill(os.getpid(), signum)
        return real_write_meta(directory, meta)

    monkeypatch.setattr(prepare, "write_meta", signalled)
    out = tmp_path / "out"
    args = ["--input", str(tmp_path / "text.txt"), "--output", str(out), "--tokenizer"]
    with pytest.raises(SystemExit) as stopped:
        prepare.main([*args, str(tok_path)])
    assert stopped.value.code == 130
    assert not out.exists()
    name = signal.Signals(signum).name
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == f"error: interrupted ({name}) during prepare; nothing was written"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers put back


def test_prepared_corpus_carries_its_tokenizer(tmp_path):
    """meta.json names the copy beside the splits, which decodes the corpus after the
    original tokenizer file is gone."""
    tok_path = tmp_path / "tok.json"
    train_bpe(tok_path, ["<|endoftext|>"])
    (tmp_path / "text.txt").write_text(TEXT)
    out = tmp_path / "out"
    args = ["--input", str(tmp_path / "text.txt"), "--output", str(out)]
    assert prepare.main([*args, "--tokenizer", str(tok_path)]) == 0
    original = tok_path.read_bytes()
    tok_path.unlink()
    meta = token_files.read_meta(out)
    assert meta["tokenizer"] == "tokenizer.json"
    assert (out / "tokenizer.json").read_bytes() == original
    splits = [token_files.open_split(out, split)[0] for split in ("train", "val")]
    spec = token_files.tokenizer_spec(out, meta)
    assert HFTokenizer(spec).decode(np.concatenate(splits)) == TEXT


def test_batches_of_one_sequence_are_the_rows_of_batches_of_four(tmp_path):
    """train.batch_size=1 (once an OverflowError from grain's length of an endless
    dataset): the same windows, in the same order, as batch 4 split into rows."""
    (tmp_path / "text.txt").write_text(TEXT * 40)
    out = tmp_path / "tokens"
    assert prepare.main(["--input", str(tmp_path / "text.txt"), "--output", str(out)]) == 0
    overrides = {"data.source": "tokens", "data.path": str(out), "train.seq_len": 16}
    ones = pipeline.make_iterator(make_config({**overrides, "train.batch_size": 1}), "train")
    fours = pipeline.make_iterator(make_config({**overrides, "train.batch_size": 4}), "train")
    singles = np.concatenate([next(ones)["inputs"] for _ in range(8)])
    batches = np.concatenate([next(fours)["inputs"] for _ in range(2)])
    np.testing.assert_array_equal(singles, batches)
