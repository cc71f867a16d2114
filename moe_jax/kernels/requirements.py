"""What the kernels that settings name need, checked without importing them.

The kernels import jax; `moe_jax.config` checks `model.attention_impl` and
`moe.impl=tokamax` from these plain-Python rules, so a bad setting is refused
before jax is imported. `tests/test_imports.py` keeps the names here equal to the
kernels' own tables.
"""

from __future__ import annotations

import importlib.util

# `model.attention_impl`: auto, then the functions of `moe_jax.kernels.attention`.
ATTENTION_IMPLS = ("auto", "xla", "cudnn", "blockwise")

TOKAMAX_INSTALL = "pip install tokamax==0.0.17"
TOKAMAX_MISSING = (
    f"moe.impl='tokamax' is invalid: the optional tokamax package does not import here; "
    f"{TOKAMAX_INSTALL}, or use 'auto', 'ragged_dot' or 'pallas'"
)


def attention_problems(impl: str, dtype: str, platform: str | None = None) -> list[str]:
    """Why `model.attention_impl=impl` cannot run in `dtype` (model.dtype) on `platform`
    ('cpu', 'gpu', 'tpu'; None skips the platform check), as one-line messages."""
    setting = f"model.attention_impl={impl!r} is invalid"
    if impl not in ATTENTION_IMPLS:
        return [f"{setting}: valid: {ATTENTION_IMPLS}"]
    if impl == "cudnn" and dtype != "bfloat16":
        return [
            f"{setting}: 'cudnn' needs model.dtype='bfloat16', not {dtype!r}; "
            "use 'blockwise', 'xla' or 'auto'"
        ]
    if impl == "cudnn" and platform not in (None, "gpu"):
        return [
            f"{setting}: 'cudnn' runs on GPU only, not {platform}; use 'blockwise', 'xla' or 'auto'"
        ]
    return []


# cuDNN's flash attention: head widths a multiple of 8, at most 256 (Hopper or later; 128
# before). jax.nn.dot_product_attention also wants one width for q, k and v, so MLA pads
# all three to the wider of its qk and v widths (`moe_jax.kernels.attention`).
CUDNN_MAX_HEAD_WIDTH = 256
CUDNN_HEAD_WIDTH_MULTIPLE = 8


def cudnn_width_problems(width: int, setting: str) -> list[str]:
    """Why cuDNN cannot attend over heads `width` wide (`setting` names where it comes
    from), as one-line messages."""
    if width <= CUDNN_MAX_HEAD_WIDTH and width % CUDNN_HEAD_WIDTH_MULTIPLE == 0:
        return []
    return [
        f"model.attention_impl='cudnn' is invalid for {setting}: cuDNN's flash attention takes "
        f"head widths that are a multiple of {CUDNN_HEAD_WIDTH_MULTIPLE} and at most "
        f"{CUDNN_MAX_HEAD_WIDTH} (128 before Hopper); use 'blockwise' or 'xla'"
    ]


def tokamax_installed() -> bool:
    """Whether the optional tokamax package is installed (found, not imported: it
    imports jax). `moe_jax.kernels.tokamax_gmm.missing` imports it, with the plan."""
    return importlib.util.find_spec("tokamax") is not None
