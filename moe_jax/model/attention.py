"""Causal grouped-query attention with rotary embeddings."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from moe_jax.config import ModelConfig
from moe_jax.kernels.attention import Attend, attention_fn
from moe_jax.model import remat
from moe_jax.model.axes import param, zeros_param
from moe_jax.model.layers import RMSNorm, cast_like, rms_norm, rotary
from moe_jax.model.rope import NO_SCALING, RopeScaling
from moe_jax.parallel import peaks
from moe_jax.parallel.layout import SINGLE_DEVICE, Layout


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionWeights:
    """The block's weights; the optional ones are None where the model has none."""

    query: jax.Array  # [d, h, head_dim]
    key: jax.Array  # [d, kv, head_dim]
    value: jax.Array  # [d, kv, head_dim]
    out: jax.Array  # [h, head_dim, d]
    query_bias: jax.Array | None = None  # [h, head_dim] (model.qkv_bias)
    key_bias: jax.Array | None = None  # [kv, head_dim]
    value_bias: jax.Array | None = None  # [kv, head_dim]
    # model.qk_norm scales: [head_dim] per head, or [h | kv, head_dim] per projection.
    query_norm: jax.Array | None = None
    key_norm: jax.Array | None = None

    @property
    def num_heads(self) -> int:
        """The query heads these weights hold (a layout may hand a block a shard)."""
        return self.query.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.key.shape[1]


AXES = AttentionWeights(
    query=("embed", "heads", "head_dim"),
    key=("embed", "kv_heads", "head_dim"),
    value=("embed", "kv_heads", "head_dim"),
    out=("heads", "head_dim", "embed"),
    query_bias=("heads", "head_dim"),
    key_bias=("kv_heads", "head_dim"),
    value_bias=("kv_heads", "head_dim"),
    query_norm=("heads", "head_dim"),
    key_norm=("kv_heads", "head_dim"),
)


def held_axes(w: AttentionWeights) -> AttentionWeights:
    """The logical axes of the weights `w` holds (None where it holds none): a norm
    scale of one axis is per head, over 'head_dim' only."""

    def names(field: dataclasses.Field):
        value, full = getattr(w, field.name), getattr(AXES, field.name)
        return None if value is None else full[len(full) - value.ndim :]

    return AttentionWeights(**{f.name: names(f) for f in dataclasses.fields(AttentionWeights)})


@dataclasses.dataclass(frozen=True)
class AttentionBlock:
    """Project, rotate, `attend` ([b, s, heads, head_dim] q/k/v -> like q), project out.

    Calling it runs the whole block; a layout that overlaps its exchanges with the
    projections (`parallel.collective_matmul`) runs the stages apart, on blocks of
    tokens or of heads. Every stage works on whatever heads `w` holds, so a layout can
    hand it a head shard (a per-projection qk norm needs all of them). Weights arrive
    as stored (float32) and are cast where they meet `x`, inside the layout, so that
    their gradients are reduced in float32.
    """

    theta: float
    eps: float = 1e-6  # of the query and key norms
    scaling: RopeScaling = NO_SCALING  # the checkpoint's rotary scaling (model.rope_*)

    def project(self, x: jax.Array, w: AttentionWeights) -> tuple[jax.Array, ...]:
        """q, k, v of the tokens of `x` (per token, so any block of tokens at a time):
        projection, bias, then the query and key norms."""
        w = cast_like(w, x)
        q, k, v = (jnp.einsum("bsd,dhk->bshk", x, p) for p in (w.query, w.key, w.value))
        if w.query_bias is not None:
            q, k, v = q + w.query_bias, k + w.key_bias, v + w.value_bias
        if w.query_norm is not None:
            q, k = rms_norm(q, w.query_norm, self.eps), rms_norm(k, w.key_norm, self.eps)
        return q, k, v

    def prepare(self, x: jax.Array, w: AttentionWeights) -> jax.Array:
        """The per-token work all heads share before their projections: none here (MLA's
        down-projections there; a layout projecting a head shard at a time runs it once)."""
        return x

    def project_heads(self, x: jax.Array, w: AttentionWeights) -> tuple[jax.Array, ...]:
        """q, k, v of the heads `w` holds from `prepare`'s output."""
        return self.project(x, w)

    def rotate(self, q: jax.Array, k: jax.Array, positions: jax.Array) -> tuple[jax.Array, ...]:
        turn = lambda x: rotary(x, positions, self.theta, self.scaling)
        return turn(q), turn(k)

    def out(self, o: jax.Array, w: AttentionWeights) -> jax.Array:
        """The output projection of the heads `w.out` holds (partial sums over heads)."""
        return jnp.einsum("bshk,hkd->bsd", o, cast_like(w.out, o))

    def __call__(
        self, x: jax.Array, positions: jax.Array, w: AttentionWeights, attend: Attend
    ) -> jax.Array:
        w = cast_like(w, x)
        q, k, v = self.project(x, w)
        q, k = self.rotate(q, k, positions)
        return self.out(attend(q, k, v, positions), w)


class Attention(nnx.Module):
    """`num_heads` query heads share `num_kv_heads` key/value heads (GQA)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, layout: Layout = SINGLE_DEVICE):
        d, h, kv, hd = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.query = param(rngs, (d, h, hd), AXES.query)
        self.key = param(rngs, (d, kv, hd), AXES.key)
        self.value = param(rngs, (d, kv, hd), AXES.value)
        self.out = param(rngs, (h, hd, d), AXES.out, fan_in=h * hd)
        bias = lambda heads, names: zeros_param((heads, hd), names)
        self.query_bias = bias(h, AXES.query_bias) if cfg.qkv_bias else None
        self.key_bias = bias(kv, AXES.key_bias) if cfg.qkv_bias else None
        self.value_bias = bias(kv, AXES.value_bias) if cfg.qkv_bias else None

        def norm(heads: int, names):  # over each head's [hd], or the projection's [heads, hd]
            if cfg.qk_norm == "head":
                return RMSNorm(hd, cfg.norm_eps, names[1:])
            return (
                RMSNorm((heads, hd), cfg.norm_eps, names) if cfg.qk_norm == "projection" else None
            )

        self.query_norm, self.key_norm = norm(h, AXES.query_norm), norm(kv, AXES.key_norm)
        self.rope_theta, self.norm_eps = cfg.rope_theta, cfg.norm_eps
        self.rope_scaling = RopeScaling.of(cfg)
        self.attention_impl, self.dtype = cfg.attention_impl, cfg.dtype
        self.layout = layout

    def weights(self) -> AttentionWeights:
        """The block's weights as stored (float32)."""
        value = lambda p: None if p is None else p[...]
        scale = lambda norm: None if norm is None else norm.scale[...]
        return AttentionWeights(
            *(p[...] for p in (self.query, self.key, self.value, self.out)),
            *(value(p) for p in (self.query_bias, self.key_bias, self.value_bias)),
            scale(self.query_norm),
            scale(self.key_norm),
        )

    def block(self) -> AttentionBlock:
        return AttentionBlock(self.rope_theta, self.norm_eps, self.rope_scaling)

    def __call__(self, x: jax.Array, positions: jax.Array):
        """The block's output; with `layout.track_peaks` (output, each head's peak logit)."""
        w, block = self.weights(), self.block()
        # Chosen when traced, for the backend it is traced for (a config for another
        # platform can still be built and planned here).
        layout = self.layout
        core = attention_fn(
            self.attention_impl,
            self.dtype,
            documents=layout.documents,
            peaks=layout.track_peaks,
        )
        return run_block(layout, block, x, positions, w, held_axes(w), core)


def run_block(layout: Layout, block, x, positions, w, axes, core, **core_args):
    """`block` run by `layout` with the attention function `core` (its keyword
    arguments `core_args`). With `layout.track_peaks` `core` also returns each head's
    peak logit, and so does this: (output, peaks [heads] over the whole batch)."""

    def attend(q, k, v, positions):
        masked = {"positions": positions} if layout.documents else {}
        out = core(*remat.tag((q, k, v), remat.QKV), **core_args, **masked)
        if layout.track_peaks:
            out, peak = out
            peaks.record(peak)
        return out

    if not layout.track_peaks:
        return layout.attention(block, x, positions, w, axes, attend)
    with peaks.recording() as seen:
        out = layout.attention(block, x, positions, w, axes, attend)
    return out, peaks.global_peaks(seen)
