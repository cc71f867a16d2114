"""The per-device attention function that `model.attention_impl` names.

Layouts decide where attention runs (which sequences and heads a device holds);
this decides how. Every implementation is causal grouped-query attention on
q [b, s, heads, head_dim] and k, v [b, s, kv_heads, head_dim], scaled by `scale`
(default 1/sqrt(head_dim)); v may be another width than q and k (MLA), which `xla`
and `cudnn` pad to the wider of the two (zeros change no score) and slice off after:

* `xla`: `jax.nn.dot_product_attention`'s XLA path; stores the [s, s] scores.
* `cudnn`: cuDNN's flash attention (GPU, bfloat16); stores no [s, s] scores.
* `blockwise`: `moe_jax.kernels.blockwise_attention`, plain JAX on any backend,
  stores no [s, s] scores.
* `auto`: cudnn on GPU in bfloat16, else blockwise.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from moe_jax.kernels.blockwise_attention import blockwise_attention
from moe_jax.kernels.requirements import attention_problems, cudnn_width_problems

Attend = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def _one_width(q, k, v, scale: float | None, implementation: str) -> jax.Array:
    """`jax.nn.dot_product_attention`, which needs one width for q, k and v: with v of
    another width, all three padded with zeros to the wider, the output sliced back."""
    if v.shape[-1] == q.shape[-1] and scale is None:
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    width = max(q.shape[-1], v.shape[-1])
    pad = lambda x: jnp.pad(x, [(0, 0)] * 3 + [(0, width - x.shape[-1])])
    out = jax.nn.dot_product_attention(
        pad(q), pad(k), pad(v), scale=scale, is_causal=True, implementation=implementation
    )
    return out[..., : v.shape[-1]]


def xla_attention(q, k, v, scale: float | None = None) -> jax.Array:
    return _one_width(q, k, v, scale, "xla")


def cudnn_attention(q, k, v, scale: float | None = None) -> jax.Array:
    return _one_width(q, k, v, scale, "cudnn")


FUNCTIONS: dict[str, Attend] = {
    "xla": xla_attention,
    "cudnn": cudnn_attention,
    "blockwise": blockwise_attention,
}


def resolve_impl(impl: str, dtype: str, platform: str | None = None) -> str:
    """The implementation `impl` names, `auto` chosen for `dtype` on `platform` (default:
    this process's backend)."""
    if impl != "auto":
        return impl
    platform = platform or jax.default_backend()
    return "cudnn" if platform == "gpu" and dtype == "bfloat16" else "blockwise"


def attention_fn(
    impl: str, dtype: str, platform: str | None = None, width: int | None = None
) -> Attend:
    """The attention function for `model.attention_impl=impl` and `model.dtype=dtype`,
    or a one-line ValueError (before anything is compiled) when it cannot run here.
    `width`: the head width the core pads to (MLA); `auto` takes blockwise where cuDNN
    cannot hold it."""
    platform = platform or jax.default_backend()
    found = attention_problems(impl, dtype, platform)
    if found:
        raise ValueError(found[0])
    chosen = resolve_impl(impl, dtype, platform)
    if chosen == "cudnn" and width is not None:
        found = cudnn_width_problems(width, f"heads {width} wide")
        if found and impl == "auto":
            return FUNCTIONS["blockwise"]
        if found:
            raise ValueError(found[0])
    return FUNCTIONS[chosen]
