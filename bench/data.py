"""Data throughput: `prepare` in MB/s against `tokenizers`' own speed, and the loader's
tokens/s against what the default run consumes.

Why: the "Throughput" section of docs/data.md quotes these figures. The script writes a
synthetic corpus (one parquet file of `--mb` MB of text), trains a small byte-level
BPE with `tokenizers` (as the tests do), and times:
- `prepare` with the byte tokenizer and the BPE, at 1 and 2 `--workers`, in MB of text
  per second (the call in a fresh interpreter, its workers' start included), next to
  `Tokenizer.encode_batch` over the same texts in this process
  (the Rust side uses every core), measured in the same run;
- the loader (`pipeline.make_iterator`, the default batch 16 x 128) in tokens/s of one
  process, with document masks (the default) and without, and drawing from a 3-source
  mixture (weights 3:2:1), against the default run's consumption: tokens_per_sec of `--metrics` (a
  metrics.jsonl of `make train`), else of a `--train_steps` run of the default config
  measured here (the median of its logged steps after the first two).

    python bench/data.py [--json] [--small] [--mb 16] [--metrics runs/default/metrics.jsonl]

`--small` (1 MB, no training run) is what tests/test_bench_data.py runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import repo_root
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from moe_jax import config as config_lib
from moe_jax.data import pipeline
from moe_jax.data.tokenizer import HFTokenizer

WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "for",
    "it",
    "with",
    "as",
    "was",
    "on",
    "expert",
    "router",
    "token",
    "shard",
    "mesh",
]


def corpus(path: Path, megabytes: float) -> list[str]:
    """Documents of ~4 KB of word salad with digits and punctuation, written as parquet."""
    rng = np.random.default_rng(0)
    base = " ".join(rng.choice(WORDS, 200_000)) + " 0123 4567, naïve (x) = y;"
    count = max(8, int(megabytes * 1e6 / 4000))
    docs = [f"doc {i}: {base[(i * 7919) % 100_000 :][:4000]}" for i in range(count)]
    pq.write_table(pa.table({"text": docs}), path, row_group_size=1024)
    return docs


def train_bpe(path: Path, docs: list[str]) -> None:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=2000,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs[:500], trainer)
    tok.save(str(path))


# In a fresh interpreter whose __main__ is no file: spawned workers then import only what
# prepare needs (from this script they would re-import it, jax and all, as __mp_main__).
TIMED = """
import sys, time
from moe_jax.data import prepare
start = time.perf_counter()
prepare.prepare(*map(prepare.Path, sys.argv[1:3]), sys.argv[3], 0.05, "text", int(sys.argv[4]))
print(time.perf_counter() - start)
"""


def time_prepare(source: Path, out: Path, spec: str, workers: int) -> float:
    """Seconds of one prepare call, the workers' start included, interpreter start not."""
    done = subprocess.run(
        [sys.executable, "-c", TIMED, str(source), str(out), spec, str(workers)],
        env={**os.environ, "PYTHONPATH": str(repo_root.ROOT)},
        capture_output=True,
        text=True,
    )
    if done.returncode:
        raise SystemExit(f"error: prepare failed: {done.stderr[-500:]}")
    return float(done.stdout.split()[-1])


def time_encode_batch(spec: str, docs: list[str]) -> float:
    tok = HFTokenizer(spec)
    start = time.perf_counter()
    for i in range(0, len(docs), 1024):
        tok.encode_batch(docs[i : i + 1024])
    return time.perf_counter() - start


def loader_tokens_per_sec(batches: int, **data: object) -> float:
    """Tokens/s of the training iterator of the default config with `data` settings."""
    raw = config_lib.to_config_dict(config_lib.Config()).to_dict()
    raw["data"].update(source="tokens", **data)
    config = config_lib.load(raw)
    it = pipeline.make_iterator(config, "train")
    next(it)  # grain's threads started
    start = time.perf_counter()
    tokens = sum(next(it)["inputs"].size for _ in range(batches))
    return tokens / (time.perf_counter() - start)


def run_tokens_per_sec(metrics: Path | None, steps: int) -> tuple[float | None, str]:
    """The default run's tokens/s: from a metrics.jsonl, else a short run measured here."""
    if metrics is None and steps:
        work = Path(tempfile.mkdtemp(prefix="bench_data_run_"))
        args = [f"--config.train.steps={steps}", "--config.train.log_every=1"]
        args += ["--config.train.eval_every=0", f"--workdir={work}"]
        done = subprocess.run(
            [sys.executable, "-m", "moe_jax.train", *args],
            cwd=repo_root.ROOT,
            env={**os.environ, "PYTHONPATH": str(repo_root.ROOT)},
            capture_output=True,
            text=True,
        )
        if done.returncode:
            raise SystemExit(f"error: the default run failed: {done.stderr[-500:]}")
        metrics = work / "metrics.jsonl"
    if metrics is None:
        return None, "not measured (--metrics or --train_steps)"
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    rates = [r["tokens_per_sec"] for r in rows if "tokens_per_sec" in r and r["step"] > 2]
    return statistics.median(rates), f"median tokens_per_sec of {len(rates)} steps of {metrics}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    parser.add_argument("--small", action="store_true", help="1 MB, no training run")
    parser.add_argument("--mb", type=float, default=16.0, help="MB of text in the corpus")
    parser.add_argument("--metrics", type=Path, help="metrics.jsonl of the default run")
    parser.add_argument("--train_steps", type=int, default=30, help="else: run this many")
    args = parser.parse_args()
    megabytes, steps = (1.0, 0) if args.small else (args.mb, args.train_steps)
    work = Path(tempfile.mkdtemp(prefix="bench_data_"))
    docs = corpus(work / "corpus.parquet", megabytes)
    text_mb = sum(len(d.encode()) for d in docs) / 1e6
    train_bpe(work / "bpe.json", docs)
    report: dict = {"text_mb": round(text_mb, 2), "prepare_mb_per_s": {}}
    for name, spec in (("byte", "byte"), ("bpe", str(work / "bpe.json"))):
        for workers in (1, 2):
            seconds = time_prepare(
                work / "corpus.parquet", work / f"{name}{workers}", spec, workers
            )
            report["prepare_mb_per_s"][f"{name}_workers{workers}"] = round(text_mb / seconds, 2)
    seconds = time_encode_batch(str(work / "bpe.json"), docs)
    report["tokenizers_encode_batch_mb_per_s"] = round(text_mb / seconds, 2)
    batches = 20 if args.small else 200
    one, mix = (
        str(work / "byte1"),
        f"{work / 'byte1'}:3:a,{work / 'byte2'}:2:b,{work / 'byte1'}:1:c",
    )
    loader = loader_tokens_per_sec(batches, path=one)  # document masks on: the default
    report["loader_tokens_per_s"] = round(loader)
    report["loader_tokens_per_s_without_masks"] = round(
        loader_tokens_per_sec(batches, path=one, document_mask=False)
    )
    mixture = loader_tokens_per_sec(batches, sources=mix)
    report["loader_tokens_per_s_3_source_mixture"] = round(mixture)
    run, source = run_tokens_per_sec(args.metrics, steps)
    report["default_run_tokens_per_s"] = None if run is None else round(run)
    report["default_run_source"] = source
    report["loader_over_run"] = None if run is None else round(loader / run, 1)
    report["mixture_over_run"] = None if run is None else round(mixture / run, 1)
    if not args.json:
        for key, value in report.items():
            print(f"{key}: {value}")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
