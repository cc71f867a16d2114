"""Analytic time of one training step of a plan on a GPU cluster.

Why: ranking layouts needs a prediction that can be explained term by term
(compute, exposed communication per kind, pipeline bubble), not a black box.

Model, per device and per micro-batch of the slowest pipeline stage:
  * compute: FLOPs and bytes of each operator (attention projections, the
    attention core, grouped expert GEMMs, router, memory-bound norms, rotary,
    permute, SwiGLU and combine); time by roofline, max(FLOPs / (peak * eff),
    bytes / (HBM * eff)). Backward costs 2x forward for GEMMs and memory-bound
    ops, 2.5x for the attention core (five matmuls against two); remat "full"
    runs the forward once more, its exchanges included, "selective" only its
    memory-bound operators (`Plan.remat`, default the config's). GEMM efficiency
    falls with the reduction length of the real per-device shapes
    (`tile_factor`), which tensor parallelism shortens. Every micro-batch also
    reads and writes the float32 gradient accumulator.
  * communication: alpha-beta, (g-1) * alpha + bytes sent / achievable bandwidth,
    with the activation bytes of `moe_jax.plan.comm_volume`, inside the
    node over NVLink, across nodes over the per-GPU NIC.
  * overlap, the trainer's settings one to one (`Plan.overlap_chunks`,
    `Plan.collective_matmul`; `Plan.overlap` names the pair, `overlap_name`). With
    neither, every exchange inside the step is exposed and the token permute and
    combine run as passes of their own, as Megatron-LM does.
    `parallel.overlap_chunks` = C: the expert block's tokens run as C independent
    chunks, so its exchanges are pipelined with the block's compute, exposing
    max(0, comm - compute) + min(comm, compute) / C and paying C times the latency
    terms; so are `sp`'s attention all-to-alls (its blocks run in C chunks of the
    batch), while tp's exchanges and the head's stay exposed.
    `parallel.collective_matmul`: the exchanges of the layouts with a ring form (tp's
    blocks, sp's attention, the all-gather expert layouts) run as n-1 point-to-point
    steps per direction, each beside the GEMM on the block at hand; modelled as a
    pipeline of n-1 pieces (C(n-1) inside C chunks) against the block's GEMMs only (the
    attention core needs every block first): one step of each direction stays exposed,
    and the latency terms are the n-1 steps a ring collective pays anyway. Not modelled:
    the SMs the transfers take from the GEMMs, and the GEMM efficiency lost to 1/n-size
    pieces. The paper's own system ("megascale", `PAPER_OVERLAP`, read by
    `moe_jax.plan.paper_table` only, never offered to the trainer) pipelines every
    block's exchange over `Efficiency.overlap_chunks` chunks and fuses the row gather
    and scatter into the grouped GEMM (its intra-operator fusion). All modes overlap
    the data-parallel gradient sync (`param_traffic.hierarchical_sync_bytes`, float32,
    or halved with `Plan.grad_dtype="bfloat16"`) with the last micro-batch's backward,
    except the first layer's share (its gradients are ready last); a pipeline does not.
  * pipeline (`Plan.schedule`), the trainer's (`moe_jax.parallel.pipeline`, "gpipe"):
    GPipe over S stages with R circular repeats, M micro-batches. Only the MoE layer
    stack is pipelined, cut into R S groups; a tick is one group's forward and backward
    for one micro-batch (model.remat inside), its forward once more (each tick is
    rematerialised) and the activation sent on and its cotangent back, over the
    network when the mesh spans nodes (stages are outermost). Step = (M R + S - 1)
    ticks, a bubble of (S-1)/(M R + S - 1) of them, + K = M / S micro-batches of the
    dense prefix and head (every stage runs its K outside the pipeline, no bubble) + the
    (S-1) sends of K micro-batches to stage 0 and back, forward and backward + one
    gradient sum after the whole backward, exposed (each device its stage's 1/S of the
    stack, and the embedding, head and dense prefix, held on every stage, over
    'stage' too) + the optimizer over the stage's parameters. Megatron-LM's and
    MegaScale-MoE's 1F1B ("1f1b", `PAPER_SCHEDULE`, for `moe_jax.plan.paper_table` and
    the Megatron-LM baseline only, never offered to the trainer): layers cut
    contiguously, embedding on the first stage, head on the last, step = (m + p - 1)
    micro-batches of the slowest stage, activations sent every micro-batch.

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
import math

from moe_jax.config import Config
from moe_jax.flops import flops_per_token
from moe_jax.parallel import registry
from moe_jax.parallel.layout import DATA, INTRA, STAGE, axes_of
from moe_jax.plan import comm_volume
from moe_jax.plan.hardware import GPU

# What the trainer runs: parallel.overlap_chunks C ("chunked"), parallel.collective_matmul
# ("collective_matmul"), both, or neither. As a search (`moe_jax.plan.planner.plans`),
# each names the (C, collective matmul) settings it tries, in `SEARCHES`.
OVERLAPS = ("none", "chunked", "collective_matmul", "both")
PAPER_OVERLAP = "megascale"  # the paper's system, for reproducing its table only
CHUNK_CHOICES = (1, 2, 4)  # overlap_chunks the planner tries
SEARCHES = {
    "none": ((1, False),),
    "chunked": tuple((c, False) for c in CHUNK_CHOICES),
    "collective_matmul": ((1, False), (1, True)),
    "both": tuple((c, ring) for c in CHUNK_CHOICES for ring in (False, True)),
    PAPER_OVERLAP: ((1, False),),  # its own chunks (`Efficiency.overlap_chunks`)
}


def overlap_name(chunks: int, collective_matmul: bool, search: str = "") -> str:
    """The mode of `OVERLAPS` that the settings (C, collective matmul) run (the paper's
    system when that is the `search`)."""
    if search == PAPER_OVERLAP:
        return search
    if chunks > 1:
        return "both" if collective_matmul else "chunked"
    return "collective_matmul" if collective_matmul else "none"


GRAD_SYNCS = ("hierarchical", "per_micro_batch")
# Pipeline schedules: the trainer's (GPipe, circular repeats), and the 1F1B of the paper's
# systems, for `moe_jax.plan.paper_table` and the Megatron-LM baseline only.
SCHEDULES = ("gpipe", "1f1b")
PAPER_SCHEDULE = "1f1b"
REPEAT_CHOICES = (1, 2, 4)  # parallel.repeats the planner tries
REMATS = ("", "none", "selective", "offload", "full")
ATTENTION_LAYOUTS = tuple(registry.ATTENTION)
EXPERT_LAYOUTS = tuple(registry.EXPERTS)
PARAM_BYTES = 4  # parameters are float32; fsdp gathers them as stored
ADAM_BYTES_PER_PARAM = 28  # read grad, param, m, v (16); write param, m, v (12)


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
class Plan:
    """One candidate layout: the two block layouts, the mesh and the batch split."""

    attention: str
    experts: str
    intra: int  # n: devices of one intra-node group
    data: int  # data-parallel groups (per pipeline stage)
    pp: int = 1  # pipeline stages
    micro_batch: int = 1  # sequences per micro-batch of one data group
    zero: int = 0  # 1: optimizer state split over data
    etp: int = 2  # experts=ep_etp: devices splitting each expert's width
    overlap: str = "none"  # `overlap_name` of the two settings below, or `PAPER_OVERLAP`
    overlap_chunks: int = 1  # parallel.overlap_chunks (1: no chunks)
    collective_matmul: bool = False  # parallel.collective_matmul
    grad_sync: str = "hierarchical"  # or "per_micro_batch" (the trainer as compiled today)
    remat: str = ""  # "full", "selective" or "none"; "" = the config's model.remat
    grad_dtype: str = "float32"  # of the data-parallel gradient exchange ("bfloat16": halved)
    expert_fsdp: bool = False  # expert weights also split over data, gathered per layer
    repeats: int = 1  # parallel.repeats: groups of the MoE stack each stage holds (circular)
    schedule: str = "gpipe"  # of a pipeline: the trainer's, or `PAPER_SCHEDULE`

    @property
    def devices(self) -> int:
        return self.intra * self.data * self.pp

    @property
    def label(self) -> str:
        return f"{self.attention}+{self.experts}"

    @property
    def pipelined(self) -> bool:
        """Whether the plan runs the trainer's pipeline (`moe_jax.parallel.pipeline`)."""
        return self.pp > 1 and self.schedule == "gpipe"


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


def bubble_fraction(stages: int, micro_batches: int, repeats: int = 1) -> float:
    """Share of a pipeline's ticks a stage idles, (S-1)/(M R + S - 1): the trainer's GPipe
    with R circular repeats (1F1B's (p-1)/(m+p-1) at R = 1)."""
    return (stages - 1) / (micro_batches * repeats + stages - 1)


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


@dataclasses.dataclass(frozen=True)
class StepCost:
    """The prediction for one plan: time, throughput and where the time goes."""

    plan: Plan
    step_s: float
    tokens_per_sec: float
    mfu: float
    micro_batches: int
    micro_batch_s: float  # slowest stage, forward + backward (+ recompute); gpipe: a tick
    breakdown: dict[str, float]  # seconds per step on the critical path; sums to step_s
    hidden: dict[str, float]  # communication seconds per step hidden behind compute

    @property
    def bubble(self) -> float:
        return bubble_fraction(self.plan.pp, self.micro_batches, self.plan.repeats)


Gemm = tuple[float, float, float]  # forward (rows, columns, reduction length) of one GEMM


def tile_factor(reduction: float, eff: Efficiency) -> float:
    """Share of `eff.gemm` a GEMM reaching over `reduction` keeps: each output tile pays a
    fixed prologue and epilogue (`Efficiency.tile_overhead` reduction steps), so short
    reductions (tensor parallelism's 512-deep attention output and 1792-deep expert down
    projections, 768-row weight gradients) run slower than the shapes `gemm` was measured
    on (`Efficiency.reference_reduction` deep); never above 1."""
    k0, ref = eff.tile_overhead, eff.reference_reduction
    return min(1.0, reduction / (reduction + k0) * (ref + k0) / ref)


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
class _Op:
    name: str  # what the breakdown calls it
    kind: str  # which efficiency applies: gemm, grouped_gemm, attention or memory
    flops: float
    bytes: float
    shapes: tuple[Gemm, ...] = ()  # the GEMMs behind `flops`, for `gemm_factor`


@dataclasses.dataclass(frozen=True)
class _Exchange:
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
COMPUTE_KINDS = ("gemm", "grouped_gemm", "attention")  # what exchanges can hide behind
RING_PARTNERS = ("gemm", "grouped_gemm")  # what a collective matmul's steps hide behind


class CostModel:
    """Per-operator, per-exchange costs of one plan of one config on one GPU type."""

    def __init__(
        self, config: Config, plan: Plan, gpu: GPU, global_batch: int, eff: Efficiency
    ) -> None:
        self.config, self.plan, self.gpu, self.eff = config, plan, gpu, eff
        self.global_batch = global_batch
        self.micro_batches = global_batch // (plan.data * plan.micro_batch)
        self.sized = sized_config(config, plan, global_batch)
        m = config.model
        self.B = comm_volume.DTYPE_BYTES[m.dtype]
        self.T = plan.micro_batch * config.train.seq_len  # tokens of a group per micro-batch
        self.t = self.T / plan.intra  # tokens per device
        self.intra = Link(gpu.nvlink_one_way * eff.nvlink, eff.nvlink_latency_s)
        self.network = Link(gpu.network_bandwidth * eff.network, eff.network_latency_s)
        stage_devices = plan.intra * plan.data
        self.data_link = self.network if stage_devices > gpu.gpus_per_node else self.intra
        self.stage_link = self.network if plan.devices > gpu.gpus_per_node else self.intra
        # `comm_volume` reads a micro-batch as batch / (data x grad_accum)
        per_micro_batch = _with_accumulation(self.sized, self.micro_batches)
        self.activation = comm_volume.activation_bytes(per_micro_batch)
        self.mlp_activation = comm_volume.mlp_bytes(per_micro_batch)
        self.attention_spec = registry.attention_spec(self.sized)
        self.expert_spec = registry.expert_spec(self.sized)
        # Devices attention and dense-MLP weights are stored split over (tp: intra, fsdp:
        # data); `_intra_split` is how many ways their GEMMs are split (tp only).
        self.split = {INTRA: plan.intra, DATA: plan.data}.get(self.attention_spec.weights_over, 1)

    # --- operators (forward, one micro-batch, one device) -----------------------------

    def _time(self, op: _Op, backward: bool = False) -> float:
        g, e = self.gpu, self.eff
        memory = op.bytes / (g.hbm_bandwidth * e.memory)
        if op.kind == "memory":
            return memory
        rate = g.peak_flops * getattr(e, op.kind) * gemm_factor(op.shapes, backward, e)
        return max(op.flops / rate, memory)

    def _rows(self) -> float:
        """Rows of a dense GEMM on one device: tp gathers the group's tokens first."""
        return self.T if self.attention_spec.gathers_sequence else self.t

    @property
    def _intra_split(self) -> int:
        """How many ways attention and dense GEMMs are split (tp: over the intra group)."""
        return self.plan.intra if self.attention_spec.weights_over == INTRA else 1

    def attention_ops(self) -> list[_Op]:
        m, t, B = self.config.model, self.t, self.B
        h, hd, heads, kv = m.embed_dim, m.head_dim, m.num_heads, m.num_kv_heads
        weights = h * hd * (2 * heads + 2 * kv)
        split = self._intra_split
        context = (self.config.train.seq_len + 1) / 2  # mean keys per causal query
        qkvo = t * (2 * heads + 2 * kv) * hd * B
        rows = self._rows()
        shapes = ((rows, (heads + 2 * kv) * hd / split, h), (rows, h, heads * hd / split))
        return [
            _Op(
                "dense_gemm",
                "gemm",
                2 * t * weights,
                weights * B / split + qkvo + 2 * t * h * B,
                shapes,
            ),
            _Op("attention_core", "attention", 4 * t * context * heads * hd, qkvo),
            _Op("elementwise", "memory", 0.0, t * (5 * h + 2 * (heads + kv) * hd) * B),
            *self._fp8_casts(qkvo / B if self.attention_spec.compresses_tokens else 0),
        ]

    def mlp_ops(self) -> list[_Op]:
        m, t, B = self.config.model, self.t, self.B
        h, width = m.embed_dim, m.mlp_dim
        split = self._intra_split
        io = t * (2 * h + 3 * width) * B
        shapes = ((self._rows(), 2 * width / split, h), (self._rows(), h, width / split))
        return [
            _Op("dense_gemm", "gemm", 6 * t * h * width, 3 * h * width * B / split + io, shapes),
            _Op("elementwise", "memory", 0.0, t * (5 * h + 3 * width) * B),
        ]

    def moe_ops(self) -> list[_Op]:
        """Router, grouped expert GEMMs, shared experts, and the memory-bound rest. With
        the paper's overlap (`PAPER_OVERLAP`) the row gather and the weighted scatter are
        fused into the grouped GEMM (its intra-operator fusion), so they cost no pass of
        their own."""
        m, e, p, B = self.config.model, self.config.moe, self.plan, self.B
        T, t, n, h, f, k = self.T, self.t, p.intra, m.embed_dim, e.expert_mlp_dim, e.top_k
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
            _Op("dense_gemm", "gemm", 2 * routed * h * e.num_experts, routed * h * B),
            _Op(
                "expert_gemm",
                "grouped_gemm",
                6 * h * f * rows,
                weights * B + (2 * permuted * h + 3 * rows * f) * B,
                expert_shapes,
            ),
            _Op(
                "routing_permute",
                "memory",
                0.0,
                12 * routed * e.num_experts  # softmax and top-k in float32
                + (0 if fused else 4 * permuted * h * B)  # gather rows, scatter back
                + routed * h * B,  # the combined output
            ),
            _Op("elementwise", "memory", 0.0, (5 * t * h + 3 * rows * f + 3 * t * shared) * B),
            *self._fp8_casts(self._received_rows() * h),
        ]
        if shared:
            io = t * (2 * h + 3 * shared) * B
            ops.append(_Op("dense_gemm", "gemm", 6 * t * h * shared, 3 * h * shared * B + io))
        return ops

    def _received_rows(self) -> float:
        """Rows an expert block's dispatch delivers to one device: the group's tokens
        (all-gather forms) or its n static receive buffers."""
        e, p = self.config.moe, self.plan
        if self.expert_spec.gathers_tokens:
            return self.T
        local = e.num_experts // p.intra
        factor = self.config.parallel.a2a_buffer_factor
        return p.intra * self.expert_spec.receive_slots(self.t, e, local, factor)

    def _fp8_casts(self, elements: float) -> list[_Op]:
        """`parallel.token_dtype='fp8'`: quantising what a block sends (read B bytes an
        element, write 1) and dequantising what it receives (read 1, write B), at HBM
        speed; `elements` received per device (sent: the same or fewer)."""
        if self.config.parallel.token_dtype != "fp8" or not elements:
            return []
        return [_Op("fp8_casts", "memory", 0.0, 2 * elements * (self.B + 1))]

    def head_ops(self) -> list[_Op]:
        m, t, B = self.config.model, self.t, self.B
        split = self._intra_split
        weights = m.embed_dim * m.vocab_size
        logits = t * m.vocab_size * 4
        return [
            _Op("dense_gemm", "gemm", 2 * t * weights, weights * B / split + logits),
            _Op("elementwise", "memory", 0.0, 3 * logits),  # softmax cross-entropy
        ]

    # --- exchanges -------------------------------------------------------------------

    def attention_exchanges(self) -> list[_Exchange]:
        p, m, spec = self.plan, self.config.model, self.attention_spec
        out = []
        if spec.exchanges:
            chunks = self.chunks(spec.chunks_batch)
            out.append(
                _Exchange(
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
            out.append(
                self._weight_gather(
                    m.embed_dim * m.head_dim * (2 * m.num_heads + 2 * m.num_kv_heads)
                )
            )
        return out

    def mlp_exchanges(self) -> list[_Exchange]:
        p, m, spec = self.plan, self.config.model, self.attention_spec
        out = []
        if self.mlp_activation:  # tp: all-gather in, reduce-scatter out, as attention
            ring = self.ring(spec.ring)
            out.append(
                _Exchange(
                    "attention_exchange", self.mlp_activation, p.intra, 2, self.intra, 1, ring
                )
            )
        if spec.weights_over == DATA:
            out.append(self._weight_gather(3 * m.embed_dim * m.mlp_dim))
        return out

    def moe_exchanges(self) -> list[_Exchange]:
        p, m, e = self.plan, self.config.model, self.config.moe
        chunks = self.chunks(True)  # every expert layout runs chunked
        ring = self.ring(self.expert_spec.ring_dispatcher is not None)
        exchange = self.activation.experts
        out = [
            _Exchange("expert_exchange", exchange, p.intra, 2 * chunks, self.intra, chunks, ring)
        ]
        if p.expert_fsdp:  # this device's experts (its 1/n of the group's) from 'data'
            out.append(
                self._weight_gather(3 * m.embed_dim * e.expert_mlp_dim * e.num_experts // p.intra)
            )
        return out

    def _weight_gather(self, params: int) -> _Exchange:
        d = self.plan.data
        return _Exchange("weight_gather", params * PARAM_BYTES * (d - 1) / d, d, 1, self.data_link)

    # --- blocks, layers, stages ------------------------------------------------------

    def _pass(self, ops: list[_Op], exchanges: list[_Exchange], backward: bool) -> Tally:
        """One pass of a block: operator times, then its exchanges against its GEMMs."""
        compute: dict[str, float] = {}
        partner = 0.0
        for op in ops:
            seconds = self._time(op, backward) * (BACKWARD[op.kind] if backward else 1.0)
            compute[op.name] = compute.get(op.name, 0.0) + seconds
            partner += seconds if op.kind in COMPUTE_KINDS else 0.0
        gemms = sum(
            self._time(op, backward) * (BACKWARD[op.kind] if backward else 1.0)
            for op in ops
            if op.kind in RING_PARTNERS
        )
        tally = Tally(compute=compute)
        for x in exchanges:
            comm = x.seconds
            paper = self.plan.overlap == PAPER_OVERLAP
            pieces = self.eff.overlap_chunks if paper else x.pieces
            # A ring hides only behind the GEMMs it is cut into (not the attention core).
            shown = exposed(comm, gemms if x.ring else partner, pieces)
            partner = max(0.0, partner - (comm - shown))
            gemms = min(gemms, partner)
            tally.add(Tally(exposed={x.kind: shown}, hidden={x.kind: comm - shown}))
        tally.backward = tally.seconds if backward else 0.0
        return tally

    def chunks(self, chunked: bool) -> int:
        """The trainer's chunks of a block that runs chunked (`parallel.overlap_chunks`),
        else 1; each chunk issues the block's collectives once."""
        return self.plan.overlap_chunks if chunked and self.plan.overlap != PAPER_OVERLAP else 1

    def ring(self, has_ring: bool) -> int:
        """Steps of each direction of a block's exchange under `parallel.collective_matmul`
        (n-1 point-to-point steps), or 0 where the block has no ring form or it is off."""
        return self.plan.intra - 1 if has_ring and self.plan.collective_matmul else 0

    @property
    def remat(self) -> str:
        return self.plan.remat or self.config.model.remat

    def block(self, ops: list[_Op], exchanges: list[_Exchange]) -> Tally:
        """Forward, backward and recompute of one block for one micro-batch: "full" runs
        the whole forward again, exchanges included; "selective" (MegaScale-MoE's selective
        activation rematerialization) only the memory-bound operators, whose outputs are
        large and cheap to rebuild, keeping every GEMM's and exchange's result except
        what `_regathered` names ("offload" recomputes the same)."""
        tally = self._pass(ops, exchanges, backward=False)
        tally.add(self._pass(ops, exchanges, backward=True))
        if self.remat == "full":
            tally.add(self._pass(ops, exchanges, backward=False))
        elif self.remat in ("selective", "offload"):
            memory_bound = [op for op in ops if op.kind == "memory"]
            tally.add(self._pass(memory_bound, self._regathered(exchanges), backward=False))
        return tally

    def _regathered(self, exchanges: list[_Exchange]) -> list[_Exchange]:
        """What selective recomputation gathers again: weights split over data, and
        (tp) the sequence the projections read: the all-gather half of the exchange."""
        out = [x for x in exchanges if x.kind == "weight_gather"]
        if self.attention_spec.gathers_sequence:
            out += [
                dataclasses.replace(x, bytes=x.bytes / 2, count=1)
                for x in exchanges
                if x.kind == "attention_exchange"
            ]
        return out

    def layer(self, moe: bool) -> Tally:
        tally = self.block(self.attention_ops(), self.attention_exchanges())
        if moe:
            tally.add(self.block(self.moe_ops(), self.moe_exchanges()))
        else:
            tally.add(self.block(self.mlp_ops(), self.mlp_exchanges()))
        return tally

    def head_exchanges(self) -> list[_Exchange]:
        """parallel.vocab_parallel: the loss gathers the group's hidden states (bf16) and
        the embedding reduce-scatters its float32 rows, each once per pass."""
        if not self.config.parallel.vocab_parallel:
            return []
        p, h, f = self.plan, self.config.model.embed_dim, (self.plan.intra - 1) / self.plan.intra
        sent = self.T * h * (self.B + 4) * f
        return [_Exchange("attention_exchange", sent, p.intra, 2, self.intra)]

    def head(self) -> Tally:
        """Output head and loss of one micro-batch (outside remat)."""
        tally = self._pass(self.head_ops(), self.head_exchanges(), backward=False)
        tally.add(self._pass(self.head_ops(), self.head_exchanges(), backward=True))
        return tally

    def layer_params(self, moe: bool) -> float:
        """Parameters of one layer on one device (tp splits attention and dense weights
        over the intra group, fsdp over data; experts always over the intra group)."""
        m, e, p = self.config.model, self.config.moe, self.plan
        h = m.embed_dim
        split = self.split
        attention = h * m.head_dim * (2 * m.num_heads + 2 * m.num_kv_heads) / split
        if not moe:
            return attention + 3 * h * m.mlp_dim / split
        shared = 3 * h * e.shared_mlp_dim * e.num_shared_experts / split
        experts = 3 * h * e.expert_mlp_dim * e.num_experts / p.intra
        experts /= p.data if p.expert_fsdp else 1
        return attention + experts + h * e.num_experts + shared

    def table_params(self) -> float:
        """Parameters of the embedding table (or the head) on one device."""
        m = self.config.model
        vocab_split = self.plan.intra if self.config.parallel.vocab_parallel else 1
        return m.vocab_size * m.embed_dim / max(self._intra_split, vocab_split)

    def stage_params(self) -> list[float]:
        """Parameters one device holds on each 1F1B stage: its layers, the embedding on the
        first, the head on the last."""
        m, p = self.config.model, self.plan
        is_moe = [_is_moe_layer(m, i) for i in range(m.num_layers)]
        table = self.table_params()
        out = []
        for s, layers in enumerate(self.stage_layers()):
            ends = (s == 0) + (s == p.pp - 1 and not m.tie_embeddings)
            out.append(sum(self.layer_params(is_moe[i]) for i in layers) + ends * table)
        return out

    def stage_layers(self) -> list[range]:
        """Layers of each stage: the model cut into pp contiguous, near-equal parts."""
        n, pp = self.config.model.num_layers, self.plan.pp
        bounds = [round(s * n / pp) for s in range(pp + 1)]
        return [range(bounds[s], bounds[s + 1]) for s in range(pp)]

    def accumulation_s(self, params: float, passes: int | None = None) -> float:
        """Each of `passes` backward passes (default: one per micro-batch) adds its weight
        gradients into the float32 accumulator: one read and one write of 4 bytes per
        parameter (one write when there is one)."""
        per_param = 8 if (self.micro_batches if passes is None else passes) > 1 else 4
        return params * per_param / (self.gpu.hbm_bandwidth * self.eff.memory)

    def stages(self) -> list[Tally]:
        """Per micro-batch, forward + backward, of each 1F1B pipeline stage."""
        m, p = self.config.model, self.plan
        is_moe = [_is_moe_layer(m, i) for i in range(m.num_layers)]
        layer = {kind: self.layer(kind) for kind in set(is_moe)}
        p2p = 0.0
        if p.pp > 1:  # activations in and gradients back, each this device's tokens
            p2p = 2 * collective_time(self.t * m.embed_dim * self.B, 2, self.stage_link)
        stages = []
        params = self.stage_params()
        for s, layers in enumerate(self.stage_layers()):
            tally = Tally(compute={"grad_accumulation": self.accumulation_s(params[s])})
            for i in layers:
                tally.add(layer[is_moe[i]])
            if s == p.pp - 1:
                tally.add(self.head())
            if p2p:
                tally.add(Tally(exposed={"pipeline_p2p": p2p}))
            stages.append(tally)
        return stages

    def grad_sync_s(self, backward_s: float, stage_layers: int) -> tuple[float, float]:
        """(exposed, hidden) seconds per step of the data-parallel gradient sync of one
        stage. "hierarchical" (the paper): once per step, overlapping the last
        micro-batch's backward except the first layer's share (its gradients are ready
        last). "per_micro_batch" (what XLA compiles for the trainer): an all-reduce
        inside every micro-batch's backward, overlapping it the same way; with
        `parallel.grad_exchange='bf16_a2a'` only FSDP's gathers and their exchange stay
        there, and the summed gradients' exchange runs once, after the backward, exposed."""
        from moe_jax.plan import param_traffic

        p = self.plan
        layers = max(stage_layers, 1)
        window = backward_s * (1 - 1 / layers)
        if p.grad_sync == "per_micro_batch":
            link = self.data_link if p.data > 1 else self.intra
            sent = param_traffic.gradient_bytes_per_step(self.sized) / p.pp / self.micro_batches
            after = 0.0  # parallel.grad_exchange='bf16_a2a': once, after the last backward
            if self.sized.parallel.grad_exchange == "bf16_a2a":
                per_micro_batch, per_step = param_traffic.bf16_a2a_traffic(self.sized)
                sent, after = per_micro_batch / p.pp, per_step / p.pp / link.bandwidth
            once = sent / link.bandwidth
            shown = max(once - window, once / layers) if sent else 0.0
            return shown * self.micro_batches + after, (once - shown) * self.micro_batches
        volume = param_traffic.hierarchical_sync_bytes(self.sized)
        scale = comm_volume.DTYPE_BYTES[p.grad_dtype] / PARAM_BYTES  # bf16 exchange: half
        intra = volume["intra"] * scale / p.pp / self.intra.bandwidth
        inter = volume["inter"] * scale / p.pp / self.data_link.bandwidth
        steps = (p.intra - 1) * 2 * self.intra.latency + (p.data - 1) * 2 * self.data_link.latency
        total = intra + inter + steps * (volume["intra"] + volume["inter"] > 0)
        shown = max(total - window, total / layers)
        return shown, total - shown

    def optimizer_s(self, params: float | None = None) -> float:
        """AdamW update: memory-bound over one device's parameters (default the largest
        1F1B stage's; the moments split over data by ZeRO-1)."""
        params = max(self.stage_params()) if params is None else params
        shards = self.plan.data if self.plan.zero else 1
        bandwidth = self.gpu.hbm_bandwidth * self.eff.memory
        return params / shards * ADAM_BYTES_PER_PARAM / bandwidth

    def step(self) -> StepCost:
        run = self.gpipe_step if self.plan.pipelined else self.one_f_one_b_step
        return self._cost(*run())

    def one_f_one_b_step(self) -> tuple[dict[str, float], dict[str, float], float]:
        """(breakdown, hidden, slowest stage's micro-batch seconds) of m micro-batches
        through 1F1B (no pipeline: one stage)."""
        p = self.plan
        stages = self.stages()
        slowest = max(range(p.pp), key=lambda s: stages[s].seconds)
        stage = stages[slowest]
        t_mb = stage.seconds
        mbs = self.micro_batches
        breakdown = {k: v * mbs for k, v in stage.compute.items()}
        for k, v in stage.exposed.items():
            breakdown[k] = breakdown.get(k, 0.0) + v * mbs
        hidden = {k: v * mbs for k, v in stage.hidden.items()}
        breakdown["bubble"] = (p.pp - 1) * t_mb
        shown, hid = self.grad_sync_s(stages[0].backward, len(self.stage_layers()[0]))
        breakdown["grad_sync"] = shown
        hidden["grad_sync"] = hid
        breakdown["optimizer"] = self.optimizer_s()
        return breakdown, hidden, t_mb

    def _cost(self, breakdown: dict[str, float], hidden: dict[str, float], t_mb: float):
        p, m = self.plan, self.config.model
        step_s = sum(breakdown.values())
        tokens = self.global_batch * self.config.train.seq_len
        model_flops = flops_per_token(m, self.config.moe, self.config.train.seq_len) * tokens
        return StepCost(
            plan=p,
            step_s=step_s,
            tokens_per_sec=tokens / step_s,
            mfu=model_flops / (step_s * p.devices * self.gpu.peak_flops),
            micro_batches=self.micro_batches,
            micro_batch_s=t_mb,
            breakdown=breakdown,
            hidden=hidden,
        )

    # --- the trainer's pipeline (`Plan.schedule` "gpipe") --------------------------

    def units_per_group(self) -> int:
        """MoE units (moe_every - 1 dense layers, one MoE layer) of each of the R S groups."""
        return self.config.model.num_moe_layers // (self.plan.pp * self.plan.repeats)

    def unit(self, forward_only: bool = False) -> Tally:
        """One pipelined unit for one micro-batch: forward, backward and the model's
        recompute, or (`forward_only`) one forward, exchanges included."""
        run = self.layer_forward if forward_only else self.layer
        tally = run(True)
        dense = self.config.model.moe_every - 1
        if dense:
            tally.add(run(False), dense)
        return tally

    def layer_forward(self, moe: bool) -> Tally:
        """One forward of a layer: what rematerialising a tick runs once more."""
        tally = self._pass(self.attention_ops(), self.attention_exchanges(), backward=False)
        if moe:
            tally.add(self._pass(self.moe_ops(), self.moe_exchanges(), backward=False))
        else:
            tally.add(self._pass(self.mlp_ops(), self.mlp_exchanges(), backward=False))
        return tally

    def group_params(self) -> float:
        """Parameters of one group of the stack on one device."""
        dense = (self.config.model.moe_every - 1) * self.layer_params(False)
        return self.units_per_group() * (self.layer_params(True) + dense)

    def outside_params(self) -> float:
        """Parameters every stage holds whole: the embedding, the head (untied) and the
        dense prefix."""
        m = self.config.model
        tables = 1 + (not m.tie_embeddings)
        return tables * self.table_params() + m.first_k_dense * self.layer_params(False)

    def send_s(self, tokens: float) -> float:
        """One collective-permute of `tokens` tokens' hidden states between two stages."""
        sent = tokens * self.config.model.embed_dim * self.B
        return collective_time(sent, 2, self.stage_link)

    def tick(self) -> Tally:
        """One stage at one tick: its group's forward, backward and the model's recompute
        for one micro-batch, the forward once more (each tick is rematerialised), the
        weight gradients added into the step's sum, the activation sent on and its
        cotangent sent back (both wait for the tick's compute and feed the next)."""
        units = self.units_per_group()
        tally = Tally(compute={"grad_accumulation": self.accumulation_s(self.group_params())})
        tally.add(self.unit(), units)
        tally.add(self.unit(forward_only=True), units)
        tally.add(Tally(exposed={"pipeline_p2p": 2 * self.send_s(self.t)}))
        return tally

    def outside(self) -> Tally:
        """The dense prefix and the head of one micro-batch, outside the pipeline."""
        tally = self.head()
        if self.config.model.first_k_dense:
            tally.add(self.layer(False), self.config.model.first_k_dense)
        return tally

    def gpipe_step(self) -> tuple[dict[str, float], dict[str, float], float]:
        """(breakdown, hidden, tick seconds) of the trainer's pipelined step: M R ticks of
        work and S - 1 of bubble, each stage's K = M / S micro-batches outside the
        pipeline, the sends of those to stage 0 and back (forward and backward), one
        exposed gradient sum and the optimizer."""
        p = self.plan
        tick, k = self.tick(), self.micro_batches // p.pp
        total = Tally()
        total.add(tick, self.micro_batches * p.repeats)
        total.add(self.outside(), k)
        breakdown = dict(total.compute)
        for key, value in total.exposed.items():
            breakdown[key] = breakdown.get(key, 0.0) + value
        outside = self.outside_params()
        breakdown["grad_accumulation"] += self.accumulation_s(outside, passes=1)
        breakdown["pipeline_p2p"] += 4 * (p.pp - 1) * self.send_s(k * self.t)
        breakdown["bubble"] = (p.pp - 1) * tick.seconds
        breakdown["grad_sync"] = self.pipeline_sync_s()
        breakdown["optimizer"] = self.optimizer_s(p.repeats * self.group_params() + outside)
        return breakdown, {**total.hidden, "grad_sync": 0.0}, tick.seconds

    def pipeline_sync_s(self) -> float:
        """The pipelined step's gradient sum, exposed: the trainer runs it once, after the
        tick loop's backward. Each device sums its stage's 1/S of the stack over the mesh
        axes the stack is replicated on, and what every stage holds (embedding, head,
        dense prefix) over 'stage' as well."""
        sizes = registry.mesh_sizes(self.sized)
        shards = _shards(_placement_key(self.sized))
        return _sync_time([sent for shard in shards for sent in self._sync(shard, sizes)])

    def _sync(self, shard: _Shard, sizes: dict[str, int]) -> list[tuple[float, int, Link]]:
        """(bytes, group, link) one device sends to sum one parameter's gradient over its
        devices of the intra group, then across 'data' (and 'stage'). `Plan.grad_sync`
        "hierarchical" is the paper's form (intra-node all-reduce, then one of the 1/n
        shard across nodes, in `Plan.grad_dtype`); else the trainer's
        `parallel.grad_exchange`: one float32 all-reduce over the whole group, or
        'bf16_a2a' (bf16 all-to-alls, intra group first, the float32 shards gathered
        back: 3/4 of the paper's float32 bytes), with ZeRO-1's gather of the updated
        parameters. FSDP's gradients are reduce-scattered over 'data' in every
        micro-batch's backward (the transpose of its weight gathers)."""
        p, splits = self.plan, shard.splits
        form = (
            "hierarchical" if p.grad_sync == "hierarchical" else self.sized.parallel.grad_exchange
        )
        dtype = comm_volume.DTYPE_BYTES[p.grad_dtype] / PARAM_BYTES
        size = shard.bytes / (p.pp if shard.piped and STAGE not in splits else 1)
        inner = math.prod(sizes[a] for a in INTRA if a not in splits)
        outer = (1 if DATA in splits else p.data) * (1 if shard.piped else p.pp)
        far = self.data_link if shard.piped else self.stage_link
        out = []
        if DATA in splits:
            passes = self.micro_batches if shard.piped else 1
            scatter = {"fp32": 1.0, "bf16_a2a": 0.5}.get(form, dtype)
            out.append((passes * scatter * size * (p.data - 1), p.data, self.data_link))
        if form == "fp32":
            group = inner * outer
            out.append((2 * size * (group - 1) / group, group, far if outer > 1 else self.intra))
        else:
            scale = 0.75 if form == "bf16_a2a" else dtype
            out.append((scale * 2 * size * (inner - 1) / inner, inner, self.intra))
            out.append((scale * 2 * size / inner * (outer - 1) / outer, outer, far))
        if form != "hierarchical" and p.zero and DATA in shard.moment_splits - splits:
            out.append((size * (p.data - 1) / p.data, p.data, self.data_link))
        return out


@dataclasses.dataclass(frozen=True)
class _Shard:
    """One parameter as a device holds it: what its gradient sum needs."""

    piped: bool  # of the pipelined MoE stack (split over 'stage' when pipelined)
    bytes: int  # on one device (`memory.device_bytes`: a pipelined stack split over 'stage')
    splits: frozenset[str]  # mesh axes it is split over
    moment_splits: frozenset[str]  # those of its optimizer moments (ZeRO-1: 'data')


def _placement_key(sized: Config) -> Config:
    """`sized` without the settings parameter placement ignores (one cache entry for
    every micro-batch and overlap setting of a layout)."""
    parallel = dataclasses.replace(
        sized.parallel, overlap_chunks=1, collective_matmul=False, microbatches=1, repeats=1
    )
    train = dataclasses.replace(sized.train, batch_size=1, grad_accum=1)
    return dataclasses.replace(sized, parallel=parallel, train=train)


@functools.lru_cache(maxsize=1024)
def _shards(config: Config) -> tuple[_Shard, ...]:
    """Every parameter of the train state as one device holds it under `config`."""
    from moe_jax.plan import memory

    return tuple(
        _Shard(
            piped=array.stack == "moe",
            bytes=memory.device_bytes(config, array),
            splits=_axes(memory.placement(config, array)),
            moment_splits=_axes(memory.placement(config, dataclasses.replace(array, moment=True))),
        )
        for array in memory.state_arrays(config)
        if array.part == "params"
    )


def _axes(spec) -> frozenset[str]:
    """Mesh axes a placement splits over."""
    return frozenset(a for entry in spec for a in axes_of(entry))


def _sync_time(traffic: list[tuple[float, int, Link]]) -> float:
    """Bytes over each link, and 2 (g - 1) latency steps for each distinct group (one
    all-reduce-like collective per group: XLA combines a step's reductions over it)."""
    seconds = sum(sent / link.bandwidth for sent, _, link in traffic)
    groups = {(group, link) for sent, group, link in traffic if sent > 0 and group > 1}
    return seconds + sum(2 * (group - 1) * link.latency for group, link in groups)


def _is_moe_layer(m, index: int) -> bool:
    """The model's rule (`ModelConfig.block_of`)."""
    return m.block_of(index)[3]


def _with_accumulation(config: Config, micro_batches: int) -> Config:
    return dataclasses.replace(
        config, train=dataclasses.replace(config.train, grad_accum=micro_batches)
    )


def sized_config(config: Config, plan: Plan, global_batch: int) -> Config:
    """`config` with the plan's layout and a batch split into its micro-batches, the form
    `comm_volume`, the memory model and the layout specs read: the trainer's pipeline
    takes them as parallel.microbatches (train.grad_accum = 1, as it requires), anything
    else as train.grad_accum."""
    micro_batches = global_batch // (plan.data * plan.micro_batch)
    stages = (plan.pp, micro_batches, plan.repeats) if plan.pipelined else (1, 1, 1)
    parallel = dataclasses.replace(
        config.parallel,
        attention=plan.attention,
        experts=plan.experts,
        intra=plan.intra,
        data=plan.data,
        zero=plan.zero,
        etp=plan.etp,
        expert_fsdp=plan.expert_fsdp,
        overlap_chunks=plan.overlap_chunks,
        collective_matmul=plan.collective_matmul,
        stages=stages[0],
        microbatches=stages[1],
        repeats=stages[2],
    )
    accumulation = 1 if plan.pipelined else micro_batches
    train = dataclasses.replace(config.train, batch_size=global_batch, grad_accum=accumulation)
    model = dataclasses.replace(config.model, remat=plan.remat or config.model.remat)
    return dataclasses.replace(config, model=model, parallel=parallel, train=train)


def step_cost(
    config: Config,
    plan: Plan,
    gpu: GPU,
    global_batch: int | None = None,
    eff: Efficiency | None = None,
) -> StepCost:
    """Predicted step of `plan` (global batch in sequences; default train.batch_size)."""
    batch = global_batch or config.train.batch_size
    return CostModel(config, plan, gpu, batch, eff or Efficiency()).step()
