"""Causal grouped-query attention with rotary embeddings."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from moe_jax.config import ModelConfig
from moe_jax.model.axes import constrain, param
from moe_jax.model.layers import rotary
from moe_jax.parallel.layout import SINGLE_DEVICE, Layout


class Attention(nnx.Module):
    """`num_heads` query heads share `num_kv_heads` key/value heads (GQA)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, layout: Layout = SINGLE_DEVICE):
        d, h, kv, hd = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.query = param(rngs, (d, h, hd), ("embed", "heads", "head_dim"))
        self.key = param(rngs, (d, kv, hd), ("embed", "kv_heads", "head_dim"))
        self.value = param(rngs, (d, kv, hd), ("embed", "kv_heads", "head_dim"))
        self.out = param(rngs, (h, hd, d), ("heads", "head_dim", "embed"), fan_in=h * hd)
        self.rope_theta = cfg.rope_theta
        self.layout = layout

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        dtype = x.dtype
        q = jnp.einsum("bsd,dhk->bshk", x, self.query[...].astype(dtype))
        k = jnp.einsum("bsd,dhk->bshk", x, self.key[...].astype(dtype))
        v = jnp.einsum("bsd,dhk->bshk", x, self.value[...].astype(dtype))
        q = constrain(rotary(q, positions, self.rope_theta), ("batch", "seq", "heads", None))
        k = constrain(rotary(k, positions, self.rope_theta), ("batch", "seq", "kv_heads", None))
        v = constrain(v, ("batch", "seq", "kv_heads", None))
        o = self.layout.attend(q, k, v)
        o = constrain(o, ("batch", "seq", "heads", None))
        return jnp.einsum("bshk,hkd->bsd", o, self.out[...].astype(dtype))
