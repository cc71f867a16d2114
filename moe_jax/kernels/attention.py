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

With `positions` [b, s] (each token's position in its document, 0 at a document's
first token) attention stays within each document: key j is visible from query i
when i - positions[i] <= j <= i (`document_mask`). cuDNN's attention in this jax
takes no segment ids, so `cudnn` refuses them (config validation says so first).

With `peaks` each function also returns every query head's largest visible scaled
score (the pre-softmax logit QK-clip bounds, `moe_jax.qk_clip`): `blockwise` keeps its
online softmax's running maxima; `xla` and `cudnn`, whose kernels return none, run a
forward-only blockwise pass over the scores (`peak_logits`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from moe_jax.kernels.blockwise_attention import (
    blockwise_attention,
    blockwise_attention_peaks,
    peak_logits,
)
from moe_jax.kernels.requirements import attention_problems, cudnn_width_problems

# attend(q, k, v, positions): positions [b, s] of the whole sequences q and k hold
# (a layout that splits the sequence hands the gathered ones); the model's `attend`
# passes them to the core only under a document mask.
Attend = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]
CUDNN_NO_DOCUMENTS = (
    "model.attention_impl='cudnn' cannot mask documents (this jax's cuDNN attention takes "
    "no segment ids): set model.attention_impl=blockwise or xla, or data.document_mask=false"
)


def document_mask(positions: jax.Array) -> jax.Array:
    """[b, 1, s, s] bool: key j visible from query i within i's document, causally."""
    s = positions.shape[-1]
    rows, cols = jnp.arange(s)[:, None], jnp.arange(s)[None, :]
    first = rows - positions[:, :, None]  # [b, s, 1]: the first index of i's document
    return ((cols <= rows) & (cols >= first))[:, None]


def _one_width(q, k, v, scale, implementation: str, positions=None) -> jax.Array:
    """`jax.nn.dot_product_attention`, which needs one width for q, k and v: with v of
    another width, all three padded with zeros to the wider, the output sliced back."""
    mask = None if positions is None else document_mask(positions)
    if v.shape[-1] == q.shape[-1] and scale is None:
        return jax.nn.dot_product_attention(
            q, k, v, mask=mask, is_causal=True, implementation=implementation
        )
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    width = max(q.shape[-1], v.shape[-1])
    pad = lambda x: jnp.pad(x, [(0, 0)] * 3 + [(0, width - x.shape[-1])])
    out = jax.nn.dot_product_attention(
        pad(q),
        pad(k),
        pad(v),
        mask=mask,
        scale=scale,
        is_causal=True,
        implementation=implementation,
    )
    return out[..., : v.shape[-1]]


def xla_attention(q, k, v, scale: float | None = None, positions=None) -> jax.Array:
    return _one_width(q, k, v, scale, "xla", positions)


def cudnn_attention(q, k, v, scale: float | None = None, positions=None) -> jax.Array:
    if positions is not None:
        raise ValueError(CUDNN_NO_DOCUMENTS)
    return _one_width(q, k, v, scale, "cudnn")


FUNCTIONS: dict[str, Attend] = {
    "xla": xla_attention,
    "cudnn": cudnn_attention,
    "blockwise": blockwise_attention,
}


def resolve_impl(
    impl: str, dtype: str, platform: str | None = None, documents: bool = False
) -> str:
    """The implementation `impl` names, `auto` chosen for `dtype` on `platform` (default:
    this process's backend) and whether documents are masked (cuDNN cannot)."""
    if impl != "auto":
        return impl
    platform = platform or jax.default_backend()
    cudnn = platform == "gpu" and dtype == "bfloat16" and not documents
    return "cudnn" if cudnn else "blockwise"


def attention_fn(
    impl: str,
    dtype: str,
    platform: str | None = None,
    width: int | None = None,
    documents: bool = False,
    peaks: bool = False,
) -> Callable[..., jax.Array]:
    """The attention function for `model.attention_impl=impl` and `model.dtype=dtype`,
    or a one-line ValueError (before anything is compiled) when it cannot run here.
    `width`: the head width the core pads to (MLA); `auto` takes blockwise where cuDNN
    cannot hold it. `peaks`: it returns (output, each head's peak logit)."""
    platform = platform or jax.default_backend()
    found = attention_problems(impl, dtype, platform)
    if found:
        raise ValueError(found[0])
    chosen = resolve_impl(impl, dtype, platform, documents)
    if chosen == "cudnn" and documents:
        raise ValueError(CUDNN_NO_DOCUMENTS)
    if chosen == "cudnn" and width is not None:
        found = cudnn_width_problems(width, f"heads {width} wide")
        if found and impl != "auto":
            raise ValueError(found[0])
        chosen = "blockwise" if found else chosen
    if not peaks:
        return FUNCTIONS[chosen]
    if chosen == "blockwise":
        return blockwise_attention_peaks
    core = FUNCTIONS[chosen]

    def with_peaks(q, k, v, scale=None, positions=None):
        return core(q, k, v, scale, positions), peak_logits(q, k, scale, positions)

    return with_peaks
