"""What one block of one micro-batch costs on one device: operators by roofline and
exchanges by alpha-beta, the parts `moe_jax.plan.cost_model` composes into a step.

Constants (`Efficiency`), each from a public measurement, none fitted to the
paper's table:
  * gemm 0.70: cuBLAS BF16 GEMMs of training shapes on H100-class parts reach
    0.7-0.8 of the 989 TFLOP/s datasheet peak (the same die as H800).
  * grouped_gemm 0.47 = 0.70 x 2/3: the grouped GEMMs of the paper's baseline era
    (CUTLASS 2.x DefaultGemmGrouped, behind Megatron-LM's --moe-grouped-gemm) use
    the sm80 mma.sync instruction, which reaches about 2/3 of Hopper's
    tensor-core peak (FlashAttention-3 paper, Shah et al. 2024).
  * attention 0.35: FlashAttention-2 on H100, ~350 TFLOP/s at head dim 128
    (the FlashAttention-3 paper's baseline).
  * memory 0.80: achievable share of HBM bandwidth for streaming kernels.
  * nvlink 0.78 and network 0.88: DeepEP on H800 moves 153-158 GB/s over NVLink
    (200 GB/s each way) and 43-47 GB/s over 400 Gb/s InfiniBand (50 GB/s).
  * latencies 3 us per NVLink step and 10 us per network step (NCCL-class).
  * overlap_chunks 4: not measured but a design choice of the overlap, the
    pieces a block's tokens are cut into; the first piece's exchange and the
    last piece's compute cannot hide.
  * tile_overhead 512 and reference_reduction 4096, first principles: a
    128x256 output tile's epilogue writes 64 KiB and its prologue loads one
    64-deep slice of both operands (48 KiB) before the first MMA; at one SM's
    share of HBM (3.35 TB/s / 132 = 25 GB/s) that is ~4.4 us, while one 64-deep
    step of the tile at peak (2*128*256*64 FLOP at 989/132 TFLOP/s) takes
    ~0.56 us: ~8 steps, 512 reduction elements. `gemm` was measured on training
    shapes reducing over the hidden size (~4096), so the factor is 1 there.
"""

from __future__ import annotations

import dataclasses
import functools

from moe_jax import config_attention
from moe_jax.data.documents import masked as documents_masked
from moe_jax.kernels.attention import resolve_impl
from moe_jax.parallel import registry
from moe_jax.parallel.layout import DATA
from moe_jax.plan.paper_modes import PAPER_OVERLAP

PARAM_BYTES = 4  # parameters are float32; fsdp gathers them as stored


@dataclasses.dataclass(frozen=True)
class Efficiency:
    """Achievable fractions of datasheet peaks (sources in the module docstring)."""

    gemm: float = 0.70  # dense BF16 GEMMs
    grouped_gemm: float = 0.47  # expert GEMMs: 2/3 of `gemm` (mma.sync-era kernels)
    attention: float = 0.35  # FlashAttention-2 forward and backward
    memory: float = 0.80  # HBM, for memory-bound operators
    nvlink: float = 0.78  # of NVLink's one-way bandwidth
    network: float = 0.88  # of the NIC's bandwidth
    nvlink_latency_s: float = 3e-6  # per ring or all-to-all step inside a node
    network_latency_s: float = 10e-6  # per step across nodes
    overlap_chunks: int = 4  # chunks the paper's system pipelines each exchange over
    tile_overhead: float = 512  # reduction steps of a tile's prologue + epilogue (`tile_factor`)
    reference_reduction: float = 4096  # reduction length of the shapes `gemm` was measured on


@dataclasses.dataclass(frozen=True)
class Link:
    bandwidth: float  # achievable bytes/s one device sends
    latency: float  # seconds per step


def collective_time(bytes_sent: float, group: int, link: Link, count: int = 1) -> float:
    """`count` ring all-gathers / reduce-scatters or pairwise all-to-alls over `group`
    devices: (g-1) latency steps each, plus the bytes one device sends over the link."""
    if group <= 1 or bytes_sent <= 0:
        return 0.0
    return count * (group - 1) * link.latency + bytes_sent / link.bandwidth


def all_gather_time(result_bytes: float, group: int, link: Link) -> float:
    """Ring all-gather of a result of `result_bytes` per device (sends (g-1)/g of it)."""
    return collective_time(result_bytes * (group - 1) / group, group, link)


def exposed(comm: float, compute: float, chunks: int) -> float:
    """Communication left on the critical path when it is pipelined with `compute` in
    `chunks` pieces: the first piece's exchange cannot hide (1: all of it is exposed)."""
    return max(0.0, comm - compute) + min(comm, compute) / chunks


@dataclasses.dataclass
class Tally:
    """Seconds by kind: compute kinds, exposed and hidden exchanges."""

    compute: dict[str, float] = dataclasses.field(default_factory=dict)
    exposed: dict[str, float] = dataclasses.field(default_factory=dict)
    hidden: dict[str, float] = dataclasses.field(default_factory=dict)
    backward: float = 0.0  # seconds of backward passes (what gradient sync can hide behind)

    def add(self, other: Tally, times: float = 1.0) -> None:
        self.backward += other.backward * times
        for mine, theirs in (
            (self.compute, other.compute),
            (self.exposed, other.exposed),
            (self.hidden, other.hidden),
        ):
            for key, value in theirs.items():
                mine[key] = mine.get(key, 0.0) + value * times

    @property
    def seconds(self) -> float:
        return sum(self.compute.values()) + sum(self.exposed.values())


Gemm = tuple[float, float, float]  # forward (rows, columns, reduction length) of one GEMM


def tile_factor(reduction: float, eff: Efficiency) -> float:
    """Share of `eff.gemm` a GEMM reaching over `reduction` keeps: each output tile pays a
    fixed prologue and epilogue (`Efficiency.tile_overhead` reduction steps), so short
    reductions (tensor parallelism's 512-deep attention output and 1792-deep expert down
    projections, 768-row weight gradients) run slower than the shapes `gemm` was measured
    on (`Efficiency.reference_reduction` deep); never above 1."""
    k0, ref = eff.tile_overhead, eff.reference_reduction
    return min(1.0, reduction / (reduction + k0) * (ref + k0) / ref)


@functools.lru_cache(maxsize=1 << 16)  # the planner asks for the same shapes per plan
def gemm_factor(shapes: tuple[Gemm, ...], backward: bool, eff: Efficiency) -> float:
    """FLOP-weighted tile factor of a group of GEMMs. Backward runs each as a data-gradient
    GEMM reducing over its columns and a weight-gradient GEMM reducing over its rows."""
    if not shapes:
        return 1.0
    reductions = [(n, m) if backward else (k,) for m, n, k in shapes]
    work = [m * n * k for m, n, k in shapes]
    slow = sum(
        w * sum(1 / tile_factor(r, eff) for r in rs) / len(rs)
        for w, rs in zip(work, reductions, strict=True)
    )
    return sum(work) / slow


@dataclasses.dataclass(frozen=True)
class Op:
    name: str  # what the breakdown calls it
    kind: str  # which efficiency applies: gemm, grouped_gemm, attention or memory
    flops: float
    bytes: float
    shapes: tuple[Gemm, ...] = ()  # the GEMMs behind `flops`, for `gemm_factor`
    backward: float | None = None  # the backward's time over the forward's (None: by kind)


@dataclasses.dataclass(frozen=True)
class Exchange:
    kind: str  # attention_exchange, expert_exchange, weight_gather
    bytes: float
    group: int
    count: int  # collectives per pass (latency terms)
    link: Link
    chunks: int = 1  # pieces it is pipelined over with its block's compute (1: exposed)
    # Steps of each direction's ring (`parallel.collective_matmul`: n-1), each beside the
    # GEMM on the block at hand; 0: not a ring.
    ring: int = 0

    @property
    def pieces(self) -> int:
        return self.chunks * max(1, self.ring)

    @property
    def seconds(self) -> float:
        return collective_time(self.bytes, self.group, self.link, self.count)


BACKWARD = {"gemm": 2.0, "grouped_gemm": 2.0, "attention": 2.5, "memory": 2.0}


def backward_factor(op: Op) -> float:
    """The operator's backward time over its forward's (its own, else its kind's)."""
    return BACKWARD[op.kind] if op.backward is None else op.backward


def recomputed(ops: list[Op]) -> list[Op]:
    """What a rematerialised forward runs again: what the backward reads (an operator
    with no backward, as QK-clip's peak pass, only feeds the forward's outputs)."""
    return [op for op in ops if op.backward != 0.0]


COMPUTE_KINDS = ("gemm", "grouped_gemm", "attention")  # what exchanges can hide behind
RING_PARTNERS = ("gemm", "grouped_gemm")  # what a collective matmul's steps hide behind


class BlockCosts:
    """The operators and exchanges of each block kind (a part of `CostModel`, which sets
    the shapes, links and specs they read)."""

    def attention_ops(self) -> list[Op]:
        m, t, B = self.config.model, self.t, self.B
        if m.attention == "mla":
            return self._mla_ops()
        h, hd, heads, kv = m.embed_dim, m.head_dim, m.num_heads, m.num_kv_heads
        weights = h * hd * (2 * heads + 2 * kv)
        split = self._intra_split
        context = (self.config.train.seq_len + 1) / 2  # mean keys per causal query
        qkvo = t * (2 * heads + 2 * kv) * hd * B
        rows = self._rows()
        shapes = ((rows, (heads + 2 * kv) * hd / split, h), (rows, h, heads * hd / split))
        return [
            Op(
                "dense_gemm",
                "gemm",
                2 * t * weights,
                weights * B / split + qkvo + 2 * t * h * B,
                shapes,
            ),
            Op("attention_core", "attention", 4 * t * context * heads * hd, qkvo),
            *self._peak_pass(2 * t * context * heads * hd, t * (heads + kv) * hd * B),
            Op("elementwise", "memory", 0.0, t * (5 * h + 2 * (heads + kv) * hd) * B),
            *self._fp8_casts(qkvo / B if self.attention_spec.compresses_tokens else 0),
        ]

    def _mla_ops(self) -> list[Op]:
        """MLA: the down-projections carry no heads, so a layout that splits heads (tp)
        runs them whole on each device's rows (tp: the gathered group's); the per-head
        up-projections and `out` split as GQA's projections do. The core reads q and k
        qk = nope + rope wide and v v_head_dim wide, for every head."""
        m, t, B = self.config.model, self.t, self.B
        h, heads, split, rows = m.embed_dim, m.num_heads, self._intra_split, self._rows()
        qk, v = config_attention.head_widths(m)
        down, per_head = config_attention.shared_weights(m), config_attention.head_weights(m)
        latent = m.q_lora_rank + m.kv_lora_rank + m.qk_rope_head_dim
        down_rows = rows if split > 1 else t  # tp: every device projects the gathered rows
        context = (self.config.train.seq_len + 1) / 2
        qkvo = t * heads * (2 * qk + 2 * v) * B
        query_in = m.q_lora_rank or h
        shapes = (
            (down_rows, latent, h),
            (rows, heads * qk / split, query_in),
            (rows, heads * (m.qk_nope_head_dim + v) / split, m.kv_lora_rank),
            (rows, h, heads * v / split),
        )
        flops = 2 * down_rows * down + 2 * t * per_head
        io = down * B + per_head * B / split + qkvo + 2 * t * h * B + 2 * down_rows * latent * B
        return [
            Op("dense_gemm", "gemm", flops, io, shapes),
            Op("attention_core", "attention", 2 * t * context * heads * (qk + v), qkvo),
            *self._peak_pass(2 * t * context * heads * qk, 2 * t * heads * qk * B),
            Op("elementwise", "memory", 0.0, t * (5 * h + 4 * heads * qk) * B),
            *self._fp8_casts(qkvo / B if self.attention_spec.compresses_tokens else 0),
        ]

    def _peak_pass(self, flops: float, io: float) -> list[Op]:
        """`train.qk_clip` on an attention implementation whose kernel keeps no running
        maximum (`xla`, `cudnn`): the forward-only pass of the scores that finds each
        head's peak (`blockwise_attention.peak_logits`), counted with the core; nothing
        in the backward (its output is not differentiated, and a recomputed forward
        drops it)."""
        m = self.config.model
        if not self.config.train.qk_clip:
            return []
        impl = resolve_impl(m.attention_impl, m.dtype, "gpu", documents_masked(self.config.data))
        if impl == "blockwise":
            return []
        return [Op("attention_core", "attention", flops, io, backward=0.0)]

    def mlp_ops(self) -> list[Op]:
        m, t, B = self.config.model, self.t, self.B
        h, width = m.embed_dim, m.mlp_dim
        split = self._intra_split
        io = t * (2 * h + 3 * width) * B
        shapes = ((self._rows(), 2 * width / split, h), (self._rows(), h, width / split))
        return [
            Op("dense_gemm", "gemm", 6 * t * h * width, 3 * h * width * B / split + io, shapes),
            Op("elementwise", "memory", 0.0, t * (5 * h + 3 * width) * B),
        ]

    def moe_ops(self) -> list[Op]:
        """Router, grouped expert GEMMs, shared experts, and the memory-bound rest. With
        the paper's overlap (`PAPER_OVERLAP`) the row gather and the weighted scatter are
        fused into the grouped GEMM (its intra-operator fusion), so they cost no pass of
        their own."""
        m, e, p, B = self.config.model, self.config.moe, self.plan, self.B
        T, t, n, h, f, k = self.T, self.t, p.parallel.intra, m.embed_dim, e.expert_mlp_dim, e.top_k
        routed = T if self.expert_spec.gathers_tokens else t  # the group's, after a gather
        rows = T * k / n  # expert rows x full width per device, every layout (balanced)
        ep, tp = registry.expert_split(self.sized)
        permuted = T * k / ep  # rows of all local experts, each at its 1/tp width
        weights = 3 * h * f * e.num_experts / n
        shared = e.num_shared_experts * e.shared_mlp_dim
        fused = p.overlap == PAPER_OVERLAP
        width = f / tp  # of each local expert
        per_expert = T * k / e.num_experts  # rows each expert receives (balanced)
        expert_shapes = ((per_expert, 2 * width, h), (per_expert, h, width))
        ops = [
            Op("dense_gemm", "gemm", 2 * routed * h * e.num_experts, routed * h * B),
            Op(
                "expert_gemm",
                "grouped_gemm",
                6 * h * f * rows,
                weights * B + (2 * permuted * h + 3 * rows * f) * B,
                expert_shapes,
            ),
            Op(
                "routing_permute",
                "memory",
                0.0,
                12 * routed * e.num_experts  # softmax and top-k in float32
                + (0 if fused else 4 * permuted * h * B)  # gather rows, scatter back
                + routed * h * B,  # the combined output
            ),
            Op("elementwise", "memory", 0.0, (5 * t * h + 3 * rows * f + 3 * t * shared) * B),
            *self._fp8_casts(self._received_rows() * h),
        ]
        if shared:
            io = t * (2 * h + 3 * shared) * B
            ops.append(Op("dense_gemm", "gemm", 6 * t * h * shared, 3 * h * shared * B + io))
        return ops

    def _received_rows(self) -> float:
        """Rows an expert block's dispatch delivers to one device: the group's tokens
        (all-gather forms) or its n static receive buffers."""
        e, p = self.config.moe, self.plan
        if self.expert_spec.gathers_tokens:
            return self.T
        local = e.num_experts // p.parallel.intra
        factor = self.plan.parallel.a2a_buffer_factor
        return p.parallel.intra * self.expert_spec.receive_slots(self.t, e, local, factor)

    def _fp8_casts(self, elements: float) -> list[Op]:
        """`parallel.token_dtype='fp8'`: quantising what a block sends (read B bytes an
        element, write 1) and dequantising what it receives (read 1, write B), at HBM
        speed; `elements` received per device (sent: the same or fewer)."""
        if self.plan.parallel.token_dtype != "fp8" or not elements:
            return []
        return [Op("fp8_casts", "memory", 0.0, 2 * elements * (self.B + 1))]

    def head_ops(self) -> list[Op]:
        m, t, B = self.config.model, self.t, self.B
        split = self._intra_split
        weights = m.embed_dim * m.vocab_size
        logits = t * m.vocab_size * 4
        return [
            Op("dense_gemm", "gemm", 2 * t * weights, weights * B / split + logits),
            Op("elementwise", "memory", 0.0, 3 * logits),  # softmax cross-entropy
        ]

    # --- exchanges -------------------------------------------------------------------

    def attention_exchanges(self) -> list[Exchange]:
        p, m, spec = self.plan.parallel, self.config.model, self.attention_spec
        out = []
        if spec.exchanges:
            chunks = self.chunks(spec.chunks_batch)
            out.append(
                Exchange(
                    "attention_exchange",
                    self.activation.attention,
                    p.intra,
                    spec.exchanges * chunks,
                    self.intra,
                    chunks,
                    self.ring(spec.ring),
                )
            )
        if spec.weights_over == DATA:
            out.append(self._weight_gather(config_attention.head_weights(m)))
        return out

    def mlp_exchanges(self) -> list[Exchange]:
        p, m, spec = self.plan.parallel, self.config.model, self.attention_spec
        out = []
        if self.mlp_activation:  # tp: all-gather in, reduce-scatter out, as attention
            ring = self.ring(spec.ring)
            out.append(
                Exchange("attention_exchange", self.mlp_activation, p.intra, 2, self.intra, 1, ring)
            )
        if spec.weights_over == DATA:
            out.append(self._weight_gather(3 * m.embed_dim * m.mlp_dim))
        return out

    def moe_exchanges(self) -> list[Exchange]:
        p, m, e = self.plan.parallel, self.config.model, self.config.moe
        chunks = self.chunks(True)  # every expert layout runs chunked
        ring = self.ring(self.expert_spec.ring_dispatcher is not None)
        exchange = self.activation.experts
        out = [Exchange("expert_exchange", exchange, p.intra, 2 * chunks, self.intra, chunks, ring)]
        if p.expert_fsdp:  # this device's experts (its 1/n of the group's) from 'data'
            out.append(
                self._weight_gather(3 * m.embed_dim * e.expert_mlp_dim * e.num_experts // p.intra)
            )
        return out

    def _weight_gather(self, params: int) -> Exchange:
        d = self.plan.parallel.data
        return Exchange("weight_gather", params * PARAM_BYTES * (d - 1) / d, d, 1, self.data_link)
