"""`python -m moe_jax.plan --config=FILE --gpus=N [--gpu=h800] [--global-batch=B] [--pp=P]
[--overlap=both|chunked|collective_matmul|none] [--compare=megatron] [--top=K] [--json]`

Ranks every layout of the config that fits on N GPUs by predicted step time and
explains the winner (compute, exposed communication per kind, bubble, memory).
Pipelines are the trainer's: GPipe over the MoE layer stack with R circular repeats
(column R), a bubble of (S-1)/(M R + S - 1) of the ticks.
`--compare=megatron` adds the Megatron-LM baseline (tensor parallelism over the node
for attention and experts, as many stages in its 1F1B pipeline, no overlap) and the
speed-up over it.
Nothing is compiled or run: a few seconds on a laptop. With `--json` the last line of
stdout is one JSON object: {"best": {...}, "baseline": {...} or null, "speedup", ...}.
Sequence length comes from train.seq_len; the global batch (sequences) from
--global-batch or train.batch_size.
"""

from __future__ import annotations

import json
import os
import sys

from absl import app, flags

from moe_jax import cli
from moe_jax import config as config_lib
from moe_jax.parallel import registry
from moe_jax.plan import cost_model, planner
from moe_jax.plan.describe import plan_line
from moe_jax.plan.hardware import GPUS, get


def define_flags() -> None:
    """Defined only when run as a program (moe_jax.train owns a --config flag too)."""
    cli.define_config_flag()
    flags.DEFINE_integer("gpus", None, "GPUs in the cluster.", lower_bound=1)
    flags.DEFINE_enum("gpu", "h800", sorted(GPUS), "GPU preset.", case_sensitive=False)
    flags.DEFINE_integer(
        "global-batch", 0, "Sequences per step (0: train.batch_size).", lower_bound=0
    )
    flags.DEFINE_integer("pp", 0, "Pipeline stages (0: search them).", lower_bound=0)
    flags.DEFINE_enum(
        "overlap",
        "both",
        cost_model.OVERLAPS,
        "The trainer's overlaps to search: chunked (parallel.overlap_chunks in 1, 2, 4), "
        "collective_matmul (parallel.collective_matmul on and off), both, or none.",
    )
    flags.DEFINE_enum("compare", "", ["", "megatron"], "Baseline to print beside the plan.")
    flags.DEFINE_integer("top", 10, "Plans to list.", lower_bound=1)
    flags.DEFINE_bool("json", False, "End stdout with one line of JSON.")
    flags.mark_flag_as_required("gpus")


def table(ranking: planner.Ranking, top: int) -> list[str]:
    lines = [
        f"{'#':>3} {'plan':<26}{'n':>3}{'pp':>4}{'R':>3}{'data':>6}{'mb':>4}{'step ms':>11}"
        f"{'tokens/s':>13}{'MFU':>7}{'bubble':>8}{'comm ms':>10}{'mem GB':>8}"
    ]
    for i, c in enumerate(ranking.candidates[:top], 1):
        lines.append(_row(str(i), c))
    return lines


def _row(tag: str, c: planner.Candidate) -> str:
    p, cost = c.plan.parallel, c.cost
    comm = sum(cost.breakdown.get(k, 0.0) for k in planner.EXCHANGES)
    label = c.plan.label + (f"/{p.etp}" if registry.EXPERTS[p.experts].uses_etp else "")
    label += "+fsdp" if p.expert_fsdp else ""
    label += f"+c{p.overlap_chunks}" if p.overlap_chunks > 1 else ""
    label += "+cm" if p.collective_matmul else ""
    return (
        f"{tag:>3} {label:<26}{p.intra:>3}{p.stages:>4}{p.repeats:>3}{p.data:>6}"
        f"{cost.micro_batch:>4}"
        f"{cost.step_s * 1e3:>11.3f}{cost.tokens_per_sec:>13,.0f}{cost.mfu:>7.1%}"
        f"{cost.bubble:>8.1%}{comm * 1e3:>10.3f}{c.memory.total / 1e9:>8.1f}"
    )


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise SystemExit(f"error: unexpected arguments {argv[1:]}")
    f = flags.FLAGS
    try:  # a missing or unreadable --config was reported by moe_jax.cli.parse
        config = config_lib.load(f.config)
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
    gpu = get(f.gpu)
    batch = f["global-batch"].value or config.train.batch_size
    ratio = planner.compute_comm_ratio(config, gpu)
    print(
        f"compute/communication ratio R = 3/2 h_ffn B/P n/(n-1) (h_ffn="
        f"{config.moe.expert_mlp_dim}, n={gpu.gpus_per_node}, {gpu.name}) = {ratio:.2f}: "
        f"{planner.verdict(ratio)}",
        flush=True,
    )
    try:
        ranking = planner.rank(config, f.gpus, gpu, batch, f.pp or None, f.overlap, limit=f.top)
        best = ranking.best
        baseline = None
        if f.compare == "megatron":
            baseline = planner.megatron_baseline(
                config, f.gpus, gpu, batch, best.plan.parallel.stages
            ).best
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
    seq = config.train.seq_len
    print(
        f"plans on {f.gpus} x {gpu.name}, global batch {batch} x {seq} tokens, "
        f"overlap={f.overlap}: {ranking.plans} plans; the {len(ranking.candidates)} fastest "
        f"that fit (memory checked in rank order: {ranking.dropped_for_memory} faster ones "
        "dropped)"
    )
    print("\n".join(table(ranking, f.top)))
    print("\n".join(planner.explain(best, gpu, planner.runner_up(ranking))))
    print(f"  as the trainer's settings: {plan_line(best.plan.parallel)}")
    speedup = None
    if baseline is not None:
        speedup = best.cost.tokens_per_sec / baseline.cost.tokens_per_sec
        print(f"baseline megatron (tp+etp, n={baseline.plan.parallel.intra}, no overlap, 1F1B):")
        print(_row("M", baseline))
        print(f"speed-up of the best plan over megatron: {speedup:.2f}x")
    if f.json:
        result = {
            "gpus": f.gpus,
            "gpu": gpu.name,
            "global_batch": batch,
            "seq_len": seq,
            "overlap": f.overlap,
            "plans": ranking.plans,
            "dropped_for_memory": ranking.dropped_for_memory,
            "best": planner.summary(best),
            "ranked": [planner.summary(c) for c in ranking.candidates[: f.top]],
            "baseline": planner.summary(baseline) if baseline else None,
            "speedup": speedup,
            "compute_comm_ratio": ratio,
            "verdict": planner.verdict(ratio),
        }
        print(json.dumps(result), flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the memory model only traces shapes
    define_flags()
    app.run(main, flags_parser=cli.parse)
