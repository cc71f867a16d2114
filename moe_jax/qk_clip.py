"""QK-clip (Kimi-K2's MuonClip, `train.qk_clip`): after each update, every attention
head whose peak pre-softmax logit in the step's forward passed the threshold τ has its
query and key weights rescaled, so that the same tokens' logits of that head would
peak at τ exactly, and every other head's are unchanged.

Why after the update and on the weights: the logits are bilinear in the query and key
projections, so a head scaled by γ = τ / peak scales its logits by γ without touching
the loss's gradient (Kimi-K2 report, section 2.1). Per head h with kv head g:

* grouped-query attention: the key of g is scaled by sqrt(γ_min) (γ_min the smallest
  γ of g's query heads), the query of h by γ_h / sqrt(γ_min): head h's logits scale by
  γ_h (with one query head per kv head: sqrt(γ) each, Kimi's α = 1/2). A projection
  query/key norm (`model.qk_norm=projection`) is scaled instead of the weights it
  normalises; biases with their weights.
* MLA: the per-head no-rope parts of the query and key (`query` or `query_up`, and the
  key's part of `kv_up`) by sqrt(γ), the query's rotary part by γ; the rotary key is
  shared by every head and stays.

The float32 master weights are the only copy, so the clip is exact.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from moe_jax.config import ModelConfig

GQA_QUERY = ("query", "query_bias", "query_norm")
GQA_KEY = ("key", "key_bias", "key_norm")
MLA_QUERY = ("query", "query_up")


def factors(peaks: jax.Array, tau: float) -> jax.Array:
    """γ = min(1, τ / peak) per head (float32)."""
    return jnp.minimum(1.0, tau / jnp.maximum(peaks, 1e-30)).astype(jnp.float32)


def _along_heads(scale: jax.Array, leaf: jax.Array) -> jax.Array:
    """[units, heads] factors shaped to multiply `leaf` [units, ..., heads, width], its
    units held as one axis or, by a pipeline with repeats, as [repeats, units / repeats]
    (a reshape of the canonical order, `pipeline.canonical`)."""
    units, heads = scale.shape
    lead = next(k for k in range(1, leaf.ndim) if math.prod(leaf.shape[:k]) == units)
    return scale.reshape(*leaf.shape[:lead], *([1] * (leaf.ndim - lead - 2)), heads, 1)


def _gqa(name: str, leaf: jax.Array, gamma: jax.Array, cfg: ModelConfig) -> jax.Array:
    group = cfg.num_heads // cfg.num_kv_heads
    lowest = gamma.reshape(*gamma.shape[:-1], cfg.num_kv_heads, group).min(-1)  # [U, kv]
    normed = cfg.qk_norm == "projection"  # the norm scales are scaled, not the weights
    if name in GQA_QUERY and normed == (name == "query_norm"):
        query = gamma / jnp.repeat(jnp.sqrt(lowest), group, axis=-1)
        return leaf * _along_heads(query, leaf)
    if name in GQA_KEY and normed == (name == "key_norm"):
        return leaf * _along_heads(jnp.sqrt(lowest), leaf)
    return leaf


def _mla(name: str, leaf: jax.Array, gamma: jax.Array, cfg: ModelConfig) -> jax.Array:
    nope = cfg.qk_nope_head_dim
    half = _along_heads(jnp.sqrt(gamma), leaf)
    if name in MLA_QUERY:
        return jnp.concatenate(
            (leaf[..., :nope] * half, leaf[..., nope:] * _along_heads(gamma, leaf)), -1
        )
    if name == "kv_up":
        return jnp.concatenate((leaf[..., :nope] * half, leaf[..., nope:]), -1)
    return leaf


def clipped(params, peaks: dict, tau: float, cfg: ModelConfig):
    """`params` with each stack's attention rescaled by its `peaks` ({stack name:
    [units, blocks, heads]}, `Transformer.features`; the MTP modules' 'mtp': [depths,
    heads], `mtp.merged`)."""
    rescale = _mla if cfg.attention == "mla" else _gqa

    def clip(path, leaf):
        keys = [getattr(p, "key", getattr(p, "idx", None)) for p in path]
        if len(keys) < 6 or keys[0] not in peaks or keys[4] != "attn":
            return leaf
        name = keys[5]
        if keys[0] == "mtp":  # ['mtp']['layers'][k]['block']: depth k's block, no stack axis
            gamma = factors(peaks["mtp"][keys[2]], tau)[None]
            return rescale(name, leaf[None], gamma, cfg)[0].astype(leaf.dtype)
        gamma = factors(peaks[keys[0]][:, keys[3]], tau)  # ['units']['blocks'][b]
        return rescale(name, leaf, gamma, cfg).astype(leaf.dtype)

    return jax.tree_util.tree_map_with_path(clip, params)


def peak_of(peaks: dict) -> jax.Array:
    """The largest logit of every head of every layer (the `max_attn_logit` metric)."""
    return jnp.max(jnp.stack([p.max() for p in peaks.values()]))
