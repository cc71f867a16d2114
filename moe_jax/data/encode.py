"""Tokenising batches of documents, in this process or in `--workers` processes.

Why a bounded window of tasks rather than `Pool.imap`: imap's feeder thread reads
its whole input ahead, which would hold the corpus in memory; here at most
2 x workers batches are in flight and results come back in input order, so the
output is the same, byte for byte, with any number of workers.
"""

from __future__ import annotations

import collections
import multiprocessing
import signal
from collections.abc import Iterator

import numpy as np

from moe_jax.data.corpus import is_val
from moe_jax.data.readers import Document
from moe_jax.data.tokenizer import Tokenizer, load_tokenizer

BATCH_DOCS = 1024  # documents per task at most
BATCH_BYTES = 4 << 20  # characters of text per task at most

# One task's result: tokens for train and val (each document followed by EOS), the
# number of documents, and the input bytes the task accounts for (the progress bar's).
Encoded = tuple[np.ndarray, np.ndarray, int, int]

_worker: dict = {}


def encode(tokenizer: Tokenizer, dtype: str, val_fraction: float, docs: list) -> Encoded:
    """The train and val token streams of a batch of (key, text, input bytes)."""
    kept = [(key, text) for key, text, _ in docs if key is not None]
    ids = tokenizer.encode_batch([text for _, text in kept]) if kept else []
    eos = np.array([tokenizer.eos_id], dtype)
    parts: dict[bool, list[np.ndarray]] = {False: [], True: []}
    for (key, _), encoded in zip(kept, ids, strict=True):
        parts[is_val(key, val_fraction)] += [encoded.astype(dtype), eos]
    train, val = (np.concatenate(parts[v] or [np.zeros(0, dtype)]) for v in (False, True))
    return train, val, len(kept), sum(n for _, _, n in docs)


def _init(spec: str, dtype: str, val_fraction: float) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent reports the interruption
    _worker.update(tokenizer=load_tokenizer(spec), dtype=dtype, val_fraction=val_fraction)


def _encode_in_worker(docs: list) -> Encoded:
    return encode(_worker["tokenizer"], _worker["dtype"], _worker["val_fraction"], docs)


def batches(docs: Iterator[Document]) -> Iterator[list[Document]]:
    """Documents grouped into tasks of at most BATCH_DOCS documents or BATCH_BYTES."""
    batch: list[Document] = []
    size = 0
    for doc in docs:
        batch.append(doc)
        size += len(doc[1])
        if len(batch) >= BATCH_DOCS or size >= BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def encoded_batches(
    docs: Iterator[Document], spec: str, dtype: str, val_fraction: float, workers: int
) -> Iterator[Encoded]:
    """Each batch of `docs` encoded, in order; `workers` > 1 tokenises in that many
    spawned processes (spawned, not forked: the tokenizers library's thread pool does
    not survive a fork)."""
    if workers < 1:
        raise ValueError(f"--workers={workers} is invalid: must be at least 1")
    if workers == 1:
        tokenizer = load_tokenizer(spec)
        for batch in batches(docs):
            yield encode(tokenizer, dtype, val_fraction, batch)
        return
    context = multiprocessing.get_context("spawn")
    with context.Pool(workers, _init, (spec, dtype, val_fraction)) as pool:
        pending: collections.deque = collections.deque()
        for batch in batches(docs):
            pending.append(pool.apply_async(_encode_in_worker, (batch,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
