"""`python -m moe_jax.data.prepare --input PATH --output DIR [--tokenizer byte|tokenizer.json]`.

Tokenises text once, ahead of training, into the memory-mapped token files
that `data.source='tokens'` reads; a tokenizer.json is copied in beside them, so the
corpus carries its tokenizer wherever it goes. Streams: documents are read in record
batches, tokenised in `--workers` processes and written as shards of at most
`--shard_tokens` tokens, so a corpus larger than memory works; meta.json, written
last and atomically, is what marks the output finished. Refuses (exit code 2, nothing
written) when the input is missing or the output already holds a prepared corpus or
the shards of an interrupted one (no resume: delete and rerun); SIGINT or SIGTERM
removes what was written (exit code 130).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import tqdm

from moe_jax import paths, signals, workdir
from moe_jax.data import encode, readers
from moe_jax.data.shards import ShardedTokens, ShardWriter
from moe_jax.data.token_files import (
    FORMAT,
    META,
    SPLITS,
    TOKENIZER_FILE,
    dtype_for,
    write_file,
    write_meta,
)
from moe_jax.data.tokenizer import HFTokenizer, Tokenizer, load_tokenizer

SHARD_TOKENS = 1 << 28  # tokens per shard: 512 MiB of uint16, 1 GiB of uint32
COPY_CHUNK = 1 << 24  # tokens copied at a time when the tail is held out


def _check_output(output: Path) -> None:
    """Refuses a finished corpus and the leftovers of an interrupted prepare (shards
    without meta.json: a SIGKILL or power cut; this prepare does not resume them)."""
    paths.check_output_dir(output, "--output")
    if (output / META).exists():
        raise ValueError(
            f"--output {output} already holds a prepared corpus ({META}); choose a new directory"
        )
    if output.is_dir():
        patterns = [*(f"{s}-*.bin" for s in SPLITS), ".stream"]
        left = sorted(p.name for pattern in patterns for p in output.glob(pattern))
        if left:
            raise ValueError(
                f"--output {output} holds {left[0]} but no {META}: an interrupted prepare; "
                "delete the directory and run prepare again"
            )


def _hold_out_tail(
    output: Path, writers: dict[str, ShardWriter], val_fraction: float, shard_tokens: int
) -> tuple[dict, str]:
    """Too few documents to split by hash (one .txt file): the whole stream is in one
    split; rewrites it as train = all but the last tokens, val = the last tokens."""
    full = next(name for name, w in writers.items() if w.num_tokens)
    entries = {name: w.close() for name, w in writers.items()}
    total = entries[full]["num_tokens"]
    if total < 2:
        raise ValueError(f"--input has {total} tokens, too few for two splits")
    held = min(max(1, math.ceil(val_fraction * total)), total - 1)
    staged = output / ".stream"
    staged.mkdir()
    for shard in entries[full]["shards"]:  # out of the way of the new shards' names
        os.replace(output / shard["file"], staged / shard["file"])
    dtype = writers[full].dtype
    files = [staged / shard["file"] for shard in entries[full]["shards"]]
    stream = ShardedTokens([np.memmap(f, dtype=dtype, mode="r") for f in files], files)
    try:
        for name, lo, hi in (("train", 0, total - held), ("val", total - held, total)):
            writer = ShardWriter(output, name, dtype.name, shard_tokens)
            writers[name] = writer
            for start in range(lo, hi, COPY_CHUNK):
                writer.write(np.asarray(stream[start : min(hi, start + COPY_CHUNK)]))
            entries[name] = writer.close()
    finally:
        del stream
        shutil.rmtree(staged)
    return entries, f"; too few documents to split by hash, so val is the last {held} tokens"


def _tokenize_into(
    output: Path, source, total_bytes: int, tokenizer: Tokenizer, spec: str, args
) -> tuple[dict, int, str]:
    """Streams the documents through the tokenizer into shard writers; returns the
    splits' meta.json entries, the number of documents and a note."""
    dtype = dtype_for(tokenizer.vocab_size)
    writers = {s: ShardWriter(output, s, dtype, args.shard_tokens) for s in SPLITS}
    num_docs = 0
    try:
        with tqdm.tqdm(
            total=total_bytes, unit="B", unit_scale=True, desc="prepare", delay=2,
            mininterval=1, file=sys.stderr, leave=False,
        ) as bar:  # fmt: skip
            for train, val, docs, used in encode.encoded_batches(
                source, spec, dtype, args.val_fraction, args.workers
            ):
                writers["train"].write(train)
                writers["val"].write(val)
                num_docs += docs
                bar.update(used)
        if not num_docs:
            raise ValueError("--input has no documents")
        note = ""
        if all(w.num_tokens for w in writers.values()):
            entries = {name: w.close() for name, w in writers.items()}
        else:
            entries, note = _hold_out_tail(output, writers, args.val_fraction, args.shard_tokens)
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    return entries, num_docs, note


def _write(output: Path, tokenizer: Tokenizer, entries: dict, written: list[Path]) -> dict:
    """The tokenizer copy and meta.json (last: its presence marks a finished corpus)."""
    spec = "byte"
    if isinstance(tokenizer, HFTokenizer):  # the tokenizer travels with its corpus
        written.append(output / TOKENIZER_FILE)
        write_file(output / TOKENIZER_FILE, Path(tokenizer.name).read_bytes())
        spec = TOKENIZER_FILE
    meta = {
        "format": FORMAT,
        "dtype": dtype_for(tokenizer.vocab_size),
        "vocab_size": tokenizer.vocab_size,
        "tokenizer": spec,
        "bos_id": tokenizer.bos_id,
        "eos_id": tokenizer.eos_id,
        "splits": entries,
    }
    written.append(output / META)
    write_meta(output, meta)
    return meta


def prepare(
    input_path: Path,
    output: Path,
    tokenizer_spec: str,
    val_fraction: float,
    text_key: str,
    workers: int = 1,
    shard_tokens: int = SHARD_TOKENS,
) -> str:
    """Writes the shards of train and val, meta.json (and the tokenizer's
    tokenizer.json) under `output`; returns a summary line. On any failure or
    interruption the files written so far (and `output`, if made here) are removed."""
    args = argparse.Namespace(
        val_fraction=val_fraction, text_key=text_key, workers=workers, shard_tokens=shard_tokens
    )
    paths.check_input(input_path, "--input")
    if not 0 < args.val_fraction < 1:
        raise ValueError(f"--val_fraction={args.val_fraction} is invalid: must be in (0, 1)")
    if args.workers < 1:
        raise ValueError(f"--workers={args.workers} is invalid: must be at least 1")
    if args.shard_tokens < 1:
        raise ValueError(f"--shard_tokens={args.shard_tokens} is invalid: must be at least 1")
    if tokenizer_spec != "byte":
        if not os.path.exists(tokenizer_spec):
            raise ValueError(
                f"--tokenizer={tokenizer_spec} is neither 'byte' nor an existing tokenizer.json"
            )
        paths.check_input(tokenizer_spec, "--tokenizer", "file")
    _check_output(output)  # before reading: a bad path costs nothing
    tokenizer = load_tokenizer(tokenizer_spec)
    spec = "byte" if tokenizer_spec == "byte" else tokenizer.name
    source, total_bytes = readers.open_input(input_path, args.text_key)
    # The size of the input: a guess at the output's (bytes or BPE tokens of 2 or 4 bytes).
    workdir.check(output, "--output", total_bytes + 2**20)
    created = not output.exists()
    written: list[Path] = []
    try:
        output.mkdir(parents=True, exist_ok=True)
        entries, num_docs, note = _tokenize_into(output, source, total_bytes, tokenizer, spec, args)
        meta = _write(output, tokenizer, entries, written)
    except BaseException:
        # _check_output saw no shards here, so every shard file present is this run's.
        shards = [p for s in SPLITS for p in output.glob(f"{s}-*.bin")]
        for path in [*written, *shards]:
            path.unlink(missing_ok=True)
        shutil.rmtree(output / ".stream", ignore_errors=True)
        if created:
            shutil.rmtree(output, ignore_errors=True)
        raise
    shards = sum(len(e["shards"]) for e in entries.values())
    return (
        f"wrote {output}: {num_docs} documents, train {entries['train']['num_tokens']} tokens, "
        f"val {entries['val']['num_tokens']} tokens in {shards} shards, tokenizer "
        f"{tokenizer.name} (vocab {tokenizer.vocab_size}, {meta['dtype']}){note}"
    )


@signals.interruptible("prepare")
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m moe_jax.data.prepare", description="Tokenise text into token files."
    )
    parser.add_argument(
        "--input",
        required=True,
        type=Path,
        help=".txt, .jsonl or .parquet file, a directory of them, or a saved datasets folder",
    )
    parser.add_argument("--output", required=True, type=Path, help="new directory to write")
    parser.add_argument("--tokenizer", default="byte", help="'byte' or a tokenizer.json path")
    parser.add_argument("--val_fraction", type=float, default=0.05)
    parser.add_argument("--text_key", default="text", help="field (.jsonl) or column (tables)")
    parser.add_argument("--workers", type=int, default=1, help="tokenising processes")
    parser.add_argument(
        "--shard_tokens", type=int, default=SHARD_TOKENS, help="tokens per output shard at most"
    )
    args = parser.parse_args(argv)
    try:
        summary = prepare(
            args.input,
            args.output,
            args.tokenizer,
            args.val_fraction,
            args.text_key,
            args.workers,
            args.shard_tokens,
        )
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # a file unreadable, the disk full, a path vanished meanwhile
        name = str(err.filename or args.output)
        writing = os.path.abspath(name).startswith(os.path.abspath(args.output))
        verb = "write" if writing else "read"
        print(f"error: cannot {verb} {name}: {err.strerror}", file=sys.stderr)
        return 2
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
