"""What `python -m moe_jax.plan` prints around its ranking: the GPU preset, the table in
the trainer's own names, a legend of every column and the flags that run the winner.

Why: a ranking is only useful if a user can read every column without the source and
launch the plan it recommends by pasting one line; each column header is the trainer's
setting it shows, so no symbol means two things.
"""

from __future__ import annotations

import dataclasses

from moe_jax.config import Config
from moe_jax.parallel import registry
from moe_jax.plan import planner
from moe_jax.plan.describe import flag_line
from moe_jax.plan.hardware import GPU

BASELINE_TAG = "meg"  # the Megatron-LM row's tag in the '#' column

HEAD = (
    f"{'#':>3} {'plan':<26}{'intra':>6}{'stages':>7}{'repeats':>8}{'data':>6}{'zero':>5}"
    f"{'microbatches':>13}{'seqs':>5}{'step ms':>11}{'tokens/s':>13}{'MFU':>7}{'bubble':>8}"
    f"{'comm ms':>10}{'mem GB':>8}"
)

LEGEND = (
    "columns:",
    f"  #             rank by predicted step time ({BASELINE_TAG}: the Megatron-LM baseline)",
    "  plan          parallel.attention+parallel.experts, then /E: parallel.etp=E (ep_etp: "
    "devices splitting each expert's width), +fsdp: parallel.expert_fsdp=True, +cN: "
    "parallel.overlap_chunks=N, +cm: parallel.collective_matmul=True, +1f1b: "
    "parallel.schedule=1f1b, +zb: parallel.schedule=zero_bubble (+zbD: parallel.stash_depth=D)",
    "  intra         parallel.intra: devices of one intra-node group (experts and sequences "
    "split there)",
    "  stages        parallel.stages: pipeline stages (S; 1: no pipeline)",
    "  repeats       parallel.repeats: circular repeats, layer groups per stage (R)",
    "  data          parallel.data: data-parallel groups",
    "  zero          parallel.zero: 1 splits the optimizer state over the data groups",
    "  microbatches  micro-batches per step (M): parallel.microbatches with a pipeline, "
    "train.grad_accum without",
    "  seqs          sequences in one micro-batch of a data group: global batch / (data x "
    "microbatches)",
    "  step ms       predicted time of one training step",
    "  tokens/s      predicted tokens per second, the whole cluster",
    "  MFU           model FLOPs per second over the preset's peak, all GPUs",
    "  bubble        share of a pipeline's ticks that idle: (S-1)/(M R + S - 1)",
    "  comm ms       communication per step left exposed (not hidden behind compute)",
    "  mem GB        predicted memory per device: parameters, gradients, optimizer state, "
    "activations",
)


def header(key: str, gpu: GPU) -> str:
    """The preset's datasheet figures, which every number below derives from."""
    return (
        f"GPU preset {key}: {gpu.name}, {gpu.memory_bytes / 1e9:.0f} GB, "
        f"{gpu.peak_flops / 1e12:.0f} TFLOP/s dense BF16, HBM {gpu.hbm_bandwidth / 1e12:.3g} "
        f"TB/s, NVLink {gpu.nvlink_bandwidth / 1e9:.0f} GB/s (both directions), network "
        f"{gpu.network_bandwidth / 1e9:.0f} GB/s per GPU each way, {gpu.gpus_per_node} GPUs "
        "per node"
    )


def ratio_line(config: Config, gpu: GPU, ratio: float) -> str:
    """The paper's scale-up criterion (its R; "ratio" here, R being the repeats)."""
    return (
        "compute/communication ratio = 3/2 h_ffn B/P n/(n-1) (h_ffn="
        f"{config.moe.expert_mlp_dim} expert width, B={gpu.nvlink_bandwidth / 1e9:.0f} GB/s "
        f"NVLink, P={gpu.peak_flops / 1e12:.0f} TFLOP/s, n={gpu.gpus_per_node} GPUs per node) "
        f"= {ratio:.2f}: {planner.verdict(ratio)}"
    )


def table(ranking: planner.Ranking, top: int) -> list[str]:
    return [HEAD, *(row(str(i), c) for i, c in enumerate(ranking.candidates[:top], 1))]


def row(tag: str, c: planner.Candidate) -> str:
    p, cost = c.plan.parallel, c.cost
    comm = sum(cost.breakdown.get(k, 0.0) for k in planner.EXCHANGES)
    label = c.plan.label + (f"/{p.etp}" if registry.EXPERTS[p.experts].uses_etp else "")
    label += "+fsdp" if p.expert_fsdp else ""
    label += f"+c{p.overlap_chunks}" if p.overlap_chunks > 1 else ""
    label += "+cm" if p.collective_matmul else ""
    label += {"1f1b": "+1f1b", "zero_bubble": "+zb"}.get(p.schedule, "")
    label += str(p.stash_depth or "")
    memory = f"{c.memory.total / 1e9:>8.1f}" if c.memory is not None else f"{'-':>8}"
    return (
        f"{tag:>3} {label:<26}{p.intra:>6}{p.stages:>7}{p.repeats:>8}{p.data:>6}{p.zero:>5}"
        f"{cost.micro_batches:>13}{cost.micro_batch:>5}"
        f"{cost.step_s * 1e3:>11.3f}{cost.tokens_per_sec:>13,.0f}{cost.mfu:>7.1%}"
        f"{cost.bubble:>8.1%}{comm * 1e3:>10.3f}{memory}"
    )


def run_config(best: planner.Candidate, config: Config, batch: int) -> Config:
    """The config the trainer runs for the winner."""
    return best.plan.config(config, batch)


def auto_config(run: Config, config: Config, gpu_key: str) -> Config:
    """`run` with the plan left to `parallel.layout=auto` for this preset: the searched
    settings as `config` had them, the batch and accumulation kept."""
    parallel = dataclasses.replace(config.parallel, layout="auto", gpu=gpu_key)
    return dataclasses.replace(run, parallel=parallel)


def launch(
    run: Config, auto: Config, base: Config, command: str, gpus: int, restricted: str
) -> list[str]:
    """The flags that run the winner after the train `command` (which runs `base`), and
    the `layout=auto` flags that pick the same plan (unless the search was `restricted`)."""
    lines = [
        f"to train plan #1 on {gpus} GPUs, add these flags to `{command}`:",
        f"  {flag_line(run, base) or '(none: the config already runs it)'}",
    ]
    auto_flags = flag_line(auto, base)
    if restricted:
        lines.append(
            f"(`{auto_flags}` ranks every plan as the trainer runs it; with {restricted} "
            "this ranking is another, so it may pick another plan)"
        )
    else:
        lines.append(
            f"or let the trainer choose: on {gpus} GPUs `{auto_flags}` "
            "(parallel.layout=auto) picks the same plan"
        )
    return lines


def summary(candidate: planner.Candidate) -> dict:
    """The JSON form of one plan's prediction."""
    c = candidate.cost
    plan, p = c.plan, c.plan.parallel
    return {
        "attention": p.attention,
        "experts": p.experts,
        "n": p.intra,
        "pp": p.stages,
        "repeats": p.repeats,
        "pipeline": plan.pipeline,
        "schedule": p.schedule,
        "stash_depth": p.stash_depth,
        "data": p.data,
        "micro_batch": c.micro_batch,
        "zero": p.zero,
        "expert_fsdp": p.expert_fsdp,
        "overlap_chunks": p.overlap_chunks,
        "collective_matmul": p.collective_matmul,
        "overlap": plan.overlap,
        "tokens_per_sec": c.tokens_per_sec,
        "mfu": c.mfu,
        "step_s": c.step_s,
        "micro_batches": c.micro_batches,
        "bubble": c.bubble,
        "breakdown_s": c.breakdown,
        "hidden_s": c.hidden,
        "memory_bytes": None if candidate.memory is None else candidate.memory.total,
    }
