"""Multi-head latent attention (MLA, DeepSeek-V2/V3): `model.attention='mla'`.

Each token is projected down to small latents, normed, and projected up per head:

* queries: x -> `query_down` [d, q_lora] -> RMSNorm -> `query_up` [q_lora, h, qk], or one
  `query` projection [d, h, qk] when `model.q_lora_rank=0` (DeepSeek-V2-Lite);
* keys and values: x -> `kv_down` [d, kv_lora + rope], whose first kv_lora columns are
  the latent c_kv (then RMSNorm) and whose last `qk_rope_head_dim` are one rotary key
  k_pe shared by every head; c_kv -> `kv_up` [kv_lora, h, nope + v], each head's
  [k_nope | v];
* q = [q_nope, rope(q_pe)], k = [k_nope, rope(k_pe)] (qk = nope + rope wide), v
  `v_head_dim` wide, and `out` [h, v, d] projects the heads back.

`MLABlock` has the stages of `AttentionBlock` (project, rotate, attend, out), so every
attention layout runs it unchanged: the down-projections carry no 'heads' axis, so a
layout that splits heads (tp, fsdp, sp's rings) keeps them whole and splits only the
up-projections and `out`. Decoding caches c_kv and the rotated k_pe, not the heads
(`moe_jax.model.decode`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from moe_jax.config import ModelConfig
from moe_jax.config_attention import mla_head_width
from moe_jax.kernels.attention import Attend, attention_fn
from moe_jax.model import remat, rope
from moe_jax.model.attention import run_block
from moe_jax.model.axes import param
from moe_jax.model.layers import RMSNorm, cast_like, rms_norm, rotary
from moe_jax.model.rope import NO_SCALING, RopeScaling
from moe_jax.parallel.layout import SINGLE_DEVICE, Layout


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MLAWeights:
    """The block's weights; the query path is `query`, or `query_down`, `query_norm` and
    `query_up` (the others None)."""

    kv_down: jax.Array  # [d, kv_lora + rope]: the latent, then the shared rotary key
    kv_norm: jax.Array  # [kv_lora]
    kv_up: jax.Array  # [kv_lora, h, nope + v]: each head's [k_nope | v]
    out: jax.Array  # [h, v, d]
    query: jax.Array | None = None  # [d, h, nope + rope] (model.q_lora_rank=0)
    query_down: jax.Array | None = None  # [d, q_lora]
    query_norm: jax.Array | None = None  # [q_lora]
    query_up: jax.Array | None = None  # [q_lora, h, nope + rope]

    @property
    def num_heads(self) -> int:
        """The heads these weights hold (a layout may hand a block a shard of them)."""
        return self.kv_up.shape[1]

    @property
    def num_kv_heads(self) -> int:  # every head has its own key and value
        return self.num_heads


AXES = MLAWeights(
    kv_down=("embed", "kv_latent"),
    kv_norm=("kv_lora",),
    kv_up=("kv_lora", "heads", "head_dim"),
    out=("heads", "head_dim", "embed"),
    query=("embed", "heads", "head_dim"),
    query_down=("embed", "q_lora"),
    query_norm=("q_lora",),
    query_up=("q_lora", "heads", "head_dim"),
)


def held_axes(w: MLAWeights) -> MLAWeights:
    """The logical axes of the weights `w` holds (None where it holds none)."""
    names = {f.name: getattr(AXES, f.name) for f in dataclasses.fields(MLAWeights)}
    return MLAWeights(**{k: None if getattr(w, k) is None else v for k, v in names.items()})


def softmax_scale(cfg: ModelConfig) -> float:
    """The one softmax scale of MLA's scores: 1/sqrt(qk_nope + qk_rope), the width the
    checkpoint's queries and keys have, times YaRN's mscale² where the rotary scaling
    sets it (`rope.softmax_multiplier`; DeepSeek-V3's is about 1.87)."""
    multiplier = rope.softmax_multiplier(RopeScaling.of(cfg))
    return (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5 * multiplier


@dataclasses.dataclass(frozen=True)
class MLABlock:
    """Project (down, norm, up per head), rotate the rotary parts, `attend`, project out:
    `AttentionBlock`'s stages, on whatever heads `w` holds."""

    theta: float
    nope: int  # qk_nope_head_dim
    rope: int  # qk_rope_head_dim
    softmax_scale: float
    eps: float = 1e-6  # of the latent norms
    scaling: RopeScaling = NO_SCALING  # the checkpoint's rotary scaling (model.rope_*)

    def query_input(self, x: jax.Array, w: MLAWeights) -> jax.Array:
        """What the per-head query projection reads: the normed query latent, or `x`."""
        if w.query is not None:
            return x
        latent = remat.tag(x @ w.query_down, remat.MLA_LATENT)
        return rms_norm(latent, w.query_norm, self.eps)

    def query(self, x: jax.Array, w: MLAWeights) -> jax.Array:
        """q [b, s, h, nope + rope] of the tokens of `x`, before rotary."""
        up = w.query if w.query is not None else w.query_up
        return jnp.einsum("bsr,rhk->bshk", self.query_input(x, w), up)

    def latents(self, x: jax.Array, w: MLAWeights) -> tuple[jax.Array, jax.Array]:
        """(normed c_kv [b, s, kv_lora], k_pe [b, s, rope] before rotary): what a token
        contributes to every head's key and value."""
        joint = remat.tag(x @ w.kv_down, remat.MLA_LATENT)
        c_kv, k_pe = jnp.split(joint, (joint.shape[-1] - self.rope,), axis=-1)
        return rms_norm(c_kv, w.kv_norm, self.eps), k_pe

    def expand(self, c_kv: jax.Array, k_pe: jax.Array, w: MLAWeights) -> tuple[jax.Array, ...]:
        """(k [b, s, h, nope + rope], v [b, s, h, v]) of the heads `w.kv_up` holds, the
        shared k_pe broadcast to each."""
        k_nope, v = jnp.split(jnp.einsum("bsr,rhk->bshk", c_kv, w.kv_up), (self.nope,), axis=-1)
        shared = jnp.broadcast_to(k_pe[:, :, None, :], (*k_nope.shape[:3], self.rope))
        return jnp.concatenate((k_nope, shared), axis=-1), v

    def prepare(self, x: jax.Array, w: MLAWeights) -> tuple[jax.Array, ...]:
        """The per-token work every head shares (down-projections and norms), so that a
        layout projecting one head shard at a time (sp's ring) runs it once."""
        w = cast_like(w, x)
        return (self.query_input(x, w), *self.latents(x, w))

    def project_heads(self, shared: tuple[jax.Array, ...], w: MLAWeights) -> tuple[jax.Array, ...]:
        """q, k, v of the heads `w` holds from `prepare`'s output (the up-projections)."""
        query_input, c_kv, k_pe = shared
        w = cast_like(w, c_kv)
        up = w.query if w.query is not None else w.query_up
        return (jnp.einsum("bsr,rhk->bshk", query_input, up), *self.expand(c_kv, k_pe, w))

    def project(self, x: jax.Array, w: MLAWeights) -> tuple[jax.Array, ...]:
        """q, k, v of the tokens of `x` (per token, so any block of tokens at a time)."""
        return self.project_heads(self.prepare(x, w), w)

    def rope_part(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """`x` [b, s, heads, ...] with rotary on its last `rope` channels only."""
        keep, turn = jnp.split(x, (x.shape[-1] - self.rope,), axis=-1)
        return jnp.concatenate((keep, rotary(turn, positions, self.theta, self.scaling)), axis=-1)

    def rotate(self, q: jax.Array, k: jax.Array, positions: jax.Array) -> tuple[jax.Array, ...]:
        return self.rope_part(q, positions), self.rope_part(k, positions)

    def out(self, o: jax.Array, w: MLAWeights) -> jax.Array:
        """The output projection of the heads `w.out` holds (partial sums over heads)."""
        return jnp.einsum("bshk,hkd->bsd", o, cast_like(w.out, o))

    def __call__(
        self, x: jax.Array, positions: jax.Array, w: MLAWeights, attend: Attend
    ) -> jax.Array:
        w = cast_like(w, x)
        q, k, v = self.project(x, w)
        q, k = self.rotate(q, k, positions)
        return self.out(attend(q, k, v, positions), w)


class MLAttention(nnx.Module):
    """Multi-head latent attention, run through the layout like `Attention`."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, layout: Layout = SINGLE_DEVICE):
        d, h = cfg.embed_dim, cfg.num_heads
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        r_q, r_kv = cfg.q_lora_rank, cfg.kv_lora_rank
        if r_q:
            self.query_down = param(rngs, (d, r_q), AXES.query_down)
            self.query_norm = RMSNorm(r_q, cfg.norm_eps, AXES.query_norm)
            self.query_up = param(rngs, (r_q, h, qk), AXES.query_up)
            self.query = None
        else:
            self.query = param(rngs, (d, h, qk), AXES.query)
            self.query_down = self.query_norm = self.query_up = None
        self.kv_down = param(rngs, (d, r_kv + cfg.qk_rope_head_dim), AXES.kv_down)
        self.kv_norm = RMSNorm(r_kv, cfg.norm_eps, AXES.kv_norm)
        self.kv_up = param(rngs, (r_kv, h, cfg.qk_nope_head_dim + cfg.v_head_dim), AXES.kv_up)
        self.out = param(rngs, (h, cfg.v_head_dim, d), AXES.out, fan_in=h * cfg.v_head_dim)
        self.cfg, self.layout = cfg, layout

    def weights(self) -> MLAWeights:
        """The block's weights as stored (float32)."""
        value = lambda p: None if p is None else p[...]
        return MLAWeights(
            kv_down=self.kv_down[...],
            kv_norm=self.kv_norm.scale[...],
            kv_up=self.kv_up[...],
            out=self.out[...],
            query=value(self.query),
            query_down=value(self.query_down),
            query_norm=None if self.query_norm is None else self.query_norm.scale[...],
            query_up=value(self.query_up),
        )

    def block(self) -> MLABlock:
        c = self.cfg
        return MLABlock(
            c.rope_theta,
            c.qk_nope_head_dim,
            c.qk_rope_head_dim,
            softmax_scale(c),
            c.norm_eps,
            RopeScaling.of(c),
        )

    def __call__(self, x: jax.Array, positions: jax.Array):
        """As `Attention`'s: the output, with `layout.track_peaks` also the peaks."""
        w, block = self.weights(), self.block()
        # Chosen when traced, for the backend it is traced for (see `Attention`).
        layout = self.layout
        core = attention_fn(
            self.cfg.attention_impl,
            self.cfg.dtype,
            width=mla_head_width(self.cfg),
            documents=layout.documents,
            peaks=layout.track_peaks,
        )
        axes = held_axes(w)
        return run_block(layout, block, x, positions, w, axes, core, scale=block.softmax_scale)
