"""`python -m moe_jax.data.prepare --input PATH --output DIR [--tokenizer byte|tokenizer.json]`.

Tokenises text once, ahead of training, into the memory-mapped token files
that `data.source='tokens'` reads; a tokenizer.json is copied in beside them, so the
corpus carries its tokenizer wherever it goes. Refuses (exit code 2, nothing written)
when the input is missing or the output already holds a prepared corpus; SIGINT or
SIGTERM removes what was written (exit code 130).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from moe_jax import paths, signals, workdir
from moe_jax.data.corpus import is_val
from moe_jax.data.token_files import (
    FORMAT,
    META,
    TOKENIZER_FILE,
    dtype_for,
    write_file,
    write_meta,
    write_split,
)
from moe_jax.data.tokenizer import HFTokenizer, Tokenizer, load_tokenizer

TEXT_SUFFIXES = (".txt", ".py", ".md")
SUFFIXES = (*TEXT_SUFFIXES, ".jsonl")


def _jsonl_documents(path: Path, text_key: str) -> Iterator[tuple[int, str]]:
    """(line index, text) for each non-blank line of a JSON-lines file."""
    with path.open(encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                raise ValueError(f"{path}:{lineno} is not valid JSON") from None
            text = record.get(text_key) if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise ValueError(f"{path}:{lineno} has no string field {text_key!r} (--text_key)")
            _check_unicode(text, f"{path}:{lineno}", text_key)
            yield lineno - 1, text


def _check_unicode(text: str, where: str, text_key: str) -> None:
    """A JSON escape can carry half of a UTF-16 pair (a lone surrogate), which is no
    character: no tokenizer can encode it, so it is named here with its place."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        char = ord(text[error.start])
        raise ValueError(
            f"{where}: field {text_key!r} holds a lone surrogate \\u{char:04x} at character "
            f"{error.start}, which is not text; fix or drop that line"
        ) from None


def documents(input_path: Path, text_key: str) -> Iterator[tuple[str, str]]:
    """(split key, text) of each document, in a fixed order; the key decides the split."""
    if input_path.is_dir():
        files = sorted(
            (p.relative_to(input_path).as_posix(), p)
            for p in input_path.rglob("*")
            if p.suffix in SUFFIXES and p.is_file()
        )
        if not files:
            raise ValueError(f"--input {input_path} holds no {'/'.join(SUFFIXES)} files")
        for rel, path in files:
            if path.suffix == ".jsonl":
                for index, text in _jsonl_documents(path, text_key):
                    yield f"{rel}:{index}", text
            else:
                yield rel, path.read_text(encoding="utf-8", errors="replace")
    elif input_path.suffix == ".jsonl":
        for index, text in _jsonl_documents(input_path, text_key):
            yield str(index), text
    elif input_path.suffix in TEXT_SUFFIXES:
        yield input_path.name, input_path.read_text(encoding="utf-8", errors="replace")
    else:
        raise ValueError(f"--input {input_path} is not a directory or a {'/'.join(SUFFIXES)} file")


def tokenize(
    docs: Iterator[tuple[str, str]], tokenizer: Tokenizer, val_fraction: float
) -> tuple[dict[str, np.ndarray], int, str]:
    """Token streams of both splits (each document followed by EOS) and a note on the split."""
    dtype = dtype_for(tokenizer.vocab_size)
    chunks: list[tuple[bool, np.ndarray]] = []
    eos = np.array([tokenizer.eos_id], dtype)
    batch: list[tuple[str, str]] = []

    def flush() -> None:
        encoded = tokenizer.encode_batch([text for _, text in batch])
        for (key, _), ids in zip(batch, encoded, strict=True):
            chunks.append((is_val(key, val_fraction), np.concatenate([ids.astype(dtype), eos])))
        batch.clear()

    for doc in docs:
        batch.append(doc)
        if len(batch) >= 1024:
            flush()
    flush()
    if not chunks:
        raise ValueError("--input has no documents")
    splits = {
        name: np.concatenate([c for v, c in chunks if v == want] or [np.zeros(0, dtype)])
        for name, want in (("train", False), ("val", True))
    }
    note = ""
    if not splits["train"].size or not splits["val"].size:
        # Too few documents to split by hash (one .txt file): hold out the tail instead.
        stream = np.concatenate([c for _, c in chunks])
        if stream.size < 2:
            raise ValueError(f"--input has {stream.size} tokens, too few for two splits")
        held = min(max(1, math.ceil(val_fraction * stream.size)), stream.size - 1)
        splits = {"train": stream[:-held], "val": stream[-held:]}
        note = f"; too few documents to split by hash, so val is the last {held} tokens"
    return splits, len(chunks), note


def _check_output(output: Path) -> None:
    paths.check_output_dir(output, "--output")
    if (output / META).exists():
        raise ValueError(
            f"--output {output} already holds a prepared corpus ({META}); choose a new directory"
        )


def _write(output: Path, splits: dict[str, np.ndarray], tokenizer: Tokenizer) -> dict:
    """The corpus files in `output` (created if absent); meta.json last. On any failure
    or interruption the files written so far (and `output`, if made here) are removed."""
    created = not output.exists()
    written: list[Path] = []
    try:
        output.mkdir(parents=True, exist_ok=True)
        for name, tokens in splits.items():
            written.append(output / f"{name}.bin")
            write_split(output, name, tokens)
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
            "splits": {
                name: {"num_tokens": int(t.size), "max_id": int(t.max()) if t.size else -1}
                for name, t in splits.items()
            },
        }
        written.append(output / META)
        write_meta(output, meta)
    except BaseException:
        for path in written:
            path.unlink(missing_ok=True)
        if created:
            shutil.rmtree(output, ignore_errors=True)
        raise
    return meta


def prepare(
    input_path: Path, output: Path, tokenizer_spec: str, val_fraction: float, text_key: str
) -> str:
    """Writes train.bin, val.bin, meta.json (and the tokenizer's tokenizer.json) under
    `output`; returns a summary line."""
    paths.check_input(input_path, "--input")
    if not 0 < val_fraction < 1:
        raise ValueError(f"--val_fraction={val_fraction} is invalid: must be in (0, 1)")
    if tokenizer_spec != "byte":
        if not os.path.exists(tokenizer_spec):
            raise ValueError(
                f"--tokenizer={tokenizer_spec} is neither 'byte' nor an existing tokenizer.json"
            )
        paths.check_input(tokenizer_spec, "--tokenizer", "file")
    _check_output(output)  # before tokenizing: a bad path costs nothing
    tokenizer = load_tokenizer(tokenizer_spec)
    splits, num_docs, note = tokenize(documents(input_path, text_key), tokenizer, val_fraction)
    workdir.check(output, "--output", sum(t.nbytes for t in splits.values()) + 2**20)
    meta = _write(output, splits, tokenizer)
    return (
        f"wrote {output}: {num_docs} documents, train {splits['train'].size} tokens, "
        f"val {splits['val'].size} tokens, tokenizer {tokenizer.name} "
        f"(vocab {tokenizer.vocab_size}, {meta['dtype']}){note}"
    )


@signals.interruptible("prepare")
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m moe_jax.data.prepare", description="Tokenise text into token files."
    )
    parser.add_argument("--input", required=True, type=Path, help=".txt, .jsonl or directory")
    parser.add_argument("--output", required=True, type=Path, help="new directory to write")
    parser.add_argument("--tokenizer", default="byte", help="'byte' or a tokenizer.json path")
    parser.add_argument("--val_fraction", type=float, default=0.05)
    parser.add_argument("--text_key", default="text", help="field of each .jsonl record")
    args = parser.parse_args(argv)
    try:
        summary = prepare(args.input, args.output, args.tokenizer, args.val_fraction, args.text_key)
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
