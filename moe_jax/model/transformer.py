"""Decoder-only transformer: pre-norm blocks, dense prefix, then MoE layers.

Layers are stacked and applied with `lax.scan`, so compile time does not grow
with depth. A stack is one unit many times over: the dense prefix's unit is a single
dense block; the MoE part's is `moe_every - 1` dense blocks followed by one MoE
block. The MoE stack runs through `Layout.stack`, so a layout may hold and run it its
own way (a pipeline over stages, applied from outside: `moe_jax.parallel.pipeline`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from moe_jax.config import ModelConfig, MoEConfig
from moe_jax.model import remat
from moe_jax.model.attention import Attention
from moe_jax.model.axes import param
from moe_jax.model.layers import MLP, Embed, RMSNorm
from moe_jax.model.loss import chunked_cross_entropy
from moe_jax.model.mla import MLAttention
from moe_jax.model.mtp import MTP
from moe_jax.moe.block import MoE, MoEStats
from moe_jax.parallel.layout import SINGLE_DEVICE, Layout, Parts
from moe_jax.parallel.peaks import WithPeaks, split_peaks


class Block(nnx.Module):
    """x + attn(norm(x)), then + ffn(norm(x)); the ffn is a dense MLP or an MoE."""

    def __init__(self, cfg: ModelConfig, moe: MoEConfig | None, *, rngs: nnx.Rngs, layout: Layout):
        self.attn_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps)
        attention = MLAttention if cfg.attention == "mla" else Attention
        self.attn = attention(cfg, rngs=rngs, layout=layout)
        self.ffn_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps)
        if moe is None:
            self.ffn = MLP(cfg.embed_dim, cfg.mlp_dim, rngs=rngs, layout=layout)
        else:
            self.ffn = MoE(cfg.embed_dim, moe, rngs=rngs, layout=layout)

    def __call__(self, x: jax.Array, positions: jax.Array):
        attended, peaks = self.attn(self.attn_norm(x), positions), None
        if isinstance(attended, tuple):
            attended, peaks = attended
        x = remat.tag(x + attended, remat.FFN_INPUT)
        out = self.ffn(self.ffn_norm(x))
        stats = None
        if isinstance(out, tuple):
            out, stats = out
        stats = stats if peaks is None else WithPeaks(stats, peaks)
        return remat.tag(x + out, remat.LAYER_INPUT), stats


class Unit(nnx.Module):
    """The repeated unit of a stack: its blocks in order, each dense or an MoE."""

    def __init__(self, cfg: ModelConfig, moe: MoEConfig, kinds: tuple[bool, ...], *, rngs, layout):
        self.blocks = nnx.List(
            [Block(cfg, moe if is_moe else None, rngs=rngs, layout=layout) for is_moe in kinds]
        )

    def __call__(self, x: jax.Array, positions: jax.Array):
        stats, peaks = None, []
        for block in self.blocks:
            x, block_stats = block(x, positions)
            block_stats, block_peaks = split_peaks(block_stats)
            stats = block_stats if block_stats is not None else stats
            peaks += [] if block_peaks is None else [block_peaks]
        return x, WithPeaks(stats, jnp.stack(peaks)) if peaks else stats


def stacks(cfg: ModelConfig) -> dict[str, tuple[int, tuple[bool, ...]]]:
    """stack name -> (its units, whether each block of a unit is an MoE block), read off
    the one rule for which layers are MoE (`ModelConfig.block_of`)."""
    out: dict[str, tuple[int, tuple[bool, ...]]] = {}
    for layer in range(cfg.num_layers):
        stack, unit, _, is_moe = cfg.block_of(layer)
        units, kinds = out.get(stack, (0, ()))
        out[stack] = (max(units, unit + 1), (*kinds, is_moe) if unit == 0 else kinds)
    return out


class Stack(nnx.Module):
    """`count` copies of a unit (blocks of `kinds`, True for MoE) with parameters stacked
    on a leading 'layers' axis, run by one scan; `through_layout`: by `Layout.stack`,
    which may run the stack (as held there) its own way."""

    def __init__(
        self,
        cfg: ModelConfig,
        moe: MoEConfig,
        kinds: tuple[bool, ...],
        count: int,
        *,
        rngs,
        layout,
        through_layout: bool = False,
    ):
        @nnx.split_rngs(splits=count)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make(rngs: nnx.Rngs) -> Unit:
            return Unit(cfg, moe, kinds, rngs=rngs, layout=layout)

        self.units = make(rngs)
        self.remat = cfg.remat
        self.layout = layout
        self.through_layout = through_layout

    def _split(self):
        """(run_group(params, rest, x, positions) -> (y, stats), params, rest)."""
        graphdef, params, rest = nnx.split(self.units, nnx.Param, ...)

        def run_group(params, rest, x, positions):
            def body(carry, unit_state):
                params, rest = unit_state
                weights = self.layout.layer_weights(params)
                return nnx.merge(graphdef, weights, rest)(carry, positions)

            return jax.lax.scan(remat.wrap(body, self.remat), x, (params, rest))

        return run_group, params, rest

    def __call__(self, x: jax.Array, positions: jax.Array):
        run_group, params, rest = self._split()
        if self.through_layout:
            return self.layout.stack(run_group, params, rest, x, positions)
        return run_group(params, rest, x, positions)

    def with_loss(self, tokens, positions, prefix, prefix_params, tail, tail_params, data, loss):
        """`prefix`, this stack and `tail` inside the layout's pipeline
        (`Layout.stack_loss`; `loss`: the MoE terms): (objective, metrics, stats)."""
        run_group, params, rest = self._split()
        parts = Parts(run_group, tail, loss, prefix)
        args = (params, rest, tokens, positions, prefix_params, tail_params, data)
        return self.layout.stack_loss(parts, *args)


class Transformer(nnx.Module):
    """tokens [batch, seq] -> (logits [batch, seq, vocab] float32, stacked MoE stats)."""

    def __init__(
        self, cfg: ModelConfig, moe: MoEConfig, *, rngs: nnx.Rngs, layout: Layout = SINGLE_DEVICE
    ):
        self.cfg = cfg
        self.moe_cfg = moe
        self.embed = Embed(cfg.vocab_size, cfg.embed_dim, rngs=rngs, layout=layout)
        built = {
            name: Stack(
                cfg, moe, kinds, units, rngs=rngs, layout=layout, through_layout=name == "moe"
            )
            for name, (units, kinds) in stacks(cfg).items()  # in layer order: the rngs' order
        }
        self.dense, self.moe = built.get("dense"), built.get("moe")
        self.final_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps)
        self.layout = layout
        self.head = (
            None
            if cfg.tie_embeddings
            else param(rngs, (cfg.embed_dim, cfg.vocab_size), ("embed", "vocab"))
        )
        # Multi-token prediction modules, made last so the rest is drawn as without them.
        self.mtp = MTP(cfg, moe, Block, rngs=rngs, layout=layout) if cfg.mtp_depth else None

    def features(
        self, tokens: jax.Array, positions: jax.Array | None = None
    ) -> tuple[jax.Array, MoEStats | None]:
        """tokens [batch, seq] -> (the final-normed hidden states, stacked MoE stats);
        `positions` [batch, seq]: each token's in its document (a batch's 'positions'
        under a document mask), else 0, 1, 2, ..."""
        positions = self.layout.positions(tokens, positions)
        x = self.embed(tokens, jnp.dtype(self.cfg.dtype))
        stats, peaks = None, {}
        for name in ("dense", "moe"):  # in layer order
            stack = getattr(self, name)
            if stack is not None:
                x, stack_stats = stack(x, positions)
                stack_stats, peaks[name] = split_peaks(stack_stats)
                stats = stack_stats if name == "moe" else stats
        if self.layout.track_peaks:
            stats = WithPeaks(stats, peaks)
        return self.final_norm(x), stats

    def output_weights(self) -> jax.Array:
        """The output head [embed, vocab] in the compute dtype (the embedding when tied)."""
        dtype = jnp.dtype(self.cfg.dtype)
        if self.head is None:
            return self.embed.table[...].astype(dtype).T
        return self.head[...].astype(dtype)

    def chunked_loss(
        self,
        tokens: jax.Array,
        targets: jax.Array,
        chunks: int,
        positions: jax.Array | None = None,
        weights: jax.Array | None = None,
    ) -> tuple[jax.Array, MoEStats | None]:
        """(mean next-token cross-entropy over `chunks` chunks of the sequence, MoE stats):
        float32 [batch, seq, vocab] logits never exist (`moe_jax.model.loss`). A layout
        that splits the vocabulary computes each chunk over its shards of the head, which
        it gets as stored. `weights` as `head_loss`'s (a document mask's)."""
        x, stats = self.features(tokens, positions)
        return self.head_loss(x, targets, chunks, weights), stats

    def head_loss(
        self, x: jax.Array, targets: jax.Array, chunks: int, weights: jax.Array | None = None
    ) -> jax.Array:
        """The output head's mean cross-entropy on hidden states `x` (final-normed), as
        `chunked_loss` computes it; per-token `weights` as `chunked_cross_entropy`'s."""
        stored = self.embed.table[...] if self.head is None else self.head[...]
        return self._head_loss(stored, x, targets, chunks, weights)

    def _head_loss(self, stored, x, targets, chunks, weights):
        """`head_loss` with the head as stored (`self.head`, or the tied table)."""
        split = self.layout.chunk_loss
        head = stored.T if self.head is None else stored
        if split is None:
            head = head.astype(jnp.dtype(self.cfg.dtype))
            return chunked_cross_entropy(x, head, targets, chunks, weights=weights)
        return chunked_cross_entropy(x, head, targets, chunks, split, weights)

    def pipelined_losses(
        self,
        tokens: jax.Array,
        targets: jax.Array,
        chunks: int,
        positions: jax.Array | None = None,
        weights: jax.Array | None = None,
        mtp: tuple[dict, float] | None = None,
    ) -> tuple[jax.Array, dict, MoEStats]:
        """(objective, metrics, stats) where the layout's pipeline runs the head and loss
        inside it (`Layout.loss_in_pipeline`); with `mtp` = (the batch's 'mtp' part,
        train.mtp_loss_weight) the multi-token prediction modules too, after the head
        of each micro-batch. `metrics` hold `lm_loss` (and `mtp_loss`, and the MTP
        modules' stats under `mtp_stats`, as `mtp.losses` returns them), `stats` the
        stack's: for the metrics. The objective, whose mean over devices is the loss
        with its MoE terms, carries the gradient."""
        given = self.layout.positions(tokens, positions)
        graph = lambda module: nnx.split(module)[0]
        state = lambda module: None if module is None else nnx.split(module)[1]
        stored = self.embed.table[...] if self.head is None else self.head[...]
        dtype = jnp.dtype(self.cfg.dtype)
        data = {"targets": targets, "weights": weights}
        if mtp is not None:  # the MTP modules embed tokens ahead and read their positions
            data.update(mtp=mtp[0], positions=positions)
        extra = (self.embed, self.mtp) if mtp is not None else (None, None)
        modules = (self.final_norm, *extra)

        def tail(tail_params, y, data):
            stored, norm, embed, layers = tail_params
            loss = lambda x, t, w: self._head_loss(stored, x, t, chunks, w)
            x = nnx.merge(graph(self.final_norm), norm)(y)
            lm = loss(x, data["targets"], data["weights"])
            if layers is None:
                return lm, {"lm_loss": lm}
            embed = nnx.merge(graph(self.embed), embed)
            mtp_loss, mtp_stats = nnx.merge(graph(self.mtp), layers)(
                x,
                data["mtp"],
                lambda t: embed(t, dtype),
                lambda t: self.layout.positions(t, data["positions"]),
                loss,
            )
            total = lm + mtp[1] * mtp_loss
            total += sum(stats_loss(s) for s in mtp_stats if split_peaks(s)[0] is not None)
            return total, {"lm_loss": lm, "mtp_loss": mtp_loss, "mtp_stats": mtp_stats}

        stats_loss = lambda stats: split_peaks(stats)[0].loss(self.moe_cfg)

        def prefix(prefix_params, tokens, positions):
            embed, dense = prefix_params
            x = nnx.merge(graph(self.embed), embed)(tokens, dtype)
            if dense is None:
                return x, None
            x, stats = nnx.merge(graph(self.dense), dense)(x, positions)
            return x, split_peaks(stats)[1]

        prefix_params = (state(self.embed), state(self.dense))
        tail_params = (stored, *map(state, modules))
        args = (prefix, prefix_params, tail, tail_params, data, stats_loss)
        objective, metrics, stats = self.moe.with_loss(tokens, given, *args)
        if isinstance(stats, WithPeaks):  # the stack's peaks and the dense prefix's
            stack, dense = stats.peaks
            peaks = {"moe": stack} if dense is None else {"dense": dense, "moe": stack}
            stats = WithPeaks(stats.moe, peaks)
        return objective, metrics, stats

    def __call__(
        self, tokens: jax.Array, positions: jax.Array | None = None
    ) -> tuple[jax.Array, MoEStats | None]:
        """tokens [batch, seq] -> (logits [batch, seq, vocab] float32, stacked MoE stats)."""
        x, stats = self.features(tokens, positions)
        logits = jnp.einsum(
            "bsd,dv->bsv", x, self.output_weights(), preferred_element_type=jnp.float32
        )
        return logits, stats
