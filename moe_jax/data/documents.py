"""Document masks of packed windows: segment ids, per-document positions, loss mask.

A window is seq_len + 1 consecutive tokens of a stream in which every document is
followed by one EOS (`prepare` and the embedded corpus both write it so). The rule:
EOS ends its document and is predicted from it; the token after an EOS starts the
next document and is never a target predicted from the previous one. The first
token of a window starts a document too (its earlier part lies outside the window),
so positions restart at 0 there and after every EOS of the inputs.
"""

from __future__ import annotations

import numpy as np

from moe_jax.config import DataConfig

FIELDS = ("segment_ids", "positions", "loss_mask")


def masked(data_cfg: DataConfig) -> bool:
    """Whether batches carry document fields: data.document_mask on a source that has
    documents (the synthetic stream has none: the setting does nothing there)."""
    return data_cfg.document_mask and data_cfg.source != "synthetic"


def batch_keys(data_cfg: DataConfig) -> tuple[str, ...]:
    """The int32 [B, S] arrays of a batch the loader gives under `data_cfg`: what a step
    compiled from abstract inputs must take to be the trainer's step."""
    return ("inputs", "targets", *(FIELDS if masked(data_cfg) else ()))


def document_fields(inputs: np.ndarray, eos_id: int) -> dict[str, np.ndarray]:
    """For inputs [B, S]: 'segment_ids' (1, 2, ... per document of each row),
    'positions' (0 at each document's first token) and 'loss_mask' (1 where the
    target, the next token, lies in the same document as its input: the input is
    not an EOS), all int32 [B, S]."""
    inputs = np.asarray(inputs)
    b, s = inputs.shape
    starts = np.zeros((b, s), bool)
    starts[:, 0] = True
    starts[:, 1:] = inputs[:, :-1] == eos_id
    index = np.broadcast_to(np.arange(s, dtype=np.int32), (b, s))
    first = np.maximum.accumulate(np.where(starts, index, 0), axis=1)
    return {
        "segment_ids": np.cumsum(starts, axis=1, dtype=np.int32),
        "positions": (index - first).astype(np.int32),
        "loss_mask": (inputs != eos_id).astype(np.int32),
    }
