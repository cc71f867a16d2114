"""The per-device attention function that `model.attention_impl` names.

Layouts decide where attention runs (which sequences and heads a device holds);
this decides how. Every implementation is causal grouped-query attention on
q [b, s, heads, head_dim] and k, v [b, s, kv_heads, head_dim]:

* `xla`: `jax.nn.dot_product_attention`'s XLA path; stores the [s, s] scores.
* `cudnn`: cuDNN's flash attention (GPU, bfloat16); stores no [s, s] scores.
* `blockwise`: `moe_jax.kernels.blockwise_attention`, plain JAX on any backend,
  stores no [s, s] scores.
* `auto`: cudnn on GPU in bfloat16, else blockwise.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from moe_jax.kernels.blockwise_attention import blockwise_attention
from moe_jax.kernels.requirements import attention_problems

Attend = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def xla_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")


def cudnn_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")


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


def attention_fn(impl: str, dtype: str, platform: str | None = None) -> Attend:
    """The attention function for `model.attention_impl=impl` and `model.dtype=dtype`,
    or a one-line ValueError (before anything is compiled) when it cannot run here."""
    platform = platform or jax.default_backend()
    found = attention_problems(impl, dtype, platform)
    if found:
        raise ValueError(found[0])
    return FUNCTIONS[resolve_impl(impl, dtype, platform)]
