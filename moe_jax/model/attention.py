"""Causal grouped-query attention with rotary embeddings."""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from moe_jax.config import ModelConfig
from moe_jax.kernels.attention import Attend, attention_fn
from moe_jax.model import remat
from moe_jax.model.axes import param
from moe_jax.model.layers import cast_like, rotary
from moe_jax.parallel.layout import SINGLE_DEVICE, Layout


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionWeights:
    query: jax.Array  # [d, h, head_dim]
    key: jax.Array  # [d, kv, head_dim]
    value: jax.Array  # [d, kv, head_dim]
    out: jax.Array  # [h, head_dim, d]


AXES = AttentionWeights(
    query=("embed", "heads", "head_dim"),
    key=("embed", "kv_heads", "head_dim"),
    value=("embed", "kv_heads", "head_dim"),
    out=("heads", "head_dim", "embed"),
)


def attention_block(
    x: jax.Array, positions: jax.Array, w: AttentionWeights, attend: Attend, *, theta: float
) -> jax.Array:
    """Project, rotate, `attend` ([b, s, heads, head_dim] q/k/v -> like q), project out.

    Works on whatever heads `w` holds, so a layout can hand it a head shard. Weights
    arrive as stored (float32) and are cast here, inside the layout, so that their
    gradients are reduced in float32.
    """
    w = cast_like(w, x)
    q = rotary(jnp.einsum("bsd,dhk->bshk", x, w.query), positions, theta)
    k = rotary(jnp.einsum("bsd,dhk->bshk", x, w.key), positions, theta)
    v = jnp.einsum("bsd,dhk->bshk", x, w.value)
    return jnp.einsum("bshk,hkd->bsd", attend(q, k, v), w.out)


class Attention(nnx.Module):
    """`num_heads` query heads share `num_kv_heads` key/value heads (GQA)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, layout: Layout = SINGLE_DEVICE):
        d, h, kv, hd = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.query = param(rngs, (d, h, hd), AXES.query)
        self.key = param(rngs, (d, kv, hd), AXES.key)
        self.value = param(rngs, (d, kv, hd), AXES.value)
        self.out = param(rngs, (h, hd, d), AXES.out, fan_in=h * hd)
        self.rope_theta = cfg.rope_theta
        self.attention_impl, self.dtype = cfg.attention_impl, cfg.dtype
        self.layout = layout

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        params = (self.query, self.key, self.value, self.out)
        w = AttentionWeights(*(p[...] for p in params))
        block = partial(attention_block, theta=self.rope_theta)
        # Chosen when traced, for the backend it is traced for (a config for another
        # platform can still be built and planned here).
        core = attention_fn(self.attention_impl, self.dtype)
        attend = lambda q, k, v: core(*remat.tag((q, k, v), remat.QKV))
        return self.layout.attention(block, x, positions, w, AXES, attend)
