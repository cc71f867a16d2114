"""Reading the transformers side's reference cases (`transformers_side.py references`)."""

from __future__ import annotations

import numpy as np


def cases(npz) -> dict[str, dict[str, np.ndarray]]:
    """NAME -> {field: array} of a references file (keys `NAME/field`)."""
    out: dict[str, dict[str, np.ndarray]] = {}
    for key in npz.files:
        name, field = key.split("/")
        out.setdefault(name, {})[field] = npz[key]
    return out


def v3_choices_masking_with_zero(ref: dict, groups: int, kept: int, k: int) -> np.ndarray:
    """[T, k] sorted experts DeepSeek-V3's router would pick if it masked the dropped
    groups with 0 instead of -inf (the bug of older transformers, vLLM and SGLang)."""
    biased = 1 / (1 + np.exp(-ref["x"] @ ref["weight"].T)) + ref["bias"]
    grouped = biased.reshape(len(biased), groups, -1)
    best = np.argsort(-np.sort(grouped, -1)[..., -2:].sum(-1), -1)[:, :kept]
    dropped = np.ones(grouped.shape[:2], bool)
    np.put_along_axis(dropped, best, False, -1)
    zeroed = np.where(np.repeat(dropped, grouped.shape[-1], -1), 0.0, biased)
    return np.sort(np.argsort(-zeroed, -1)[:, :k], -1)
