"""What a parallel layout is, as data: one `AttentionSpec` per attention layout and one
`ExpertSpec` per expert layout, each defined next to its block function and collected
in `moe_jax.parallel.registry`.

A spec holds everything the rest of the project needs to know about its layout: the
block functions the model runs through, how the layout splits the intra group and
the parameters, the checks of whether a config fits it, and the facts and formulas
the planning models (`moe_jax.plan`) read: bytes exchanged per layer, what the
backward keeps, which code differentiates which weights. Nothing outside a spec
asks a layout for its name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from fractions import Fraction
from typing import Any

# A check: the resolved config -> one-line messages of what does not fit (empty: fits).
Problems = Callable[[Any], list[str]]


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Per-micro-batch sizes the communication formulas read (all per device).

    n: devices of the intra group; B: bytes of model.dtype; T: tokens of one data
    group; t = T/n: tokens a device holds between blocks; h: embed_dim;
    f = (n-1)/n: share of a collective's buffer that leaves the device.
    """

    n: int
    B: int
    T: Fraction
    t: Fraction
    h: int
    f: Fraction


# config, sizes -> bytes one device sends in the forward pass of one block.
Bytes = Callable[[Any, Sizes], Fraction]


def _none(config, s: Sizes) -> Fraction:
    return Fraction(0)


def _no_problems(config) -> list[str]:
    return []


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """An attention layout; dense MLP blocks (and shared experts) follow it.

    `attention(layout, block, x, positions, weights, axes, attend)` and
    `mlp(layout, block, x, weights, axes)` run a block the layout's way; weights
    arrive as stored (float32) and the block casts them where it computes. `attend`
    is the per-device attention (`model.attention_impl`) the layout calls on the
    sequences and heads a device holds.
    """

    name: str
    attention: Callable
    mlp: Callable
    batch_axes: tuple[str, ...]  # mesh axes the batch is split over between blocks
    seq_axes: tuple[str, ...] = ()  # mesh axes the sequence is split over between blocks
    # Logical parameter axis -> mesh axes, for the weights of attention and dense MLPs.
    rules: Callable[[Any], tuple] = lambda config: ()
    problems: Problems = _no_problems
    # Mesh axes attention and dense-MLP weights are split over: None (replicated), the
    # intra group (heads and hidden columns) or 'data' (gathered per block, FSDP).
    weights_over: Any = None
    # Attention runs over whole sequences for heads/n heads (else all heads for the
    # sequences a device holds).
    heads_split: bool = False
    # Projections run on the group's whole sequence: gathered before each block and
    # reduce-scattered after it (attention and dense MLPs alike).
    gathers_sequence: bool = False
    # `parallel.overlap_chunks` > 1 runs the attention block as that many independent
    # chunks of the batch (each projecting, exchanging and attending on its own).
    chunks_batch: bool = False
    # `parallel.token_dtype='fp8'` sends its exchanges as E4M3 with scales.
    compresses_tokens: bool = False
    # `parallel.collective_matmul` runs its exchanges as rings of point-to-point steps,
    # each beside the GEMM on the block at hand (else the setting leaves it alone).
    ring: bool = False
    # Which blocks run inside `shard_map` (their gradients are reduced there, not by
    # GSPMD).
    attention_in_shard_map: bool = True
    mlp_in_shard_map: bool = True
    attention_bytes: Bytes = _none  # token exchange of one attention block
    mlp_bytes: Bytes = _none  # token exchange of one dense MLP block
    paper_bytes: Bytes = _none  # the paper's own formula for the attention block
    paper_equation: str = "no exchange"

    @property
    def exchanges(self) -> int:
        """Collectives per pass of an attention block (latency terms of the cost model)."""
        return 2 if self.heads_split else 0


@dataclasses.dataclass(frozen=True)
class ExpertSpec:
    """An expert layout: a token dispatcher (`moe_jax.moe.dispatcher`) run inside one
    `shard_map` by `block`, and how the intra group is split for it."""

    name: str
    block: Callable  # (layout, forward, x, params, cfg) -> (y, stats)
    dispatcher: Callable | None = None  # (layout, cfg) -> TokenDispatcher
    # The dispatcher `parallel.collective_matmul` runs instead (None: it has no ring form).
    ring_dispatcher: Callable | None = None
    # ParallelConfig -> (expert, tensor) sizes of the intra group.
    split: Callable[[Any], tuple[int, int]] = lambda parallel: (parallel.intra, 1)
    problems: Problems = _no_problems
    platforms_without: tuple[str, ...] = ()  # backends that cannot compile it
    platform_reason: str = ""  # why, and what to use there instead (the error's tail)
    # Routes the gathered tokens of the whole intra group (else its own tokens).
    gathers_tokens: bool = False
    # Rows one source sends one destination, (tokens per device, moe config, local
    # experts, parallel.a2a_buffer_factor) -> rows; None for layouts that exchange no
    # per-destination buffers.
    receive_slots: Callable[[int, Any, int, float], int] | None = None
    uses_etp: bool = False  # parallel.etp sets its split (and labels the plan)
    etp_choices: Callable[[int], list[int]] = lambda n: [2]  # the planner's etp sizes
    token_bytes: Bytes = _none
    paper_bytes: Bytes = _none
    paper_equation: str = "?"


@dataclasses.dataclass(frozen=True)
class VocabSpec:
    """How the embedding table and the output head are split over the vocabulary: the
    lookup and one chunk's cross-entropy, each run the split's way."""

    name: str
    embed: Callable  # (layout, table as stored, tokens [b, s]) -> [b, s, d] float32
    cross_entropy: Callable  # (layout, x, head as stored, targets) -> the chunk's summed loss
    rules: tuple = ()  # logical parameter axis -> mesh axes, for the table and head
    problems: Problems = _no_problems
