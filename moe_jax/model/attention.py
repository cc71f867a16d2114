"""Causal grouped-query attention with rotary embeddings."""

from __future__ import annotations

import dataclasses

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


@dataclasses.dataclass(frozen=True)
class AttentionBlock:
    """Project, rotate, `attend` ([b, s, heads, head_dim] q/k/v -> like q), project out.

    Calling it runs the whole block; a layout that overlaps its exchanges with the
    projections (`parallel.collective_matmul`) runs the stages apart, on blocks of
    tokens or of heads. Every stage works on whatever heads `w` holds, so a layout can
    hand it a head shard. Weights arrive as stored (float32) and are cast where they
    meet `x`, inside the layout, so that their gradients are reduced in float32.
    """

    theta: float

    def project(self, x: jax.Array, w: AttentionWeights) -> tuple[jax.Array, ...]:
        """q, k, v of the tokens of `x` (per token, so any block of tokens at a time)."""
        w = cast_like(w, x)
        return tuple(jnp.einsum("bsd,dhk->bshk", x, p) for p in (w.query, w.key, w.value))

    def rotate(self, q: jax.Array, k: jax.Array, positions: jax.Array) -> tuple[jax.Array, ...]:
        return rotary(q, positions, self.theta), rotary(k, positions, self.theta)

    def out(self, o: jax.Array, w: AttentionWeights) -> jax.Array:
        """The output projection of the heads `w.out` holds (partial sums over heads)."""
        return jnp.einsum("bshk,hkd->bsd", o, cast_like(w.out, o))

    def __call__(
        self, x: jax.Array, positions: jax.Array, w: AttentionWeights, attend: Attend
    ) -> jax.Array:
        w = cast_like(w, x)
        q, k, v = self.project(x, w)
        q, k = self.rotate(q, k, positions)
        return self.out(attend(q, k, v), w)


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
        block = AttentionBlock(self.rope_theta)
        # Chosen when traced, for the backend it is traced for (a config for another
        # platform can still be built and planned here).
        core = attention_fn(self.attention_impl, self.dtype)
        attend = lambda q, k, v: core(*remat.tag((q, k, v), remat.QKV))
        return self.layout.attention(block, x, positions, w, AXES, attend)
