"""What one MoE block's experts hold on one device, a part of `moe_jax.plan.memory`'s
activation count: the rows the grouped kernel multiplies and what it stores for the
backward, the transient buffers of its backward, and the weights it gathers.

Why apart: the grouped kernels' buffers depend on the expert layout (which rows a
device receives), the kernel (`moe.impl`: tile padding, pieces) and, in the backward,
on how the kernel computes its input gradient, none of which the attention blocks share.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from moe_jax.config import Config, MoEConfig
from moe_jax.moe.experts import kernel_of, resolve_impl
from moe_jax.parallel import registry

FP32 = 4


@dataclasses.dataclass(frozen=True)
class Routed:
    """The rows an MoE block's experts multiply on one device."""

    routed: int  # tokens the router scores (ep_a2a: the device's; all-gather forms: the group's)
    tokens: int  # rows entering the kernel before top-k (ep_a2a: the received rows)
    choices: int  # assignments per such row (ep_a2a: 1, each received row has its expert)
    local: MoEConfig  # the device's experts (num_experts local; capacity as they apply)
    slots: int | None  # capacity per expert when drops were decided over all experts
    f_local: int  # each local expert's width
    pieces: int  # independent groups the rows are computed in (`expert_pieces`)


def expert_pieces(config: Config, z: Any) -> int:
    """The independent groups an expert block's rows are computed in: its
    parallel.overlap_chunks chunks, times the n ring steps of each under
    parallel.collective_matmul (where the expert layout has a ring form)."""
    spec = registry.expert_spec(config)
    ring = config.parallel.collective_matmul and spec.ring_dispatcher is not None
    return config.parallel.overlap_chunks * (z.n if ring else 1)


def routed_rows(config: Config, z: Any) -> Routed:
    """The rows of the layout's dispatch: the all-gather forms multiply every gathered
    assignment (n·t tokens, top-k each); ep_a2a the n·slots rows it receives."""
    e = config.moe
    spec = registry.expert_spec(config)
    expert, tensor = registry.expert_split(config)
    local = dataclasses.replace(e, num_experts=e.num_experts // expert)
    slots = None
    if spec.gathers_tokens:
        routed = z.n * z.t
        tokens, choices = routed, e.top_k
        slots = None if e.dropless else e.capacity(routed)
    else:
        routed = z.t
        factor = config.parallel.a2a_buffer_factor
        received = spec.receive_slots(z.t, e, local.num_experts, factor)
        local = dataclasses.replace(local, capacity_factor=0.0)
        tokens, choices = z.n * received, 1
    f_local = e.expert_mlp_dim // tensor
    return Routed(routed, tokens, choices, local, slots, f_local, expert_pieces(config, z))


def _piece_rows(rows: Routed) -> tuple[str, int, int]:
    """(kernel, rows one piece's buffer has, its tile or 0): tile-padded for `tiled`."""
    moe, e_local = rows.local, rows.local.num_experts
    impl = kernel_of(moe)
    per = rows.tokens // rows.pieces
    held = per * rows.choices  # rows a piece holds (capacity mode: at most its [E, C] buckets)
    if resolve_impl(moe) == "capacity":
        held = min(held, e_local * (rows.slots or moe.capacity(per)))
    if impl != "tiled":
        return impl, held, 0
    tile = moe.tile(per)
    return impl, -(-(held + e_local * (tile - 1)) // tile) * tile, tile


def expert_terms(config: Config, z: Any, rows: Routed) -> dict[str, int]:
    """Grouped SwiGLU over the routed rows on the device's experts: the sorted rows
    (tile-padded for `tiled`, each piece its own buffer), their six hidden activations
    and the weights as the matmuls read them (copied only when cast to bf16, or
    gathered over 'data')."""
    impl, padded, tile = _piece_rows(rows)
    e_local = rows.local.num_experts
    total = rows.pieces * padded
    indices = total
    if impl == "tiled":  # each piece's chunk plan
        levels = max(1, (padded // tile).bit_length())
        indices = total + rows.pieces * levels * (2 * e_local + 1)
        # weights are cast once per piece, each cast living only while its piece runs
        # (the pieces' gradient accumulators, all live at once: `piece_gradient_bytes`)
    weights = 3 * e_local * z.h * rows.f_local * z.B
    # float32 weights are read as the parameters themselves, unless gathered over 'data'
    weights = weights if z.B != FP32 or config.parallel.expert_fsdp else 0
    return {
        "expert_rows": total * z.h * z.B + 4 * indices,
        "expert_hidden": 6 * total * rows.f_local * z.B,
        "expert_weights": weights,
    }


def backward_bytes(config: Config, z: Any) -> int:
    """The `tiled` kernel's input gradient, in the backward's working set beyond the
    block's stored activations, for one piece at a time: the rows' cotangent [R, h];
    for each of the two matmuls that read the h-wide rows (gate, up) a zero-filled
    [R, h] gradient and the chunk loop's updated copy of it (XLA keeps both: the loop
    carries a copy of the zeros); the largest chunk's float32 product [c, h] (c the
    largest power-of-two run of tiles in R) before it is written in; less three of
    the six [R, f_l] hidden tensors, released by then (their gradients, three, live),
    and less the combine's gathered rows [T·k, h] (its backward, which made the
    cotangent, has run). DeepSeek-V3's MoE layer, tp, intra 8, in XLA's buffer report at
    the step's peak: ep_a2a at 4 sequences holds those seven [R, h] buffers and three
    [R, f_l], etp at 2 the seven and no combine rows (tests/test_plan_memory.py).
    Never negative: where the released tensors outweigh it (wide experts, Mixtral-8x7B
    under ep_a2a or ep_ag) the backward's peak is the stored set itself. Other kernels:
    0 (not measured here)."""
    if not config.moe.num_experts:
        return 0
    rows = routed_rows(config, z)
    impl, padded, tile = _piece_rows(rows)
    if impl != "tiled":
        return 0
    chunk = tile << ((padded // tile).bit_length() - 1)
    wide = 5 * padded * z.h * z.B + chunk * z.h * FP32
    combine = rows.routed * config.moe.top_k * z.h * z.B  # `memory._router_terms`
    return max(0, wide - 3 * padded * rows.f_local * z.B - combine)


def gathered_expert_bytes(config: Config) -> int:
    """Under parallel.expert_fsdp, the float32 weights an MoE block gathers over 'data'
    for its local experts (gate, up and down, 3·E_l·h·f_l·4) and their float32 gradient
    at that size before the reduce-scatter returns each device its share: twice that,
    in the working set once (its bf16 cast is `expert_weights`). DeepSeek-V3 at full
    width on 64 devices (tests/test_plan_memory.py): XLA's peak holds two gathered
    f32[32, 7168, 2048] weights, three zeroed gradients of that shape and the casts."""
    if not config.parallel.expert_fsdp:
        return 0
    e = config.moe
    expert, tensor = registry.expert_split(config)
    local = 3 * (e.num_experts // expert) * config.model.embed_dim * (e.expert_mlp_dim // tensor)
    return 2 * local * FP32
