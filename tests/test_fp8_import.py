"""Block-scaled FP8 tensors read as their float32 values (`moe_jax.convert.fp8`), against
the values computed block by block in `tests.fp8_checkpoint`: blocks in both axes with
both edges cropped, a non-square block, one expert of a fused [E, rows, cols] tensor,
and every kind of scale (float32, bfloat16, uint8 and float8_e8m0fnu exponents). The
whole import of a quantised model is `tests/test_hf_convert.py`'s."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.flax import save_file

from moe_jax.convert.safetensors_files import SafetensorsDir
from tests.fp8_checkpoint import dequantised, quantise


@pytest.mark.parametrize("block", [(128, 128), (32, 48)])
def test_quantised_tensors_read_as_their_dequantised_values(tmp_path, block):
    rng = np.random.default_rng(0)
    shapes = {"flat": (300, 260), "fused": (2, 300, 260)}
    stored, want = {}, {}
    for name, shape in shapes.items():
        w = rng.normal(size=shape).astype(np.float32)
        for kind in ("f32", "bf16", "u8", "e8m0"):
            w8, scales = quantise(w, ue8m0=kind in ("u8", "e8m0"), block=block)
            if kind == "bf16":
                scales = scales.astype(ml_dtypes.bfloat16)
                want[f"{name}.{kind}"] = dequantised(w8, scales.astype(np.float32), block)
            else:
                want[f"{name}.{kind}"] = dequantised(w8, scales, block)
            if kind == "e8m0":
                scales = scales.view(ml_dtypes.float8_e8m0fnu)
            stored[f"{name}.{kind}"] = w8
            stored[f"{name}.{kind}_scale_inv"] = scales
    save_file({k: jnp.asarray(v) for k, v in stored.items()}, str(tmp_path / "m.safetensors"))
    tensors = SafetensorsDir(tmp_path, block)
    assert tensors.shapes == {name: w.shape for name, w in want.items()}  # scales hidden
    for name, values in want.items():
        if name.startswith("fused"):  # one expert's rows, as the fused layout is read
            np.testing.assert_array_equal(tensors.get(name)[1, :150], values[1, :150])
        else:
            np.testing.assert_array_equal(tensors.get(name)[...], values)
