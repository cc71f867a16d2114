"""Autoregressive decoding with a KV cache, through the model's own modules.

`forward` runs tokens [batch, s] that sit at positions index .. index + s - 1 (a whole
prompt, then one token at a time), writes their keys and values into the cache and
attends over everything cached so far. Norms, projections, rotary, MLPs and MoE
blocks are the model's; only the attention over the cache is written here. The model
is built with the single-device layout and its parameters may be placed in any plan's
shardings: XLA partitions the program from them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from moe_jax.model.attention import Attention
from moe_jax.model.transformer import Transformer

STACKS = ("dense", "moe")
# The cache: stack -> one (keys, values) pair per block of the stack's unit, each
# [units, batch, max_len, kv_heads, head_dim].
Cache = dict[str, list[tuple[jax.Array, jax.Array]]]


def empty_cache(model: Transformer, batch: int, max_len: int) -> Cache:
    m = model.cfg
    shape = (batch, max_len, m.num_kv_heads, m.head_dim)
    cache = {}
    for name in STACKS:
        stack = getattr(model, name)
        if stack is None:
            continue
        units = jax.tree.leaves(nnx.state(stack.units, nnx.Param))[0].shape[0]
        zeros = jnp.zeros((units, *shape), jnp.dtype(m.dtype))
        cache[name] = [(zeros, zeros) for _ in stack.units.blocks]
    return cache


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
    visible = jnp.arange(keys.shape[1])[None, :] <= positions[0][:, None]  # [q, k]
    probs = jax.nn.softmax(jnp.where(visible, scores, -jnp.inf), axis=-1)
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
                out, keys, values = _attend_cached(
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
