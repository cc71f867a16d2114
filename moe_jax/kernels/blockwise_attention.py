"""Causal grouped-query attention in blocks, never holding the [s, s] scores.

Why: XLA's `jax.nn.dot_product_attention` builds the [b, h, s, s] scores and
keeps the float32 softmax for the backward, so attention memory grows with s².
Here the sequence is cut into blocks of `block_size(s)` positions. The forward
walks the query blocks and, for each, only the key blocks at or below the
causal diagonal (blocks above it are never computed), with an online softmax
(FlashAttention): it keeps the output and each row's logsumexp. The backward
(FlashAttention-2) walks the key blocks and, for each, the query blocks at or
below the diagonal, recomputing each block's probabilities from q, k and the
logsumexp. What is stored grows linearly with s; one block's scores
[b, c, heads, c] are the largest temporary.

Shapes are [b, s, heads, head_dim] for q and [b, s, kv_heads, head_dim] for k
and v (v may be narrower or wider than q and k, as in MLA); query heads are grouped
by the kv head they share, so k and v are never repeated. Scores are scaled by
`scale` (default 1/sqrt(head_dim), else the model's, e.g. MLA's with YaRN).
Softmax statistics and accumulators are float32 whatever the input
dtype; outputs and gradients come back in the inputs' dtypes.

With `positions` [b, s] (0 at each document's first token) query i sees keys
i - positions[i] .. i only, and the loops skip the key blocks that hold none of
a query block's documents (`block_ranges`): a window of many short documents
visits about s·(document length)/c² blocks instead of (s/c)²/2.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from moe_jax.kernels.varying import varying_zeros

MAX_BLOCK = 512  # positions per block at most (see block_size)
# The name of the output and logsumexp the backward reads, so that a remat policy can
# keep them (`moe_jax.model.remat`) instead of re-running the forward.
RESIDUALS = "attention_core"
F32 = jnp.float32


def block_size(s: int) -> int:
    """The largest divisor of `s` up to MAX_BLOCK, so that blocks tile the sequence
    exactly (a sequence with no large divisor runs in small, slower blocks)."""
    return next(c for c in range(min(s, MAX_BLOCK), 0, -1) if s % c == 0)


def _zeros(shape: tuple[int, ...], *like: jax.Array) -> jax.Array:
    return varying_zeros(shape, F32, *like)


def _block(x: jax.Array, index: jax.Array, c: int) -> jax.Array:
    """Positions [index·c, (index+1)·c) of x [b, s, ...]."""
    return jax.lax.dynamic_slice_in_dim(x, index * c, c, axis=1)


def _put(x: jax.Array, block: jax.Array, index: jax.Array, c: int) -> jax.Array:
    return jax.lax.dynamic_update_slice_in_dim(x, block.astype(x.dtype), index * c, axis=1)


def _dot(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """einsum in b's dtype (a float32 block cast down, as flash attention multiplies in
    the inputs' precision), accumulated in float32."""
    return jnp.einsum(spec, a.astype(b.dtype), b, preferred_element_type=F32)


def _scaled(x: jax.Array, d: int, scale: float | None) -> jax.Array:
    """x times the softmax scale: `scale`, or 1/sqrt(d) (as a division) by default."""
    return x / math.sqrt(d) if scale is None else x * scale


def _scores(qi, kj, i, j, c: int, scale: float | None, first=None) -> jax.Array:
    """Scaled, causally masked float32 scores [b, c, kv, group, c] of query block i
    ([b, c, kv, group, d]) against key block j ([b, c, kv, d]); with `first` [b, s]
    (each query's document start) masked to the query's document too."""
    scores = _scaled(_dot("bqkgd,bckd->bqkgc", qi, kj), qi.shape[-1], scale)
    rows, cols = i * c + jnp.arange(c), j * c + jnp.arange(c)
    visible = (rows[:, None] >= cols[None, :])[None]
    if first is not None:
        visible = visible & (cols[None, None, :] >= _block(first, i, c)[:, :, None])
    return jnp.where(visible[:, :, None, None, :], scores, -jnp.inf)


def document_starts(positions: jax.Array | None) -> jax.Array | None:
    """[b, s] index of each token's document start (None without documents)."""
    if positions is None:
        return None
    return jnp.arange(positions.shape[-1]) - positions


def block_ranges(first: jax.Array | None, s: int, c: int) -> tuple[jax.Array, jax.Array]:
    """([s/c] first key block each query block visits, [s/c] one past the last query
    block each key block is visited by): the blocks between hold a shared document
    of some row (document starts only grow along a row, so a block's first row has
    the earliest). Without documents: 0 and s/c, the causal loops."""
    blocks = s // c
    if first is None:
        return jnp.zeros(blocks, jnp.int32), jnp.full(blocks, blocks, jnp.int32)
    low = first[:, ::c].min(0) // c
    last_key = (jnp.arange(blocks) + 1) * c - 1
    reach = (first[:, :, None] <= last_key).sum(1).max(0)  # rows seeing key block j
    return low.astype(jnp.int32), ((reach - 1) // c + 1).astype(jnp.int32)


def visited_blocks(positions, s: int) -> int:
    """How many (query block, key block) pairs the forward computes (NumPy: no program)."""
    c = block_size(s)
    low, _ = block_ranges(None if positions is None else np.arange(s) - positions, s, c)
    return int((np.arange(s // c) + 1 - np.asarray(low)).sum())


def _grouped(q: jax.Array, kv_heads: int) -> jax.Array:
    """[b, s, heads, d] -> [b, s, kv_heads, group, d]: each kv head's query heads."""
    b, s, h, d = q.shape
    return q.reshape(b, s, kv_heads, h // kv_heads, d)


def _forward(q, k, v, scale: float | None = None, positions=None) -> tuple[jax.Array, ...]:
    """(out [b, s, heads, dv], logsumexp [b, s, kv, group] float32, each head's largest
    visible score [heads] float32: the online softmax's row maxima, kept)."""
    qg = _grouped(q, k.shape[2])
    b, s, kv, g, _ = qg.shape
    d = v.shape[-1]  # the output's width: the values'
    c = block_size(s)
    first = document_starts(positions)
    low, _ = block_ranges(first, s, c)

    def query_block(i, carry):
        out, lse, peak = carry
        qi = _block(qg, i, c)

        def key_block(j, state):
            """Online softmax: the row maximum so far, the sum of exp(score - maximum)
            and the output's numerator, rescaled whenever the maximum grows."""
            top, total, acc = state
            scores = _scores(qi, _block(k, j, c), i, j, c, scale, first)
            new_top = jnp.maximum(top, scores.max(-1))
            # A row whose document starts past this block sees none of it yet: -inf.
            safe = jnp.where(jnp.isneginf(new_top), 0.0, new_top)
            p = jnp.exp(scores - safe[..., None])
            rescale = jnp.exp(top - safe)
            acc = rescale[..., None] * acc + _dot("bqkgc,bckd->bqkgd", p, _block(v, j, c))
            return new_top, rescale * total + p.sum(-1), acc

        rows = (b, c, kv, g)
        zeros = _zeros(rows, q, k, v)
        init = (zeros - jnp.inf, zeros, _zeros((*rows, d), q, k, v))
        # Key blocks low..i only: those above the diagonal, or before the block's
        # earliest document, are fully masked.
        top, total, acc = jax.lax.fori_loop(low[i], i + 1, key_block, init)
        peak = jnp.maximum(peak, top.max((0, 1)))  # every row sees its own key: finite
        return (
            _put(out, acc / total[..., None], i, c),
            _put(lse, top + jnp.log(total), i, c),
            peak,
        )

    out = (
        jnp.zeros_like(qg)
        if d == qg.shape[-1]
        else varying_zeros((*qg.shape[:-1], d), q.dtype, q, k, v)
    )
    init = (out, _zeros((b, s, kv, g), q, k, v), _zeros((kv, g), q, k, v) - jnp.inf)
    out, lse, peak = jax.lax.fori_loop(0, s // c, query_block, init)
    return out.reshape(*q.shape[:-1], d), lse, peak.reshape(-1)


def peak_logits(q, k, scale: float | None = None, positions=None) -> jax.Array:
    """Each query head's largest visible scaled score [heads] (float32), no gradient:
    the causal block loops of the forward with only the scores' maximum kept, for the
    implementations whose kernel does not return it (QK-clip's statistic)."""
    q, k = jax.lax.stop_gradient((q, k))
    qg = _grouped(q, k.shape[2])
    s, kv, g = qg.shape[1:4]
    c = block_size(s)
    first = document_starts(positions)
    low, _ = block_ranges(first, s, c)

    def query_block(i, peak):
        qi = _block(qg, i, c)

        def key_block(j, peak):
            scores = _scores(qi, _block(k, j, c), i, j, c, scale, first)
            return jnp.maximum(peak, scores.max((0, 1, 4)))

        return jax.lax.fori_loop(low[i], i + 1, key_block, peak)

    peak = jax.lax.fori_loop(0, s // c, query_block, _zeros((kv, g), q, k) - jnp.inf)
    return peak.reshape(-1)


def _backward(q, k, v, out, lse, grad, scale: float | None = None, positions=None):
    """FlashAttention-2's backward: dq accumulated over key blocks, each key block's
    dk and dv over the query blocks that see it (summed over the group's heads)."""
    kv = k.shape[2]
    qg, og, dog = (_grouped(x, kv) for x in (q, out, grad))
    b, s, _, _, d = qg.shape
    v_width = v.shape[-1]
    c = block_size(s)
    first = document_starts(positions)
    _, high = block_ranges(first, s, c)
    # rowsum(dO * O): the softmax's backward term, per row.
    delta = jnp.einsum("bskgd,bskgd->bskg", dog.astype(F32), og.astype(F32))

    def key_block(j, carry):
        dq, dk, dv = carry
        kj, vj = _block(k, j, c), _block(v, j, c)

        def query_block(i, state):
            dq, dkj, dvj = state
            qi, doi = _block(qg, i, c), _block(dog, i, c)
            p = jnp.exp(_scores(qi, kj, i, j, c, scale, first) - _block(lse, i, c)[..., None])
            dvj += _dot("bqkgc,bqkgd->bckd", p, doi)
            dp = _dot("bqkgd,bckd->bqkgc", doi, vj)
            ds = _scaled(p * (dp - _block(delta, i, c)[..., None]), d, scale)
            dkj += _dot("bqkgc,bqkgd->bckd", ds, qi)
            dq = _put(dq, _block(dq, i, c) + _dot("bqkgc,bckd->bqkgd", ds, kj), i, c)
            return dq, dkj, dvj

        init = (
            dq,
            _zeros((b, c, kv, d), q, k, v, grad),
            _zeros((b, c, kv, v_width), q, k, v, grad),
        )
        # Query blocks j..high only: those before the diagonal, or whose documents all
        # start after key block j, do not see it.
        dq, dkj, dvj = jax.lax.fori_loop(j, high[j], query_block, init)
        return dq, _put(dk, dkj, j, c), _put(dv, dvj, j, c)

    init = (_zeros(qg.shape, q, k, v, grad), jnp.zeros_like(k), jnp.zeros_like(v))
    dq, dk, dv = jax.lax.fori_loop(0, s // c, key_block, init)
    return dq.reshape(q.shape).astype(q.dtype), dk, dv


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def blockwise_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    scale: float | None = None,
    positions: jax.Array | None = None,
) -> jax.Array:
    """Causal GQA attention, like `jax.nn.dot_product_attention(q, k, v, is_causal=True,
    scale=scale)`, with v's width free; within documents where `positions` are given."""
    return _forward(q, k, v, scale, positions)[0]


def _fwd(q, k, v, scale, positions):
    out, lse, peak = _forward(q, k, v, scale, positions)
    out, lse = (checkpoint_name(t, RESIDUALS) for t in (out, lse))
    return (out, peak), (q, k, v, out, lse, positions)


def _fwd_out(q, k, v, scale, positions):
    (out, _), residuals = _fwd(q, k, v, scale, positions)
    return out, residuals


def _bwd(scale, residuals, grad):
    *arrays, positions = residuals
    return (*_backward(*arrays, grad, scale, positions), None)


def _bwd_peaks(scale, residuals, grads):
    return _bwd(scale, residuals, grads[0])  # the peaks carry no gradient


blockwise_attention.defvjp(_fwd_out, _bwd)


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def blockwise_attention_peaks(q, k, v, scale: float | None = None, positions=None):
    """(`blockwise_attention`'s output, `peak_logits`'s [heads]) from one pass: the
    forward's running maxima are the peaks."""
    out, _, peak = _forward(q, k, v, scale, positions)
    return out, peak


blockwise_attention_peaks.defvjp(_fwd, _bwd_peaks)
