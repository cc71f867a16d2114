"""Ulysses sequence-parallel attention (the paper's SP; DeepSpeed-Ulysses).

Each device of the intra group holds s/n tokens of every sequence and the
whole attention weights. The QKV projection runs locally, an all-to-all turns
sequence shards into head shards, attention runs over full sequences for h/n
heads, a second all-to-all turns it back, and the output projection is local.

Grouped-query attention: each device needs the key/value heads of its query
heads. With kv heads K >= n (K divisible by n) they split like the query
heads. With K < n (n divisible by K) every kv head is repeated n/K times
before the exchange, so device i gets the one kv head its query heads use;
that sends n/K times the key/value bytes of an unrepeated exchange, i.e. the
kv part of the traffic is as large as with n kv heads.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from moe_jax.config_attention import head_widths
from moe_jax.model import remat
from moe_jax.model.layers import cast_like
from moe_jax.parallel import checks
from moe_jax.parallel import collective_matmul as cm
from moe_jax.parallel.fp8_exchange import token_collective, wire_bytes
from moe_jax.parallel.layout import DATA, INTRA, local_mlp, take_along
from moe_jax.parallel.scopes import TOKEN_EXCHANGE, chunk_scope
from moe_jax.parallel.spec import AttentionSpec, Sizes


def _seq_to_heads(x: jax.Array) -> jax.Array:
    return jax.lax.all_to_all(x, INTRA, split_axis=2, concat_axis=1, tiled=True)


def _heads_to_seq(x: jax.Array) -> jax.Array:
    return jax.lax.all_to_all(x, INTRA, split_axis=1, concat_axis=2, tiled=True)


def _heads_for(weights, axes, dest: jax.Array, n: int):
    """The query heads of device `dest` and the kv heads they use (repeated kv heads
    when there are fewer than n), with their biases and norm scales."""
    heads, kv = weights.num_heads, weights.num_kv_heads
    per, kv_per = heads // n, max(1, kv // n)
    kv_start = dest * kv_per if kv >= n else dest * kv // n
    weights = take_along(weights, axes, "heads", dest * per, per)
    return take_along(weights, axes, "kv_heads", kv_start, kv_per)


def _pairwise_attention(block, x, positions, whole, weights, axes, attend, n: int, wrap):
    """The block with each all-to-all as n-1 pairwise steps: device dest's QKV GEMM runs
    while the previous device's block travels, and each arriving output block's GEMM
    while the next one travels. `positions`: this device's tokens'; `whole`: the
    whole sequence's, which attention reads after the exchange."""
    weights = cast_like(weights, x)
    shared = block.prepare(x, weights)  # once, not per step (MLA's down-projections)

    def qkv_for(dest):  # one buffer per step: q, k and v side by side over heads
        q, k, v = block.project_heads(shared, _heads_for(weights, axes, dest, n))
        q, k = block.rotate(q, k, positions)
        if v.shape[-1] != q.shape[-1]:  # MLA's values are another width: their own buffer
            return jnp.concatenate((q, k), axis=2), v
        return jnp.concatenate((q, k, v), axis=2)

    got = cm.pairwise_all_to_all(qkv_for, n, wrap)
    sources = [source for source, _ in got]
    per = weights.num_heads // n
    if isinstance(got[0][1], tuple):
        qk, v = (cm.place([b[i] for _, b in got], sources, axis=1) for i in (0, 1))
        q, k = jnp.split(qk, (per,), axis=2)
    else:
        qkv = cm.place([b for _, b in got], sources, axis=1)
        q, k, v = jnp.split(qkv, (per, per + (qkv.shape[2] - per) // 2), axis=2)
    o = attend(q, k, v, whole)
    y = 0
    back = cm.pairwise_all_to_all(lambda dest: cm.block_of(o, dest, n, 1), n, wrap)
    for source, part in back:
        part = remat.tag(part, remat.ATTENTION_OUT)  # kept, not re-sent
        out = jax.lax.dynamic_slice_in_dim(weights.out, source * per, per, axis=0)
        y = y + block.out(part, dataclasses.replace(weights, out=out))
    return y


def ulysses_attention(layout, block, x, positions, weights, axes, attend):
    """x [b, s, d] with the sequence split over the intra group -> the same."""
    n = layout.size(INTRA)
    wrap = lambda move: token_collective(move, layout.token_dtype)
    to_heads, to_seq = wrap(_seq_to_heads), wrap(_heads_to_seq)

    def body(x, positions, weights):
        # Under a document mask the blocks are handed the whole sequence's positions
        # (`Layout.positions` gathers them once per step): this device's for rotary.
        whole = positions
        if layout.documents:
            s = x.shape[1]
            start = jax.lax.axis_index(INTRA) * s
            positions = jax.lax.dynamic_slice_in_dim(whole, start, s, axis=1)

        def exchange_and_attend(q, k, v, _):
            if k.shape[2] < n:
                k, v = (jnp.repeat(t, n // t.shape[2], axis=2) for t in (k, v))
            with jax.named_scope(TOKEN_EXCHANGE):
                q, k, v = to_heads(q), to_heads(k), to_heads(v)
            o = attend(q, k, v, whole)
            with jax.named_scope(TOKEN_EXCHANGE):
                return remat.tag(to_seq(o), remat.ATTENTION_OUT)  # kept, not re-sent

        if layout.collective_matmul:
            return _pairwise_attention(block, x, positions, whole, weights, axes, attend, n, wrap)
        return block(x, positions, weights, exchange_and_attend)

    chunks = layout.overlap_chunks
    if chunks > 1:  # independent sequences: chunk c+1's exchange beside chunk c's work
        one = body

        def body(x, positions, weights):
            outs = []
            pieces = zip(jnp.split(x, chunks), jnp.split(positions, chunks), strict=True)
            for c, (part, where) in enumerate(pieces):
                with jax.named_scope(chunk_scope(c)):
                    outs.append(one(part, where, weights))
            return jnp.concatenate(outs)

    spec = layout.activation_spec()
    where = P(spec[0], None) if layout.documents else P(*spec[:2])
    in_specs = (spec, where, layout.weight_specs(axes))
    return layout.block_map(body, in_specs, spec)(x, positions, weights)


def _problems(config) -> list[str]:
    n = config.parallel.intra
    what = f"parallel.intra={n} for parallel.attention='sp'"
    ring = n if config.parallel.collective_matmul else 1  # projects one head shard a step
    ring_what = f"{what} with parallel.collective_matmul"
    return checks.split_heads(config, n, what, splits_sequence=True) + checks.whole_projections(
        config, ring, ring_what
    )


def exchanged_bytes(config, s: Sizes) -> Fraction:
    """q, k, v to head shards and the output back: (n-1)/n of each device's
    [t, width] buffers, the kv heads repeated up to n (FP8 tokens: 1 byte an element
    plus a float32 scale per head and 128 channels). Under MLA every head has its own
    key and value: q and k are h·(qk_nope + qk_rope) wide, v and the output h·v_head_dim."""
    m = config.model
    if m.attention == "mla":
        qk, v = head_widths(m)
        token = config.parallel.token_dtype
        qk_bytes = 2 * m.num_heads * qk * wire_bytes(qk, token, s.B)
        return s.f * s.t * (qk_bytes + 2 * m.num_heads * v * wire_bytes(v, token, s.B))
    q_width = m.num_heads * m.head_dim
    kv_heads = m.num_kv_heads if m.num_kv_heads >= s.n else s.n
    element = wire_bytes(m.head_dim, config.parallel.token_dtype, s.B)
    return s.f * s.t * (2 * q_width + 2 * kv_heads * m.head_dim) * element


def paper_bytes(config, s: Sizes) -> Fraction:
    """The paper's Eq. 2, 2·b·s·h·(n-1)/n × (2 + 2/m)/n: twice the per-device bytes."""
    ratio = Fraction(config.model.num_heads, config.model.num_kv_heads)  # GQA ratio m
    return (4 + 4 / ratio) * s.T * s.h * s.f / s.n * s.B


SP = AttentionSpec(
    name="sp",
    attention=ulysses_attention,
    mlp=local_mlp,
    batch_axes=(DATA,),
    seq_axes=INTRA,
    problems=_problems,
    heads_split=True,
    chunks_batch=True,
    ring=True,
    compresses_tokens=True,
    mlp_in_shard_map=False,
    attention_bytes=exchanged_bytes,
    paper_bytes=paper_bytes,
    paper_equation="Eq. 2",
)
