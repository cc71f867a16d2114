"""Multi-token prediction (DeepSeek-V3, `model.mtp_depth` = D): D sequential modules
after the main stack that each predict one token further ahead, trained as an extra
loss and used by nothing else (`sample` and `evaluate` read the main head only).

Module k (1..D), at position i: h'_i = eh_proj([enorm(Emb(t_{i+k})); hnorm(h^{k-1}_i)])
(the embedding half first, as every loader of the released weights concatenates),
h^k = one transformer block on h' (dense or MoE as the layer pattern says for layer
`num_layers + k - 1`), logits = the shared head on norm_k(h^k), trained against
t_{i+k+1}. h^0 is the main stack's output after its final norm, what Megatron feeds and
what SGLang's and vLLM's DeepSeek next-n drafts receive from the target model (the
hidden states it hands its logits). Embedding and head are the model's own, shared.

loss = lm_loss + train.mtp_loss_weight * mtp_loss, mtp_loss = (1/D) sum_k CE_k, each
CE_k the mean over the positions whose target lies inside the sequence (i + k < S).
The shifted tokens and those weights are made where the whole sequence is, before a
layout splits it (`with_targets`), so no layout has to shift anything across devices.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from moe_jax.config import ModelConfig, MoEConfig
from moe_jax.model import remat
from moe_jax.model.axes import param
from moe_jax.model.layers import RMSNorm, cast_like
from moe_jax.moe.block import MoEStats
from moe_jax.parallel.peaks import WithPeaks, split_peaks


def is_moe(cfg: ModelConfig, depth: int) -> bool:
    """Whether MTP module `depth` (1..D) has an MoE block: as the layer pattern says for
    layer num_layers + depth - 1, in a model that has MoE layers at all."""
    return cfg.num_moe_layers > 0 and cfg.block_of(cfg.num_layers + depth - 1)[3]


def with_targets(batch: dict, depth: int) -> dict:
    """`batch` with what depths 1..`depth` read under 'mtp', made from its targets
    [b, s] (t_{i+1}) while the whole sequence is at hand: per depth k the tokens t_{i+k}
    embedded at i, the targets t_{i+k+1} (0 past the end), and float32 weights
    s / (s - k) where i + k < s, else 0 (so a mean over all b * s positions is the mean
    over the valid ones). Unchanged when MTP is off or the batch has them already."""
    if depth == 0 or "mtp" in batch:
        return batch
    targets = batch["targets"]
    b, s = targets.shape
    ahead = [targets] + [jnp.pad(targets[:, k:], ((0, 0), (0, k))) for k in range(1, depth + 1)]
    if "loss_mask" in batch:
        weights = _document_weights(jnp.asarray(batch["loss_mask"]), depth)
    else:
        valid = lambda k: jnp.where(jnp.arange(s) < s - k, s / (s - k), 0.0).astype(jnp.float32)
        weights = [jnp.broadcast_to(valid(k), (b, s)) for k in range(1, depth + 1)]
    mtp = {"inputs": tuple(ahead[:-1]), "targets": tuple(ahead[1:]), "weights": tuple(weights)}
    return {**batch, "mtp": mtp}


def _document_weights(loss_mask: jax.Array, depth: int) -> list[jax.Array]:
    """Per depth k the weights of a document mask: t_{i+k+1} counts when it lies in the
    document of input i (no EOS among inputs i..i+k) and inside the sequence, each
    count scaled so a mean over all b·s positions is the mean over the counted ones."""
    same = loss_mask.astype(bool)
    out = []
    for k in range(1, depth + 1):
        same = same & jnp.pad(loss_mask[:, k:].astype(bool), ((0, 0), (0, k)))
        counted = same.astype(jnp.float32)
        out.append(counted * (counted.size / jnp.maximum(counted.sum(), 1.0)))
    return out


class MTPLayer(nnx.Module):
    """One MTP module: the two norms, eh_proj [2d, d] (HF `eh_proj.weight` transposed),
    a transformer block, and its own final norm (HF `shared_head.norm`)."""

    def __init__(self, cfg: ModelConfig, moe: MoEConfig | None, block: type, *, rngs, layout):
        d = cfg.embed_dim
        self.enorm = RMSNorm(d, cfg.norm_eps)
        self.hnorm = RMSNorm(d, cfg.norm_eps)
        self.eh_proj = param(rngs, (2 * d, d), (None, "embed"))
        self.block = block(cfg, moe, rngs=rngs, layout=layout)
        self.norm = RMSNorm(d, cfg.norm_eps)

    def __call__(self, h: jax.Array, e: jax.Array, positions: jax.Array):
        """(h^k before its final norm, the block's MoE stats or None)."""
        joined = jnp.concatenate([self.enorm(e), self.hnorm(h)], axis=-1)
        return self.block(joined @ cast_like(self.eh_proj[...], joined), positions)


class MTP(nnx.Module):
    """The D modules in order; `block` is the model's transformer block class."""

    def __init__(self, cfg: ModelConfig, moe: MoEConfig, block: type, *, rngs, layout):
        self.layers = nnx.List(
            [
                MTPLayer(cfg, moe if is_moe(cfg, k) else None, block, rngs=rngs, layout=layout)
                for k in range(1, cfg.mtp_depth + 1)
            ]
        )
        self.remat = cfg.remat

    def __call__(self, h: jax.Array, mtp: dict, embed: Callable, positions: Callable, loss):
        """(mtp_loss, per-depth MoE stats with None for dense depths) for main hidden
        states `h` (after the final norm) and the batch's 'mtp' part; `embed(tokens)`,
        `positions(tokens)` and `loss(x, targets, weights)` are the model's. Each module
        runs under the model's `model.remat`, as a scanned unit of the stack does."""
        total, stats = jnp.zeros((), jnp.float32), []
        for k, layer in enumerate(self.layers):
            graphdef, state = nnx.split(layer)
            run = remat.wrap(lambda state, *a, g=graphdef: nnx.merge(g, state)(*a), self.remat)
            tokens = mtp["inputs"][k]
            h, layer_stats = run(state, h, embed(tokens), positions(tokens))
            total = total + loss(layer.norm(h), mtp["targets"][k], mtp["weights"][k])
            stats.append(layer_stats)
        return total / len(self.layers), stats


def losses(model, batch: dict, chunks: int):
    """(lm_loss, mtp_loss, stats) of a `Transformer` with MTP on a batch of
    `with_targets`: the main head's loss as `Transformer.chunked_loss` computes it, the
    MTP term, and the MoE stats of the stack followed by those of the MTP modules
    (`merged`). Under a pipeline the modules run once per micro-batch
    (`Layout.microbatched`), as its stack does."""
    given = batch.get("positions")  # a document mask's, else None
    x, stats = model.features(batch["inputs"], given)
    lm_loss = model.head_loss(x, batch["targets"], chunks, batch.get("weights"))
    dtype = jnp.dtype(model.cfg.dtype)

    def run(x, mtp, given):
        return model.mtp(
            x,
            mtp,
            lambda tokens: model.embed(tokens, dtype),
            lambda tokens: model.layout.positions(tokens, given),
            lambda x, targets, weights: model.head_loss(x, targets, chunks, weights),
        )

    mtp_loss, mtp_stats = model.layout.microbatched(run, x, batch["mtp"], given)
    return lm_loss, mtp_loss, merged(stats, mtp_stats)


def merged(stats, mtp_stats: list) -> tuple:
    """(the stack's stats with the MTP modules' MoE layers appended, the MTP load
    [D, E] with zero rows for dense depths, or None without MoE MTP modules). The
    aux, sequence and z losses then sum over every MoE layer, MTP's included; `load`
    stays the stack's, as the stack's router biases read it. Where attention's peaks
    are tracked (`moe_jax.parallel.peaks`) the modules' [D, heads] join the stacks'
    under 'mtp'."""
    stats, peaks = split_peaks(stats)
    mtp_stats, mtp_peaks = zip(*map(split_peaks, mtp_stats), strict=True)
    stats, mtp_load = _merged(stats, list(mtp_stats))
    if peaks is not None:
        stats = WithPeaks(stats, {**peaks, "mtp": jnp.stack(mtp_peaks)})
    return stats, mtp_load


def _merged(stats: MoEStats | None, mtp_stats: list) -> tuple[MoEStats | None, jax.Array | None]:
    moe = [s for s in mtp_stats if s is not None]
    if not moe:
        return stats, None
    extra = jax.tree.map(lambda *x: jnp.stack(x), *moe)
    zeros = jnp.zeros_like(moe[0].load)
    mtp_load = jnp.stack([zeros if s is None else s.load for s in mtp_stats])
    if stats is None:
        return extra, mtp_load
    join = lambda a, b: jnp.concatenate([a, b.astype(a.dtype)])
    both = jax.tree.map(join, stats, extra)
    return dataclasses.replace(both, load=stats.load), mtp_load
