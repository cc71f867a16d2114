"""Small building blocks: RMSNorm, token embedding, rotary embedding, SwiGLU MLP."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from moe_jax.model import remat, rope
from moe_jax.model.axes import ones_param, param
from moe_jax.model.rope import RopeScaling
from moe_jax.parallel.layout import SINGLE_DEVICE, Layout


def cast_like(weights, x: jax.Array):
    """Weights (a tree, stored float32) cast to `x`'s dtype where `x` is computed on.

    Inside a layout's `shard_map`, a weight replicated over devices meets tokens that
    vary over them; JAX reduces the weight's gradient over those devices at the point
    where the two meet. Adding a zero taken from `x` before the cast moves that point
    before the cast, so the reduction runs on the float32 gradient, not a bfloat16 one.
    On one device, and in a float32 model, it changes nothing.
    """
    zero = jnp.zeros_like(x.reshape(-1)[0], dtype=jnp.float32)

    def cast(w: jax.Array) -> jax.Array:
        if w.dtype == x.dtype:  # nothing to cast: the reduction already runs as stored
            return w
        return (w + zero.astype(w.dtype)).astype(x.dtype)  # one fused pass with the cast

    return jax.tree.map(cast, weights)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """Root-mean-square norm over the trailing `scale.ndim` axes of `x`, in float32
    whatever the compute dtype (a [heads, head_dim] scale normalises whole projections)."""
    axes = tuple(range(-scale.ndim, 0))
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=axes, keepdims=True) + eps)
    return (x32 * scale).astype(x.dtype)


class RMSNorm(nnx.Module):
    """Root-mean-square norm with a learned scale over the trailing axes `names` name."""

    def __init__(self, dim: int | tuple[int, ...], eps: float, names=("embed",)):
        self.scale = ones_param((dim,) if isinstance(dim, int) else dim, names)
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.scale[...], self.eps)


class Embed(nnx.Module):
    """Token embedding; the output head reuses its table when tied
    (`Transformer.output_weights`)."""

    def __init__(
        self, vocab_size: int, dim: int, *, rngs: nnx.Rngs, layout: Layout = SINGLE_DEVICE
    ):
        self.table = param(rngs, (vocab_size, dim), ("vocab", "embed"), fan_in=1)
        self.layout = layout

    def __call__(self, tokens: jax.Array, dtype: jnp.dtype) -> jax.Array:
        return self.layout.embed(self.table[...], tokens).astype(dtype)


def rotary(
    x: jax.Array, positions: jax.Array, theta: float, scaling: RopeScaling | None = None
) -> jax.Array:
    """Rotary position embedding on [batch, seq, heads, head_dim] (half-split pairs),
    with the checkpoint's linear or YaRN `scaling` (`moe_jax.model.rope`) when given."""
    half = x.shape[-1] // 2
    if scaling is None or scaling.kind == "none":
        freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    else:
        freq = jnp.asarray(rope.inverse_frequencies(x.shape[-1], theta, scaling))
    angle = positions[..., None].astype(jnp.float32) * freq  # [batch, seq, half]
    sin, cos = jnp.sin(angle)[:, :, None, :], jnp.cos(angle)[:, :, None, :]
    factor = 1.0 if scaling is None else rope.cos_sin_factor(scaling)
    if factor != 1.0:
        sin, cos = sin * factor, cos * factor
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MLPWeights:
    gate: jax.Array  # [d, hidden]
    up: jax.Array  # [d, hidden]
    down: jax.Array  # [hidden, d]


MLP_AXES = MLPWeights(gate=("embed", "mlp"), up=("embed", "mlp"), down=("mlp", "embed"))


def mlp_block(x: jax.Array, w: MLPWeights) -> jax.Array:
    """SwiGLU on whatever hidden columns `w` holds (a layout may hand it a shard); the
    float32 weights are cast to the compute dtype here, inside the layout."""
    w = cast_like(w, x)
    gate, up = remat.tag((x @ w.gate, x @ w.up), remat.FC1_FC3)
    return remat.tag((jax.nn.silu(gate) * up) @ w.down, remat.FC2)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GatedMLPWeights:
    mlp: MLPWeights
    output_gate: jax.Array  # [d, 1]


GATED_MLP_AXES = GatedMLPWeights(mlp=MLP_AXES, output_gate=("embed", None))


def gated_mlp_block(x: jax.Array, w: GatedMLPWeights) -> jax.Array:
    """SwiGLU scaled per token by sigmoid(x @ output_gate) (Qwen2-MoE's shared expert).
    The scale is per token, so it commutes with a layout's partial sums over columns."""
    scale = jax.nn.sigmoid(x @ cast_like(w.output_gate, x))
    return scale * mlp_block(x, w.mlp)


class MLP(nnx.Module):
    """SwiGLU feed-forward: down(silu(x @ gate) * (x @ up)), optionally scaled per token
    by an output gate."""

    def __init__(
        self,
        dim: int,
        hidden: int,
        *,
        rngs: nnx.Rngs,
        layout: Layout = SINGLE_DEVICE,
        output_gate: bool = False,
    ):
        self.gate = param(rngs, (dim, hidden), MLP_AXES.gate)
        self.up = param(rngs, (dim, hidden), MLP_AXES.up)
        self.down = param(rngs, (hidden, dim), MLP_AXES.down)
        self.output_gate = (
            param(rngs, (dim, 1), GATED_MLP_AXES.output_gate) if output_gate else None
        )
        self.layout = layout

    def __call__(self, x: jax.Array) -> jax.Array:
        w = MLPWeights(*(p[...] for p in (self.gate, self.up, self.down)))
        if self.output_gate is None:
            return self.layout.mlp(mlp_block, x, w, MLP_AXES)
        gated = GatedMLPWeights(w, self.output_gate[...])
        return self.layout.mlp(gated_mlp_block, x, gated, GATED_MLP_AXES)
