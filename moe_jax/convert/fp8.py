"""Block-scaled FP8 checkpoints, as DeepSeek-V3 ships them: a weight stored as
float8_e4m3fn beside a float32 `<name>_scale_inv` holding one scale per block of
`quantization_config.weight_block_size` (rows x columns, [128, 128] there), read as
float32 `f32(W8) * scale_inv[i // rows, j // cols]`. Edges that are not a multiple of
the block are padded for the scale and cropped (a [576, N] weight has 5 scale rows).

A tensor is quantised when it has a one-byte dtype and a `_scale_inv` sibling; the
rules are checked from the shard headers, before any tensor is read. Dequantising
happens as a tensor (or one expert of it) is read, so an import streams as it does
for float weights. moe_jax trains and exports float weights: nothing here writes FP8.
"""

from __future__ import annotations

import math
from typing import Any

import ml_dtypes
import numpy as np

SCALE_SUFFIX = "_scale_inv"
WEIGHT = "F8_E4M3"  # the safetensors dtype of a quantised weight
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
# "ue8m0" scales (U8, or F8_E8M0) are the exponent alone: 2^(s - 127), which is
# float8_e8m0fnu's value for the same byte.
E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
POWER_OF_TWO_SCALES = ("U8", "F8_E8M0")
SCALES = ("F32", "BF16", "F16", *POWER_OF_TWO_SCALES)
ONE_BYTE = ("U8", "I8", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ")
EXAMPLE = "{'quant_method': 'fp8', 'fmt': 'e4m3', 'weight_block_size': [128, 128]}"


def block_size(hf: dict[str, Any], where: str) -> tuple[int, int] | None:
    """The (rows, cols) block of a `config.json`'s FP8 `quantization_config`, None when
    it has none; one line for a quantisation moe_jax cannot read."""
    q = hf.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise ValueError(f"{where}: quantization_config={q!r} is not an object like {EXAMPLE}")
    method = q.get("quant_method")
    if method != "fp8":
        raise ValueError(
            f"{where}: quantization_config.quant_method={method!r} is not supported; "
            f"supported: 'fp8' (block-scaled float8_e4m3fn weights, {EXAMPLE})"
        )
    if q.get("fmt", "e4m3") != "e4m3":
        raise ValueError(
            f"{where}: quantization_config.fmt={q['fmt']!r} is not supported; supported: 'e4m3'"
        )
    size = q.get("weight_block_size")
    if not (
        isinstance(size, list) and len(size) == 2 and all(type(n) is int and n > 0 for n in size)
    ):
        raise ValueError(
            f"{where}: quantization_config.weight_block_size={size!r} is not supported; "
            "it must be two positive integers [rows, cols], e.g. [128, 128] (per-tensor "
            "and per-channel FP8 scales are not read)"
        )
    return size[0], size[1]


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """One scale per block of the last two axes, edges rounded up."""
    *lead, rows, cols = shape
    return (*lead, math.ceil(rows / block[0]), math.ceil(cols / block[1]))


def quantised(
    dtypes: dict[str, str],
    shapes: dict[str, tuple[int, ...]],
    block: tuple[int, int] | None,
    where: str,
) -> dict[str, str]:
    """Every quantised weight -> its scale tensor, from a checkpoint's header dtypes
    (safetensors codes) and shapes; one line for a one-byte tensor without its scales,
    scales on anything but float8_e4m3fn, quantised weights without a
    `quantization_config`, or a scale of the wrong shape or dtype."""
    out = {}
    for name, dtype in sorted(dtypes.items()):
        if name.endswith(SCALE_SUFFIX):
            continue  # read with its weight; one without a weight is left over
        scale = name + SCALE_SUFFIX
        if dtype not in ONE_BYTE:
            if scale in dtypes:
                raise ValueError(
                    f"{where}: tensor {name} is {dtype}, yet has block scales {scale}; "
                    f"only float8_e4m3fn ({WEIGHT}) weights are block-scaled"
                )
            continue
        if scale not in dtypes:
            raise ValueError(
                f"{where}: tensor {name} is {dtype} (one byte a value) and has no block "
                f"scales {scale}: an FP8 checkpoint needs every quantised weight's scales"
            )
        if dtype != WEIGHT:
            raise ValueError(
                f"{where}: tensor {name} is {dtype}; block-scaled weights must be "
                f"float8_e4m3fn ({WEIGHT})"
            )
        if block is None:
            raise ValueError(
                f"{where}: tensor {name} is float8_e4m3fn with block scales {scale}, but "
                f"config.json has no quantization_config (e.g. {EXAMPLE}) to say how "
                "the scales tile it"
            )
        shape = tuple(shapes[name])
        if len(shape) < 2:
            raise ValueError(f"{where}: tensor {name} is quantised but has shape {list(shape)}")
        want = scale_shape(shape, block)
        if tuple(shapes[scale]) != want:
            raise ValueError(
                f"{where}: tensor {scale} has shape {list(shapes[scale])}, expected "
                f"{list(want)}: one scale per {block[0]}x{block[1]} block "
                f"(quantization_config.weight_block_size) of {name} {list(shape)}"
            )
        if dtypes[scale] not in SCALES:
            raise ValueError(
                f"{where}: tensor {scale} is {dtypes[scale]}; block scales are one of "
                f"{list(SCALES)} (U8 and F8_E8M0 as 2^(s-127))"
            )
        out[name] = scale
    return out


def dequantise(weight: np.ndarray, scale: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """float32 `weight * scale` with each scale repeated over its block of the last two
    axes (cropped at the edges)."""
    rows, cols = weight.shape[-2:]
    per_row = np.repeat(np.asarray(scale, np.float32), block[0], axis=-2)[..., :rows, :]
    per_value = np.repeat(per_row, block[1], axis=-1)[..., :cols]
    return weight.astype(np.float32) * per_value


def _full_key(key, ndim: int) -> tuple:
    """An index as one entry per axis (no Ellipsis)."""
    key = key if isinstance(key, tuple) else (key,)
    if any(k is Ellipsis for k in key):
        at = next(i for i, k in enumerate(key) if k is Ellipsis)
        key = key[:at] + (slice(None),) * (ndim - len(key) + 1) + key[at + 1 :]
    return key + (slice(None),) * (ndim - len(key))


class Dequantised:
    """One quantised tensor; indexing reads the weight's and scales' entries of the
    leading axes it selects (one expert of a fused [E, ...] tensor), dequantises their
    whole blocks, then takes the rows and columns asked for, as float32 numpy."""

    def __init__(self, weight: np.ndarray, scale, block: tuple[int, int]):
        self._weight, self._scale, self._block = weight, scale, block

    def __getitem__(self, key) -> np.ndarray:
        key = _full_key(key, self._weight.ndim)
        lead = key[:-2] or Ellipsis
        weight = np.asarray(self._weight[lead])
        scale = np.asarray(self._scale[lead]).astype(np.float32)
        return dequantise(weight, scale, self._block)[(Ellipsis, *key[-2:])]
