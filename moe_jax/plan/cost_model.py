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
  * pipeline (`Plan.pipeline`), the trainer's ("trainer", `moe_jax.parallel.pipeline`):
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
    'stage' too) + the optimizer over the stage's parameters. 1F1B
    (`parallel.schedule`): the same ticks, the head of the M micro-batches on the
    last stage, the sends to stage 0 and back once, and the last repeats' gradient
    sums in the loop's drain, behind its backward (`GradSync.pipeline_sync_split`).
    Megatron-LM's and MegaScale-MoE's 1F1B (`PAPER_PIPELINE`, for
    `moe_jax.plan.paper_table` and the Megatron-LM baseline only, never offered to the
    trainer): layers cut contiguously, embedding on the first stage, head on the last,
    step = (m + p - 1) micro-batches of the slowest stage, activations sent every
    micro-batch.

Constants: `moe_jax.plan.op_costs` (`Efficiency`).
"""

from __future__ import annotations

import dataclasses
import functools

from moe_jax.config import Config, ParallelConfig
from moe_jax.flops import flops_per_token
from moe_jax.model.mtp import is_moe
from moe_jax.parallel import registry
from moe_jax.parallel.layout import DATA, INTRA
from moe_jax.plan import comm_volume, state_arrays
from moe_jax.plan.grad_sync import GradSync
from moe_jax.plan.hardware import GPU
from moe_jax.plan.muon_cost import MuonCost
from moe_jax.plan.op_costs import (
    COMPUTE_KINDS,
    RING_PARTNERS,
    BlockCosts,
    Efficiency,
    Exchange,
    Link,
    Op,
    Tally,
    backward_factor,
    exposed,
    gemm_factor,
    recomputed,
)
from moe_jax.plan.paper_modes import PAPER_OVERLAP
from moe_jax.plan.schedule import Schedules, bubble_fraction

# What the trainer runs: parallel.overlap_chunks C ("chunked"), parallel.collective_matmul
# ("collective_matmul"), both, or neither. As a search (`moe_jax.plan.planner.plans`),
# each names the (C, collective matmul) settings it tries, in `SEARCHES`.
OVERLAPS = ("none", "chunked", "collective_matmul", "both")
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
REPEAT_CHOICES = (1, 2, 4)  # parallel.repeats the planner tries
REMATS = ("", "none", "selective", "offload", "full")
ATTENTION_LAYOUTS = tuple(registry.ATTENTION)
EXPERT_LAYOUTS = tuple(registry.EXPERTS)


@dataclasses.dataclass(frozen=True)
class Plan:
    """One candidate: the settings the trainer runs (`parallel`, the config's own
    vocabulary, and `grad_accum`, its train.grad_accum) and what only the search and the
    paper's systems need. Micro-batches per step: a pipeline's parallel.microbatches,
    else grad_accum (as `Config.micro_batches` reads them)."""

    parallel: ParallelConfig
    grad_accum: int = 1  # train.grad_accum: micro-batches of a step without a pipeline
    overlap: str = "none"  # `overlap_name` of the parallel settings, or `PAPER_OVERLAP`
    grad_sync: str = "hierarchical"  # or "per_micro_batch" (the trainer as compiled today)
    remat: str = ""  # "full", "selective" or "none"; "" = the config's model.remat
    grad_dtype: str = "float32"  # of the data-parallel gradient exchange ("bfloat16": halved)
    pipeline: str = "trainer"  # whose pipeline: the trainer's, or `PAPER_PIPELINE`

    @property
    def devices(self) -> int:
        p = self.parallel
        return p.intra * p.data * p.stages

    @property
    def label(self) -> str:
        return f"{self.parallel.attention}+{self.parallel.experts}"

    @property
    def pipelined(self) -> bool:
        """Whether the plan runs the trainer's pipeline (`moe_jax.parallel.pipeline`)."""
        return self.parallel.stages > 1 and self.pipeline == "trainer"

    @property
    def micro_batches(self) -> int:
        return self.parallel.microbatches if self.parallel.stages > 1 else self.grad_accum

    def unpipelined(self) -> Plan:
        """The same plan without a pipeline: its micro-batches as accumulation."""
        parallel = dataclasses.replace(self.parallel, stages=1, microbatches=1, repeats=1)
        return dataclasses.replace(self, parallel=parallel, grad_accum=self.micro_batches)

    def config(self, config: Config, global_batch: int) -> Config:
        """`config` as the trainer would run this plan at `global_batch` sequences a step.
        The paper's 1F1B is no schedule of the trainer's: its config is the plan's
        `unpipelined` one (what the layout specs and the memory model read)."""
        if self.parallel.stages > 1 and not self.pipelined:
            return self.unpipelined().config(config, global_batch)
        train = dataclasses.replace(
            config.train, batch_size=global_batch, grad_accum=self.grad_accum
        )
        model = dataclasses.replace(config.model, remat=self.remat or config.model.remat)
        return dataclasses.replace(config, model=model, parallel=self.parallel, train=train)


# The searched `ParallelConfig` fields a plan sets unless given (the rest: the config's).
SEARCHED_DEFAULTS = dict(
    zero=0,
    etp=2,
    expert_fsdp=False,
    overlap_chunks=1,
    collective_matmul=False,
    repeats=1,
    schedule="gpipe",
)


def make_plan(
    config: Config,
    global_batch: int,
    attention: str,
    experts: str,
    intra: int,
    data: int,
    stages: int = 1,
    micro_batch: int = 1,
    search: str = "",
    pipeline: str = "trainer",
    grad_sync: str = "hierarchical",
    remat: str = "",
    grad_dtype: str = "float32",
    **parallel,
) -> Plan:
    """The plan of `config.parallel` with these block layouts, mesh and `micro_batch`
    sequences per micro-batch of a data group (the planner's search variable): a
    pipeline's micro-batches as parallel.microbatches, anything else's as grad_accum;
    `parallel` sets any other `ParallelConfig` field (zero, etp, expert_fsdp,
    overlap_chunks, collective_matmul, repeats). `search` names the overlap search
    (`overlap_name`)."""
    count = global_batch // (data * micro_batch)
    piped = stages > 1
    settings = dataclasses.replace(
        config.parallel,
        layout="manual",
        attention=attention,
        experts=experts,
        intra=intra,
        data=data,
        stages=stages,
        microbatches=count if piped else 1,
        **{**SEARCHED_DEFAULTS, **parallel},
    )
    return Plan(
        settings,
        grad_accum=1 if piped else count,
        overlap=overlap_name(settings.overlap_chunks, settings.collective_matmul, search),
        grad_sync=grad_sync,
        remat=remat,
        grad_dtype=grad_dtype,
        pipeline=pipeline,
    )


@dataclasses.dataclass(frozen=True)
class StepCost:
    """The prediction for one plan: time, throughput and where the time goes."""

    plan: Plan
    step_s: float
    tokens_per_sec: float
    mfu: float
    micro_batches: int
    micro_batch: int  # sequences of one data group's micro-batch
    micro_batch_s: float  # slowest stage, forward + backward (+ recompute); gpipe: a tick
    breakdown: dict[str, float]  # seconds per step on the critical path; sums to step_s
    hidden: dict[str, float]  # communication seconds per step hidden behind compute

    @property
    def bubble(self) -> float:
        """The share of a pipeline's ticks that idle (zero-bubble: of its tick time)."""
        p = self.plan.parallel
        fraction = bubble_fraction(p.stages, self.micro_batches, p.repeats)
        if p.schedule != "zero_bubble" or not self.micro_batch_s:
            return fraction
        idle = self.breakdown.get("bubble", 0.0)
        return idle / (idle + self.micro_batches * p.repeats * self.micro_batch_s)


class CostModel(BlockCosts, Schedules, GradSync, MuonCost):
    """Per-operator, per-exchange costs of one plan of one config on one GPU type."""

    def __init__(
        self, config: Config, plan: Plan, gpu: GPU, global_batch: int, eff: Efficiency
    ) -> None:
        self.config, self.plan, self.gpu, self.eff = config, plan, gpu, eff
        self.global_batch = global_batch
        self.micro_batches = plan.micro_batches
        self.micro_batch = global_batch // (plan.parallel.data * plan.micro_batches)  # sequences
        self.sized = plan.config(config, global_batch)
        m = config.model
        self.B = comm_volume.DTYPE_BYTES[m.dtype]
        self.T = self.micro_batch * config.train.seq_len  # tokens of a group per micro-batch
        self.t = self.T / plan.parallel.intra  # tokens per device
        self.intra = Link(gpu.nvlink_one_way * eff.nvlink, eff.nvlink_latency_s)
        self.network = Link(gpu.network_bandwidth * eff.network, eff.network_latency_s)
        stage_devices = plan.parallel.intra * plan.parallel.data
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
        self.split = {INTRA: plan.parallel.intra, DATA: plan.parallel.data}.get(
            self.attention_spec.weights_over, 1
        )

    # --- operators (forward, one micro-batch, one device) -----------------------------

    def _time(self, op: Op, backward: bool = False) -> float:
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
        return self.plan.parallel.intra if self.attention_spec.weights_over == INTRA else 1

    # --- blocks, layers, stages ------------------------------------------------------

    def _pass(self, ops: list[Op], exchanges: list[Exchange], backward: bool) -> Tally:
        """One pass of a block: operator times, then its exchanges against its GEMMs."""
        compute: dict[str, float] = {}
        partner = gemms = 0.0
        for op in ops:
            seconds = self._time(op, backward) * (backward_factor(op) if backward else 1.0)
            compute[op.name] = compute.get(op.name, 0.0) + seconds
            partner += seconds if op.kind in COMPUTE_KINDS else 0.0
            gemms += seconds if op.kind in RING_PARTNERS else 0.0
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
        return (
            self.plan.parallel.overlap_chunks
            if chunked and self.plan.overlap != PAPER_OVERLAP
            else 1
        )

    def ring(self, has_ring: bool) -> int:
        """Steps of each direction of a block's exchange under `parallel.collective_matmul`
        (n-1 point-to-point steps), or 0 where the block has no ring form or it is off."""
        return (
            self.plan.parallel.intra - 1 if has_ring and self.plan.parallel.collective_matmul else 0
        )

    @property
    def remat(self) -> str:
        return self.plan.remat or self.config.model.remat

    def block(self, ops: list[Op], exchanges: list[Exchange]) -> Tally:
        """Forward, backward and recompute of one block for one micro-batch: "full" runs
        the whole forward again, exchanges included; "selective" (MegaScale-MoE's selective
        activation rematerialization) only the memory-bound operators, whose outputs are
        large and cheap to rebuild, keeping every GEMM's and exchange's result except
        what `_regathered` names ("offload" recomputes the same)."""
        tally = self._pass(ops, exchanges, backward=False)
        tally.add(self._pass(ops, exchanges, backward=True))
        if self.remat == "full":
            tally.add(self._pass(recomputed(ops), exchanges, backward=False))
        elif self.remat in ("selective", "offload"):
            memory_bound = [op for op in ops if op.kind == "memory"]
            tally.add(self._pass(memory_bound, self._regathered(exchanges), backward=False))
        return tally

    def _regathered(self, exchanges: list[Exchange]) -> list[Exchange]:
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

    def head_exchanges(self) -> list[Exchange]:
        """parallel.vocab_parallel: the loss gathers the group's hidden states (bf16) and
        the embedding reduce-scatters its float32 rows, each once per pass."""
        if not self.plan.parallel.vocab_parallel:
            return []
        p, h, f = (
            self.plan.parallel,
            self.config.model.embed_dim,
            (self.plan.parallel.intra - 1) / self.plan.parallel.intra,
        )
        sent = self.T * h * (self.B + 4) * f
        return [Exchange("attention_exchange", sent, p.intra, 2, self.intra)]

    def head(self) -> Tally:
        """Output head and loss of one micro-batch (outside remat), and the model.mtp_depth
        multi-token-prediction modules that follow it (`mtp`)."""
        tally = self._pass(self.head_ops(), self.head_exchanges(), backward=False)
        tally.add(self._pass(self.head_ops(), self.head_exchanges(), backward=True))
        for depth in range(1, self.config.model.mtp_depth + 1):
            tally.add(self.mtp(depth))
        return tally

    def mtp(self, depth: int) -> Tally:
        """MTP module `depth` of one micro-batch: eh_proj [2d, d] on each device's tokens,
        its block (dense or MoE, as `mtp.is_moe`), and the shared head and loss once more.
        Every stage holds the modules and runs them after the stack, as it does the head."""
        m, t, B = self.config.model, self.t, self.B
        h = m.embed_dim
        proj = [Op("dense_gemm", "gemm", 4 * t * h * h, 2 * h * h * B + 3 * t * h * B)]
        tally = self._pass(proj, [], backward=False)
        tally.add(self._pass(proj, [], backward=True))
        tally.add(self.layer(is_moe(m, depth)))
        tally.add(self._pass(self.head_ops(), self.head_exchanges(), backward=False))
        tally.add(self._pass(self.head_ops(), self.head_exchanges(), backward=True))
        return tally

    @functools.cached_property
    def _block_params(self) -> dict[str, float]:
        return state_arrays.block_params(self.sized)

    def layer_params(self, moe: bool) -> float:
        """Parameters of one layer on one device, as the plan places the train state's
        arrays (`state_arrays.block_params`)."""
        return self._block_params.get("moe" if moe else "dense", 0.0)  # 0: none such

    def table_params(self) -> float:
        """Parameters of the embedding table (or the head) on one device."""
        return self._block_params["table"]

    def accumulation_s(self, params: float, passes: int | None = None) -> float:
        """Each of `passes` backward passes (default: one per micro-batch) adds its weight
        gradients into the float32 accumulator: one read and one write of 4 bytes per
        parameter (one write when there is one)."""
        per_param = 8 if (self.micro_batches if passes is None else passes) > 1 else 4
        return params * per_param / (self.gpu.hbm_bandwidth * self.eff.memory)

    def step(self) -> StepCost:
        run = self.gpipe_step if self.plan.pipelined else self.one_f_one_b_step
        return self._cost(*run())

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
            micro_batch=self.micro_batch,
            micro_batch_s=t_mb,
            breakdown=breakdown,
            hidden=hidden,
        )


def _with_accumulation(config: Config, micro_batches: int) -> Config:
    return dataclasses.replace(
        config, train=dataclasses.replace(config.train, grad_accum=micro_batches)
    )


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
