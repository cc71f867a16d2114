"""`python -m moe_jax.plan --config=FILE --gpus=N [--gpu=h800] [--global-batch=B] [--pp=P]
[--overlap=both|chunked|collective_matmul|none] [--compare=megatron] [--top=K] [--json]`

Ranks every layout of the config that fits on N GPUs by predicted step time and
explains the winner (compute, exposed communication per kind, bubble, memory). Under
the table: a legend of every column, the `--config.*` flags that make
`python -m moe_jax.train --config=FILE` run the winner, and the `parallel.layout=auto`
flags that make the trainer pick the same plan itself.
Pipelines are the trainer's: GPipe over the MoE layer stack with R circular repeats,
a bubble of (S-1)/(M R + S - 1) of the ticks.
`--compare=megatron` adds the Megatron-LM baseline (tensor parallelism over the node
for attention and experts, as many stages in its 1F1B pipeline, no overlap) and the
speed-up over it.
Nothing is compiled or run: seconds on a laptop. With `--json` the last line of
stdout is one JSON object: {"best": {...}, "baseline": {...} or null, "speedup",
"flags", "auto_flags", "parallel", ...}.
Sequence length comes from train.seq_len; the global batch (sequences) from
--global-batch or train.batch_size. Ctrl-C or SIGTERM: one line, exit status 130.
"""

from __future__ import annotations

import dataclasses
import json
import os
import runpy
import sys

from absl import app, flags

from moe_jax import cli
from moe_jax import config as config_lib
from moe_jax.plan import cost_model, planner, printout
from moe_jax.plan.describe import PLAN_FIELDS, flag_line, plan_line
from moe_jax.plan.hardware import GPUS, get
from moe_jax.signals import interruptible

MAX_GPUS = 1_000_000
MAX_BATCH = 100_000_000
# The settings the search chooses: an override of one would be ignored, so it is refused.
KEPT_FIELDS = ("token_dtype", "grad_exchange", "vocab_parallel")  # the config's, kept
SEARCHED = ("layout", *(f for f in PLAN_FIELDS if f not in KEPT_FIELDS))
INSTEAD = {"stages": "--pp", "collective_matmul": "--overlap", "overlap_chunks": "--overlap"}
KEPT = ", ".join((*KEPT_FIELDS, "a2a_buffer_factor"))


def define_flags() -> None:
    """Defined only when run as a program (moe_jax.train owns a --config flag too)."""
    cli.define_config_flag()
    flags.DEFINE_integer(
        "gpus", None, f"GPUs in the cluster (at most {MAX_GPUS:,}).", lower_bound=1
    )
    flags.DEFINE_enum("gpu", "h800", sorted(GPUS), "GPU preset.", case_sensitive=False)
    flags.DEFINE_integer(
        "global-batch",
        0,
        "Sequences per step (0: train.batch_size).",
        lower_bound=0,
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


def ignored_overrides(argv: list[str]) -> str | None:
    """Why a `--config.*` flag in `argv` would be ignored by the search, or None."""
    for arg in argv[1:]:
        name = arg[len("--config.") :].split("=", 1)[0] if arg.startswith("--config.") else ""
        if name == "parallel.gpu":
            return (
                "--config.parallel.gpu: the planner's preset is --gpu (parallel.gpu is the "
                "preset of the trainer's parallel.layout=auto)"
            )
        section, _, key = name.partition(".")
        if (section == "parallel" and key in SEARCHED) or name == "train.grad_accum":
            instead = f"; use {INSTEAD[key]}" if key in INSTEAD else ""
            return (
                f"--config.{name}: the planner searches this setting, so an override would be "
                f"ignored{instead} (it keeps parallel.{{{KEPT}}} and the other settings)"
            )
    return None


def _overridden(name: str) -> bool:
    """Whether the command line gives `--config.<name>`."""
    return any(a == f"--config.{name}" or a.startswith(f"--config.{name}=") for a in sys.argv)


def file_config(name: str) -> config_lib.Config:
    """The config file's own settings, without the command line's overrides: what
    `python -m moe_jax.train --config=FILE` starts from."""
    path, _, argument = name.partition(":")
    return config_lib.load(runpy.run_path(path)["get_config"](*([argument] if argument else [])))


def _base(config: config_lib.Config, name: str) -> tuple[config_lib.Config, str]:
    """(the settings the printed flags start from, the train command they follow): the
    config file's own, or, where the file does not load without this command line's
    overrides, those overrides too."""
    command = f"python -m moe_jax.train --config={name}"
    try:
        return file_config(name), command
    except ValueError:
        given = [a for a in sys.argv[1:] if a.startswith("--config.")]
        return config, " ".join([command, *given])


def check_flags(config: config_lib.Config, gpus: int, batch: int, batch_name: str, pp: int):
    """One-line ValueErrors for flags no plan can satisfy, before the search."""
    if gpus > MAX_GPUS:
        raise ValueError(f"--gpus={gpus}: at most {MAX_GPUS} GPUs")
    if batch > MAX_BATCH:
        raise ValueError(f"{batch_name}={batch}: at most {MAX_BATCH} sequences")
    if batch < 1:
        raise ValueError(f"{batch_name}={batch}: the global batch must be at least 1 sequence")
    if pp:
        layers = config.model.num_layers
        if pp > layers:
            raise ValueError(f"--pp={pp}: more pipeline stages than the model's {layers} layers")
        if gpus % pp:
            raise ValueError(f"--pp={pp} must divide --gpus={gpus} (or --pp=0 to search)")


SYNC_NAMES = {
    "per_micro_batch": "per micro-batch (as the trainer compiles it)",
    "hierarchical": "hierarchical and overlapped (the paper's)",
}


@dataclasses.dataclass(frozen=True)
class Request:
    """What to plan: the flags of the command line, read."""

    gpus: int
    gpu: str  # preset key
    batch: int
    batch_name: str  # "--global-batch" or "train.batch_size": the setting it came from
    pp: int = 0
    overlap: str = "both"
    compare: str = ""
    top: int = 10


def preface(config: config_lib.Config, request: Request) -> list[str]:
    """The preset and the paper's ratio: printed before the search starts."""
    gpu = get(request.gpu)
    ratio = planner.compute_comm_ratio(config, gpu)
    return [printout.header(request.gpu, gpu), printout.ratio_line(config, gpu, ratio)]


def report(
    config: config_lib.Config, base: config_lib.Config, command: str, request: Request
) -> tuple[list[str], dict]:
    """(the lines after the preface, the JSON result) of planning `config`; the flags
    printed turn `base`, which the train `command` runs, into the winner. A ValueError
    names what no plan satisfies."""
    r, gpu = request, get(request.gpu)
    # Plans are ranked as the trainer compiles their gradient sync (once per
    # micro-batch), so that the plan printed is the one `layout=auto` trains; the paper's
    # comparison (`--compare=megatron`) ranks both sides with the paper's hierarchical,
    # overlapped sync instead, as its table assumes.
    paper = r.compare == "megatron"
    grad_sync = "hierarchical" if paper else "per_micro_batch"
    ranking = planner.rank(
        config, r.gpus, gpu, r.batch, r.pp or None, r.overlap, limit=r.top, grad_sync=grad_sync
    )
    try:
        best = ranking.best
        baseline = None
        if r.compare == "megatron":
            baseline = planner.megatron_baseline(
                config, r.gpus, gpu, r.batch, best.plan.parallel.stages
            ).best
    except ValueError as error:
        raise ValueError(f"{error} (--gpus={r.gpus}, {r.batch_name}={r.batch})") from None
    seq = config.train.seq_len
    lines = [
        f"plans on {r.gpus} x {gpu.name}, global batch {r.batch} x {seq} tokens, "
        f"overlap={r.overlap}, gradient sync {SYNC_NAMES[grad_sync]}: {ranking.plans} "
        f"plans; the {len(ranking.candidates)} fastest "
        f"that fit (memory checked in rank order: {ranking.dropped_for_memory} faster ones "
        "dropped)",
        *printout.table(ranking, r.top),
        *printout.LEGEND,
    ]
    run = printout.run_config(best, config, r.batch)
    auto = printout.auto_config(run, config, r.gpu)
    restricted = " and ".join(
        name
        for name, on in (
            ("--pp", r.pp),
            ("--overlap", r.overlap != "both"),
            ("--compare=megatron (the paper's gradient sync)", paper),
        )
        if on
    )
    lines += printout.launch(run, auto, base, command, r.gpus, restricted)
    lines += planner.explain(best, gpu, planner.runner_up(ranking))
    lines.append(f"  as the trainer's settings: {plan_line(best.plan.parallel)}")
    speedup = None
    if baseline is not None:
        speedup = best.cost.tokens_per_sec / baseline.cost.tokens_per_sec
        lines += [
            f"baseline megatron (tp+etp, intra={baseline.plan.parallel.intra}, no overlap, "
            "1F1B; not a schedule the trainer runs):",
            printout.row(printout.BASELINE_TAG, baseline),
            f"speed-up of the best plan over megatron: {speedup:.2f}x",
        ]
    ratio = planner.compute_comm_ratio(config, gpu)
    result = {
        "gpus": r.gpus,
        "gpu": gpu.name,
        "global_batch": r.batch,
        "seq_len": seq,
        "overlap": r.overlap,
        "plans": ranking.plans,
        "dropped_for_memory": ranking.dropped_for_memory,
        "best": printout.summary(best),
        "ranked": [printout.summary(c) for c in ranking.candidates[: r.top]],
        "baseline": printout.summary(baseline) if baseline else None,
        "speedup": speedup,
        "compute_comm_ratio": ratio,
        "verdict": planner.verdict(ratio),
        "parallel": dataclasses.asdict(run.parallel),
        "flags": flag_line(run, base),
        "auto_flags": None if restricted else flag_line(auto, base),
    }
    return lines, result


@interruptible("the plan")
def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise SystemExit(f"error: unexpected arguments {argv[1:]}; the plan takes --flags only")
    problem = ignored_overrides(sys.argv)
    if problem:
        raise SystemExit(f"error: {problem}")
    f = flags.FLAGS
    config_name = f["config"].config_filename
    try:  # a missing or unreadable --config was reported by moe_jax.cli.parse
        config = config_lib.load(f.config)
        base, command = _base(config, config_name)
        given = f["global-batch"].value
        if given and _overridden("train.batch_size") and given != config.train.batch_size:
            raise ValueError(
                f"--global-batch={given} and --config.train.batch_size="
                f"{config.train.batch_size} disagree; give one of them"
            )
        request = Request(
            gpus=f.gpus,
            gpu=f.gpu.lower(),
            batch=given or config.train.batch_size,
            batch_name="--global-batch" if given else "train.batch_size",
            pp=f.pp,
            overlap=f.overlap,
            compare=f.compare,
            top=f.top,
        )
        check_flags(config, request.gpus, request.batch, request.batch_name, request.pp)
        print("\n".join(preface(config, request)), flush=True)
        lines, result = report(config, base, command, request)
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
    print("\n".join(lines))
    if f.json:
        print(json.dumps(result), flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the memory model only traces shapes
    define_flags()
    try:
        app.run(main, flags_parser=cli.parse)
    except BrokenPipeError:  # stdout closed early (`| head`): nothing more to say
        os._exit(1)
