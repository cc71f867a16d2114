"""Autoregressive decoding with a KV cache, through the model's own modules.

`forward` runs tokens [batch, s] that sit at positions index .. index + s - 1 (a whole
prompt, then one token at a time), writes their keys and values into the cache and
attends over everything cached so far. Norms, projections, rotary, MLPs and MoE
blocks are the model's; only the attention over the cache is written here. The model
is built with the single-device layout and its parameters may be placed in any plan's
shardings: XLA partitions the program from them.

Under MLA (`model.attention='mla'`) the cache holds each token's normed latent c_kv and
its rotated shared key k_pe (kv_lora + rope values a token, not heads x (qk + v)), and
attention over it runs absorbed: each head's query is taken into the latent space
through its slice of `kv_up`, scores are q_lat . c_kv + q_pe . k_pe, and the weighted
sum of latents leaves through the value slice of `kv_up` (DeepSeek-V2's inference form).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from moe_jax.model.attention import Attention
from moe_jax.model.layers import cast_like
from moe_jax.model.mla import MLAttention
from moe_jax.model.transformer import Transformer

STACKS = ("dense", "moe")
# The cache: stack -> one pair per block of the stack's unit: (keys, values), each
# [units, batch, max_len, kv_heads, head_dim]; under MLA (c_kv [units, batch, max_len,
# kv_lora_rank], k_pe [units, batch, max_len, qk_rope_head_dim]).
Cache = dict[str, list[tuple[jax.Array, jax.Array]]]


def cached_widths(m) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The trailing shapes of the cache's pair for each position: what one token keeps."""
    if m.attention == "mla":
        return (m.kv_lora_rank,), (m.qk_rope_head_dim,)
    return (m.num_kv_heads, m.head_dim), (m.num_kv_heads, m.head_dim)


def empty_cache(model: Transformer, batch: int, max_len: int) -> Cache:
    m = model.cfg
    cache = {}
    for name in STACKS:
        stack = getattr(model, name)
        if stack is None:
            continue
        units = jax.tree.leaves(nnx.state(stack.units, nnx.Param))[0].shape[0]
        pair = tuple(
            jnp.zeros((units, batch, max_len, *width), jnp.dtype(m.dtype))
            for width in cached_widths(m)
        )
        cache[name] = [pair for _ in stack.units.blocks]
    return cache


def _visible(scores: jax.Array, positions: jax.Array) -> jax.Array:
    """Softmax over the cached positions at or before each query's [.., q, k]."""
    visible = jnp.arange(scores.shape[-1])[None, :] <= positions[0][:, None]  # [q, k]
    return jax.nn.softmax(jnp.where(visible, scores, -jnp.inf), axis=-1)


def _attend_latent(attn: MLAttention, x, positions, latents, rope_keys, index):
    """MLA on `x` at `positions` over the cached latents with x's written at `index`,
    absorbed (no head's key or value is formed); returns (output, latents, rope keys)."""
    w, block = cast_like(attn.weights(), x), attn.block()
    q_nope, q_pe = jnp.split(block.query(x, w), (block.nope,), axis=-1)
    q_pe = block.rope_part(q_pe, positions)
    c_kv, k_pe = block.latents(x, w)
    k_pe = block.rope_part(k_pe[:, :, None, :], positions)[:, :, 0]
    write = lambda cache, new: jax.lax.dynamic_update_slice_in_dim(
        cache, new.astype(cache.dtype), index, axis=1
    )
    latents, rope_keys = write(latents, c_kv), write(rope_keys, k_pe)
    up_key, up_value = jnp.split(w.kv_up, (block.nope,), axis=-1)  # [r, h, nope], [r, h, v]
    q_latent = jnp.einsum("bqhn,rhn->bqhr", q_nope, up_key)
    scores = jnp.einsum("bqhr,bkr->bhqk", q_latent, latents, preferred_element_type=jnp.float32)
    scores += jnp.einsum("bqhp,bkp->bhqk", q_pe, rope_keys, preferred_element_type=jnp.float32)
    probs = _visible(scores * block.softmax_scale, positions)
    o_latent = jnp.einsum("bhqk,bkr->bqhr", probs.astype(latents.dtype), latents)
    out = jnp.einsum("bqhr,rhv->bqhv", o_latent, up_value)
    return block.out(out.astype(x.dtype), w), latents, rope_keys


def _attend_cached(attn: Attention, x, positions, keys, values, index):
    """The attention block on `x` at `positions`, over the cache with x's keys and
    values written at `index`; returns (output, keys, values)."""
    w, block = attn.weights(), attn.block()
    q, k, v = block.project(x, w)
    q, k = block.rotate(q, k, positions)
    keys = jax.lax.dynamic_update_slice_in_dim(keys, k.astype(keys.dtype), index, axis=1)
    values = jax.lax.dynamic_update_slice_in_dim(values, v.astype(values.dtype), index, axis=1)
    repeat = q.shape[2] // keys.shape[2]
    k_all, v_all = (jnp.repeat(t, repeat, axis=2) for t in (keys, values))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k_all, preferred_element_type=jnp.float32)
    scores = scores / jnp.sqrt(jnp.float32(q.shape[-1]))
    probs = _visible(scores, positions)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs.astype(v_all.dtype), v_all)
    return block.out(out.astype(x.dtype), w), keys, values


def forward(model: Transformer, tokens: jax.Array, cache: Cache, index) -> tuple:
    """(float32 logits [batch, s, vocab], the updated cache) for `tokens` at `index`."""
    dtype = jnp.dtype(model.cfg.dtype)
    positions = index + jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    x = model.embed(tokens, dtype)
    new_cache = {}
    for name in STACKS:
        stack = getattr(model, name)
        if stack is None:
            continue
        graphdef, params, rest = nnx.split(stack.units, nnx.Param, ...)

        def body(x, scanned, graphdef=graphdef):
            (params, rest), caches = scanned
            unit = nnx.merge(graphdef, params, rest)
            written = []
            for block, (keys, values) in zip(unit.blocks, caches, strict=True):
                attend = _attend_latent if isinstance(block.attn, MLAttention) else _attend_cached
                out, keys, values = attend(
                    block.attn, block.attn_norm(x), positions, keys, values, index
                )
                x = x + out
                ffn = block.ffn(block.ffn_norm(x))
                x = x + (ffn[0] if isinstance(ffn, tuple) else ffn)
                written.append((keys, values))
            return x, written

        x, new_cache[name] = jax.lax.scan(body, x, ((params, rest), cache[name]))
    x = model.final_norm(x)
    logits = jnp.einsum(
        "bsd,dv->bsv", x, model.output_weights(), preferred_element_type=jnp.float32
    )
    return logits, new_cache


def next_token(logits: jax.Array, key: jax.Array, temperature: float, top_p: float):
    """One token per row of `logits` [batch, vocab]: greedy at temperature 0, else
    sampled from the smallest set of tokens holding `top_p` of the probability."""
    if temperature == 0:
        return jnp.argmax(logits, axis=-1)
    logits = logits / temperature
    if top_p < 1:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of the tokens ranked above
        sorted_logits = jnp.where(before < top_p, sorted_logits, -jnp.inf)
        logits = (
            jnp.full_like(logits, -jnp.inf)
            .at[jnp.arange(logits.shape[0])[:, None], order]
            .set(sorted_logits)
        )
    return jax.random.categorical(key, logits, axis=-1)
