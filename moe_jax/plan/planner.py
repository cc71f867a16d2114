"""The planner: every layout that can run, dropped when it does not fit, ranked by the
cost model's step time, and the winner explained.

Why: which layout is fastest depends on the model's shape (expert width, top-k,
heads), the batch and the cluster (NVLink against network, memory); the cost
model says so term by term, so the choice can be read and argued with.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import math
from collections.abc import Callable, Iterator

from moe_jax.config import Config, ParallelConfig
from moe_jax.names import PIPELINE_SCHEDULES
from moe_jax.parallel import registry
from moe_jax.parallel.layout import DATA
from moe_jax.plan import cost_model
from moe_jax.plan.breakdown import COMPUTE, EXCHANGES
from moe_jax.plan.cost_model import (
    ATTENTION_LAYOUTS,
    EXPERT_LAYOUTS,
    Efficiency,
    Plan,
    StepCost,
)
from moe_jax.plan.hardware import GPU, get
from moe_jax.plan.paper_modes import PAPER_PIPELINE

# Share of a GPU's memory a plan may fill: the CUDA context, NCCL buffers and
# allocator fragmentation take the rest (several GB on an 80 GB part).
USABLE_MEMORY = 0.9
INTRA_SIZES = (1, 2, 4, 8)
MAX_MICRO_BATCH = 16  # sequences; larger ones only grow the pipeline bubble


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A plan with its predicted step and its memory per device (None: not checked)."""

    cost: StepCost
    memory: object | None  # moe_jax.plan.memory.Memory: params, grads, optimizer, activations

    @property
    def plan(self) -> Plan:
        return self.cost.plan


@dataclasses.dataclass(frozen=True)
class Ranking:
    """Plans that fit, fastest first. Memory is checked in rank order, so
    `dropped_for_memory` counts the plans faster than the last one listed that did
    not fit; `plans` counts every plan the divisibility rules allow."""

    candidates: list[Candidate]
    dropped_for_memory: int
    plans: int
    smallest_dropped: float  # bytes per device of the leanest dropped plan (inf: none)
    gpu: GPU
    gpus: int
    global_batch: int

    @property
    def best(self) -> Candidate:
        if not self.plans:
            raise ValueError(
                f"no layout splits {self.gpus} GPUs and a batch of {self.global_batch} "
                "sequences (intra group, pipeline stages, heads, experts and batch must divide)"
            )
        if not self.candidates:
            need = f"; the leanest needs {self.smallest_dropped / 1e9:.0f} GB per device"
            raise ValueError(
                f"no plan fits {self.gpus} x {self.gpu.name} ({self.plans} plans, "
                f"{self.dropped_for_memory} dropped for memory"
                + (need if self.dropped_for_memory else "")
                + f", {self.gpu.memory_bytes * USABLE_MEMORY / 1e9:.0f} GB usable)"
            )
        return self.candidates[0]


def _divisors(value: int, most: int | None = None) -> list[int]:
    """The divisors of `value` (up to `most`), ascending; in O(sqrt(value)) steps, so a
    huge cluster or batch is answered at once."""
    small = [d for d in range(1, math.isqrt(value) + 1) if value % d == 0]
    found = sorted(set(small) | {value // d for d in small})
    return [d for d in found if most is None or d <= most]


def problem(
    config: Config, plan: Plan, global_batch: int, gpu: GPU, platform: str = "gpu"
) -> str | None:
    """Why `plan` cannot run (the layout specs' own checks, as the trainer applies them,
    the pipeline's among them, plus the cluster's: a node's size, the pipeline's depth),
    or None. A pipelined plan must also run as one of its micro-batches would without a
    pipeline: each tick runs one through the same blocks."""
    m, p = config.model, plan.parallel
    n, d = p.intra, p.data
    if n > gpu.gpus_per_node:
        return f"intra group of {n} spans nodes"
    if p.stages > m.num_layers:
        return f"{p.stages} stages for {m.num_layers} layers"
    if p.repeats > 1 and not plan.pipelined:
        return f"{p.repeats} repeats without the trainer's pipeline"
    if global_batch % (d * plan.micro_batches):
        return f"batch {global_batch} does not split into {d} x {plan.micro_batches} micro-batches"
    run = plan.config(config, global_batch)
    found = registry.problems(run, run.parallel.stages * n * d, platform)
    if not found and plan.pipelined:  # one micro-batch of a tick, run without the pipeline
        flat = plan.unpipelined().config(config, global_batch)
        found = registry.problems(flat, n * d, platform)
    return found[0] if found else None


def _stages(config: Config, gpus: int, pp: int | None, pipeline: str) -> list[int]:
    """Pipeline depths to search: the trainer's pipelines its MoE layer stack (at least
    one unit per stage), 1F1B cuts all layers evenly (as Megatron-LM requires)."""
    if pp:
        return [pp]
    m = config.model
    if pipeline == PAPER_PIPELINE:
        return [s for s in _divisors(gpus) if m.num_layers % s == 0]
    units = m.num_moe_layers
    return [s for s in _divisors(gpus) if s == 1 or (units % s == 0 and units >= s)]


def _repeats(config: Config, pp: int, pipeline: str) -> list[int]:
    """parallel.repeats to search: R groups of the stack per stage, each of whole units."""
    if pp == 1 or pipeline == PAPER_PIPELINE:
        return [1]
    units = config.model.num_moe_layers
    return [r for r in cost_model.REPEAT_CHOICES if units % (pp * r) == 0 and units >= pp * r]


def _schedules(pp: int, pipeline: str) -> tuple[str, ...]:
    """parallel.schedule to search: both of the trainer's where it pipelines."""
    if pp == 1 or pipeline == PAPER_PIPELINE:
        return ("gpipe",)
    return PIPELINE_SCHEDULES


def plans(
    config: Config,
    gpus: int,
    gpu: GPU,
    global_batch: int,
    pp: int | None = None,
    overlap: str = "both",
    attention: tuple[str, ...] = ATTENTION_LAYOUTS,
    experts: tuple[str, ...] = EXPERT_LAYOUTS,
    intra: tuple[int, ...] = INTRA_SIZES,
    micro_batches: int | None = None,
    micro_batch: int | None = None,
    grad_sync: str = "hierarchical",
    remat: str = "",
    grad_dtype: str = "float32",
    pipeline: str = "trainer",
    min_pp: int = 1,
) -> Iterator[Plan]:
    """Every plan the trainer's rules allow (memory not yet checked). With data
    parallelism ZeRO-1 and the distributed optimizer are both tried (`_zeros`).
    Pipelines are the trainer's (GPipe or 1F1B, `parallel.schedule`, with
    `cost_model.REPEAT_CHOICES` circular repeats where the MoE stack divides) or, for the
    paper's systems only, 1F1B (`PAPER_PIPELINE`); `micro_batches`
    fixes the micro-batches per step, `micro_batch` the sequences in each; `grad_sync`
    picks the gradient sync model, `remat` the recompute ("" = the config's; the memory
    model follows it), `grad_dtype` the precision of the gradient exchange and `overlap`
    the overlap settings tried (`cost_model.SEARCHES`; "both": all the trainer runs);
    `min_pp` leaves out shallower pipelines."""
    for p in (s for s in _stages(config, gpus, pp, pipeline) if s >= min_pp):
        for n in intra:
            if gpus % (n * p):
                continue
            data = gpus // (n * p)
            per_group = global_batch // data if global_batch % data == 0 else 0
            sizes = _divisors(per_group, MAX_MICRO_BATCH) if per_group else []
            if micro_batches:
                sizes = [per_group // micro_batches] if per_group % micro_batches == 0 else []
            if micro_batch:
                sizes = [b for b in sizes if b == micro_batch]
            if p > 1 and pipeline != PAPER_PIPELINE:  # each stage takes M / S
                sizes = [b for b in sizes if b > 0 and (per_group // b) % p == 0]
            kinds = _layouts(n, data, attention, experts)
            # Expert weights over 'data' too, where there is data parallelism.
            fsdp = (False, True) if data > 1 else (False,)
            # A ring over one device is no ring: the plan without it stands for it.
            overlaps = [o for o in cost_model.SEARCHES[overlap] if n > 1 or not o[1]]
            for (att, exp, etp), b, split, (c, ring), r, zero in (
                (k, b, f, o, r, z)
                for z in _zeros(data, pipeline, grad_sync)
                for k in kinds
                for b in sizes
                if b > 0
                for f in fsdp
                for o in overlaps
                for r in _repeats(config, p, pipeline)
            ):
                plan = cost_model.make_plan(
                    config,
                    global_batch,
                    att,
                    exp,
                    n,
                    data,
                    stages=p,
                    micro_batch=b,
                    search=overlap,
                    pipeline=pipeline,
                    grad_sync=grad_sync,
                    remat=remat,
                    grad_dtype=grad_dtype,
                    zero=zero,
                    etp=etp,
                    overlap_chunks=c,
                    collective_matmul=ring,
                    expert_fsdp=split,
                    repeats=r,
                )
                if problem(config, plan, global_batch, gpu) is None:
                    for schedule in _schedules(p, pipeline):  # the same problems
                        parallel = dataclasses.replace(plan.parallel, schedule=schedule)
                        yield dataclasses.replace(plan, parallel=parallel)


def _zeros(data: int, pipeline: str, grad_sync: str) -> tuple[int, ...]:
    """ZeRO settings tried: with data parallelism ZeRO-1 (the optimizer state split; the
    paper's sync moves an all-reduce's bytes with it) and the distributed optimizer
    (`parallel.zero=2`: float32 masters split too, bf16 compute copies gathered); not
    for the paper's systems, whose optimizer the paper fixes. Under the trainer's sync
    (`per_micro_batch`) ZeRO 0 too: there ZeRO-1 all-gathers the updated float32 weights
    after the gradients' all-reduce, bytes that ZeRO 0's memory may save."""
    if data == 1:
        return (0,)
    if pipeline == PAPER_PIPELINE:
        return (1,)
    return (0, 1, 2) if grad_sync == "per_micro_batch" else (1, 2)


def _layouts(n: int, data: int, attention: tuple[str, ...], experts: tuple[str, ...]):
    """(attention, experts, etp) triples, without duplicates: with n = 1 every layout is
    plain data parallelism (only those splitting the batch over all devices remain, with
    one expert layout), and weights split over one data group are not split (plain data
    parallelism, where it is listed, stands for them)."""
    specs = [registry.ATTENTION[a] for a in attention]
    plain = any(s.weights_over is None and not s.seq_axes for s in specs)
    if data == 1 and plain:
        specs = [s for s in specs if s.weights_over != DATA]
    if n == 1:
        return [(s.name, experts[0], 2) for s in specs if not s.seq_axes]
    return [
        (s.name, x, etp)
        for s in specs
        for x in experts
        for etp in registry.EXPERTS[x].etp_choices(n)
    ]


# Predictions are pure functions of frozen settings: the trainer's `layout=auto` after
# `python -m moe_jax.plan` in one process (its tests) ranks the same plans once.
_step_cost = functools.lru_cache(maxsize=1 << 17)(cost_model.step_cost)


def fits(memory, gpu: GPU) -> bool:
    return memory.total <= gpu.memory_bytes * USABLE_MEMORY


def rank(
    config: Config,
    gpus: int,
    gpu: GPU | str,
    global_batch: int | None = None,
    pp: int | None = None,
    overlap: str = "both",
    eff: Efficiency | None = None,
    limit: int | None = None,
    check_memory: bool = True,
    accept: Callable[[Plan], bool] | None = None,
    **restrict,
) -> Ranking:
    """Plans fastest first, each checked for memory in that order until `limit` fit
    (None: all); restrict the search with attention=, experts=, intra=, micro_batches=,
    min_pp= (`plans`), or with `accept`, asked of each plan in rank order before its memory."""
    gpu = get(gpu) if isinstance(gpu, str) else gpu
    batch = global_batch or config.train.batch_size
    eff = eff or Efficiency()
    costs = [
        _step_cost(config, plan, gpu, batch, eff)
        for plan in plans(config, gpus, gpu, batch, pp, overlap, **restrict)
    ]
    costs.sort(key=_order)
    kept, dropped, smallest = [], 0, math.inf
    too_big: dict[Plan, int] = {}  # plan, micro-batches zeroed -> smallest that did not fit
    for i, cost in enumerate(costs):  # `costs` may grow behind i (a shallower stash)
        if limit is not None and len(kept) >= limit:
            break
        plan = cost.plan
        if accept is not None and not accept(plan):
            continue
        key = dataclasses.replace(
            plan, parallel=dataclasses.replace(plan.parallel, microbatches=0), grad_accum=0
        )
        if check_memory and cost.micro_batch >= too_big.get(key, math.inf):
            dropped += 1  # memory only grows with the micro-batch
            continue
        memory = _memory(config, plan, batch) if check_memory else None
        if memory is not None and not fits(memory, gpu):
            dropped += 1
            smallest = min(smallest, memory.total)
            too_big[key] = min(cost.micro_batch, too_big.get(key, math.inf))
            if (shallower := _shallower_stash(config, plan, gpu, batch)) is not None:
                shallower_cost = _step_cost(config, shallower, gpu, batch, eff)
                bisect.insort(costs, shallower_cost, i + 1, key=_order)
            continue
        kept.append(Candidate(cost, memory))
    return Ranking(kept, dropped, len(costs), smallest, gpu, gpus, batch)


def _order(cost: StepCost) -> tuple:
    return round(cost.step_s, 9), cost.plan.label, cost.plan.parallel.etp


def _shallower_stash(config: Config, plan: Plan, gpu: GPU, batch: int) -> Plan | None:
    """A zero-bubble plan whose stash (S - 1 deep) does not fit, with the deepest
    `parallel.stash_depth` that does (each tick of depth one item of stash, one W out
    of the bubble), or None. Memory grows with the depth: a bisection."""
    p = plan.parallel
    if p.schedule != "zero_bubble" or p.stash_depth or p.stages < 3:
        return None
    deep = lambda d: dataclasses.replace(plan, parallel=dataclasses.replace(p, stash_depth=d))
    low, high = 0, p.stages - 1  # fits at low (0 standing for 1F1B's), not at high
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(_memory(config, deep(mid), batch), gpu) else (low, mid)
    return deep(low) if low else None


def _memory(config: Config, plan: Plan, batch: int):
    from moe_jax.plan.memory import memory_per_device

    # A 1F1B plan's stages are modelled as the trainer's pipeline of as many holds them.
    held = dataclasses.replace(plan, pipeline="trainer")
    return memory_per_device(held.config(config, batch))


def megatron_baseline(
    config: Config,
    gpus: int,
    gpu: GPU | str,
    global_batch: int | None = None,
    pp: int | None = None,
    eff: Efficiency | None = None,
    check_memory: bool = True,
    micro_batch: int | None = None,
) -> Ranking:
    """Megatron-LM as the paper ran it: tensor parallelism over the node (n = 8) for
    attention (with sequence-parallel norms) and experts, no token-exchange overlap,
    its 1F1B pipeline."""
    gpu = get(gpu) if isinstance(gpu, str) else gpu
    n = gpu.gpus_per_node
    return rank(
        config,
        gpus,
        gpu,
        global_batch,
        pp,
        "none",
        eff,
        limit=1,
        check_memory=check_memory,
        attention=("tp",),
        experts=("etp",),
        intra=(n,),
        micro_batch=micro_batch,
        pipeline=PAPER_PIPELINE,
    )


def choose_plan(
    config: Config, num_devices: int, gpu: GPU | str = "h800", platform: str | None = None
) -> ParallelConfig:
    """The fastest plan the trainer can run on `num_devices` devices of `platform`
    (default: this process's backend), as the `config.parallel` to run, its pipeline's
    settings among them: `python -m moe_jax.plan`'s first plan for the same GPU preset,
    devices and batch (one search, one order, gradients synced as the trainer compiles
    them), less the plans this config does not take. The batch and `train.grad_accum`
    stay as configured: a pipeline only where grad_accum is 1 (its micro-batches are the
    accumulation), none otherwise; and plans the layout specs reject for these devices
    are skipped."""
    if platform is None:
        import jax  # only the trainer's path needs the backend

        platform = jax.default_backend()
    batch = config.train.batch_size

    def runs(plan: Plan) -> bool:
        if plan.grad_accum != config.train.grad_accum:
            return False
        return not registry.problems(plan.config(config, batch), num_devices, platform)

    # `parallel.gpu` only names the preset: ranked without it, as the planner ranks
    searched = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, gpu=""))
    # with accumulation, only the plans without a pipeline of that many micro-batches
    fewer = (
        {} if config.train.grad_accum == 1 else dict(pp=1, micro_batches=config.train.grad_accum)
    )
    sync = dict(grad_sync="per_micro_batch")
    ranking = rank(searched, num_devices, gpu, batch, accept=runs, limit=1, **sync, **fewer)
    best = ranking.best.plan.parallel
    return dataclasses.replace(best, gpu=config.parallel.gpu)


def compute_comm_ratio(config: Config, gpu: GPU | str, n: int | None = None) -> float:
    """The paper's scale-up criterion (its "R"; printed as "ratio" here, where R names the
    pipeline's repeats) = 3/2 * h_ffn * bandwidth / peak * n / (n - 1): expert GEMM time
    over the time to exchange its tokens (NVLink bandwidth as datasheets quote it, as the
    paper does). Above 1: the exchange can hide behind the expert GEMMs."""
    gpu = get(gpu) if isinstance(gpu, str) else gpu
    n = n or gpu.gpus_per_node
    h_ffn = config.moe.expert_mlp_dim
    return 1.5 * h_ffn * gpu.nvlink_bandwidth / gpu.peak_flops * n / (n - 1)


def verdict(ratio: float) -> str:
    if ratio > 1:
        return "ratio > 1: token exchange can hide behind the expert GEMMs"
    return "ratio < 1: the expert GEMMs are too short to hide the token exchange"


def explain(candidate: Candidate, gpu: GPU, runner_up: Candidate | None = None) -> list[str]:
    """Where the winner's step goes, and what it gains over the best other layout."""
    cost, mem = candidate.cost, candidate.memory
    b, step = cost.breakdown, cost.step_s
    share = lambda key: f"{b.get(key, 0.0):.4g} s ({b.get(key, 0.0) / step:.0%})"
    compute = sum(b.get(k, 0.0) for k in COMPUTE)
    comm = sum(b.get(k, 0.0) for k in EXCHANGES)
    p = cost.plan
    lines = [
        f"why {p.label} (intra={p.parallel.intra}, stages={p.parallel.stages}, "
        f"repeats={p.parallel.repeats}, data={p.parallel.data}, {cost.micro_batches} "
        f"micro-batches of {cost.micro_batch} sequences): step {step:.4g} s",
        f"  compute {compute:.4g} s: " + ", ".join(f"{k} {share(k)}" for k in COMPUTE if b.get(k)),
        f"  exposed communication {comm:.4g} s: "
        + (", ".join(f"{k} {share(k)}" for k in EXCHANGES if b.get(k)) or "none"),
        "  hidden behind compute: "
        + (", ".join(f"{k} {v:.4g} s" for k, v in cost.hidden.items() if v > 0) or "nothing"),
        f"  pipeline bubble {share('bubble')}: {_bubble(cost)}",
    ]
    if mem is not None:
        lines.append(
            f"  memory per device {mem.total / 1e9:.1f} of {gpu.memory_bytes / 1e9:.0f} GB "
            f"(params {mem.params / 1e9:.1f}, grads {mem.grads / 1e9:.1f}, optimizer "
            f"{mem.optimizer / 1e9:.1f}, activations {mem.activations / 1e9:.1f})"
        )
    if runner_up is not None:
        other = runner_up.cost
        deltas = {
            k: other.breakdown.get(k, 0.0) - b.get(k, 0.0) for k in set(b) | set(other.breakdown)
        }
        big = [kv for kv in sorted(deltas.items(), key=lambda kv: -abs(kv[1])) if kv[1]]
        big = [kv for kv in big if abs(kv[1]) > 1e-3 * step]
        lines.append(
            f"  vs the best other layout, {other.plan.label} (intra={other.plan.parallel.intra}, "
            f"{other.step_s:.4g} s, {other.step_s / step:.2f}x): "
            + (", ".join(f"{k} {v:+.3g} s" for k, v in big[:3]) or "no term differs")
        )
    return lines


def _bubble(cost: StepCost) -> str:
    """The bubble's share of a stage's ticks (or 1F1B micro-batches), by its formula."""
    p, m = cost.plan, cost.micro_batches
    if p.parallel.stages == 1:
        return "no pipeline"
    if not p.pipelined:
        stages = f"p={p.parallel.stages}, m={m}"
        return f"{cost.bubble:.1%} of each stage's time (1F1B, (p-1)/(m+p-1), {stages})"
    depth = p.parallel.stash_depth or p.parallel.stages - 1
    full = (p.parallel.stages - 1) * cost.micro_batch_s  # 1F1B's: S - 1 ticks of T
    taken = full - cost.breakdown.get("bubble", 0.0)
    zb = f"tick time ((S-1)T - D W: 1F1B's {full:.4g} s less {taken:.4g} s, D={depth} W,"
    formula = zb if p.parallel.schedule == "zero_bubble" else "ticks ((S-1)/(M R + S - 1),"
    return (
        f"{cost.bubble:.1%} of the pipelined {formula} S={p.parallel.stages} stages, "
        f"M={m} micro-batches, R={p.parallel.repeats} repeats)"
    )


def runner_up(ranking: Ranking) -> Candidate | None:
    """The fastest plan whose layout pair differs from the winner's and which is slower
    (layouts that tie, moving the same bytes, explain nothing)."""
    best = ranking.best
    pair = (best.plan.parallel.attention, best.plan.parallel.experts)
    for c in ranking.candidates[1:]:
        slower = c.cost.step_s > best.cost.step_s * (1 + 1e-9)
        if slower and (c.plan.parallel.attention, c.plan.parallel.experts) != pair:
            return c
    return None
