"""Block-scaled FP8 checkpoints made in the tests, as DeepSeek's tools make them, and
their values computed block by block here, independently of `moe_jax.convert.fp8`:
each [128, 128] block (edges cropped) divided by max|block| / 448 and stored as
float8_e4m3fn beside a float32 `<name>_scale_inv`, or a "ue8m0" uint8 exponent
(scale 2^(s - 127), the power of two at or above max|block| / 448)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors.flax import save_file

BLOCK = (128, 128)
QUANTIZATION_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": list(BLOCK),
}
E4M3_MAX = 448.0


def _blocks(shape: tuple[int, ...], block=BLOCK):
    """(scale index, the weight's slices) of every block of the last two axes."""
    *lead, rows, cols = shape
    grid = (*lead, math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    for index in np.ndindex(*grid):
        *at, i, j = index
        rows_ = slice(i * block[0], (i + 1) * block[0])
        cols_ = slice(j * block[1], (j + 1) * block[1])
        yield index, (*at, rows_, cols_)


def quantise(w: np.ndarray, ue8m0: bool = False, block=BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """(float8_e4m3fn weight, its scales: float32, or uint8 exponents when `ue8m0`)."""
    *lead, rows, cols = w.shape
    grid = (*lead, math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    scales = np.zeros(grid, np.uint8 if ue8m0 else np.float32)
    out = np.zeros(w.shape, ml_dtypes.float8_e4m3fn)
    for index, part in _blocks(w.shape, block):
        scale = np.float32(np.abs(w[part]).max() / E4M3_MAX)
        if ue8m0:
            exponent = math.ceil(math.log2(scale))
            scales[index], scale = exponent + 127, np.float32(2.0**exponent)
        else:
            scales[index] = scale
        out[part] = (w[part] / scale).astype(ml_dtypes.float8_e4m3fn)
    return out, scales


def dequantised(w8: np.ndarray, scales: np.ndarray, block=BLOCK) -> np.ndarray:
    """float32 values of a quantised weight: each block's float8 values times its scale."""
    out = np.zeros(w8.shape, np.float32)
    for index, part in _blocks(w8.shape, block):
        s = scales[index]
        scale = np.float32(2.0 ** (int(s) - 127)) if scales.dtype == np.uint8 else s
        out[part] = w8[part].astype(np.float32) * scale
    return out


def write_quantised(
    source: dict[str, np.ndarray],
    hf_config: dict,
    out: Path,
    pick: Callable[[str], str | None],
) -> dict[str, np.ndarray]:
    """`source`'s tensors as an FP8 checkpoint in `out` (two shards and an index: the
    weights, then every scale), each tensor `pick` names 'f32' or 'ue8m0' quantised
    with scales of that kind; returns the float32 values it holds."""
    weights, scales, values = {}, {}, {}
    for name, w in source.items():
        kind = pick(name)
        if kind is None:
            weights[name] = values[name] = w
            continue
        weights[name], scales[name + "_scale_inv"] = quantise(w, ue8m0=kind == "ue8m0")
        values[name] = dequantised(weights[name], scales[name + "_scale_inv"])
    out.mkdir(parents=True)
    weight_map = {}
    for shard, tensors in (("model-00001-of-00002", weights), ("model-00002-of-00002", scales)):
        arrays = {k: jnp.asarray(v) for k, v in tensors.items()}
        save_file(arrays, str(out / f"{shard}.safetensors"), metadata={"format": "pt"})
        weight_map.update({k: f"{shard}.safetensors" for k in tensors})
    index = {"metadata": {}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    config = {**hf_config, "quantization_config": QUANTIZATION_CONFIG}
    (out / "config.json").write_text(json.dumps(config))
    return values
