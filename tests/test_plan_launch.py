"""`python -m moe_jax.plan` tells how to launch its plan: the flags printed under the
table, read by the trainer's own config flags, are exactly the plan chosen, and so is
what `parallel.layout=auto` resolves to. Nothing is compiled."""

from __future__ import annotations

import dataclasses
import re
import runpy
import shlex

from moe_jax import config as config_lib
from moe_jax.config import Config
from tests.commands import ROOT

MIXTRAL = str(ROOT / "configs" / "mixtral_8x7b.py")


def load(name: str) -> Config:
    return config_lib.load(runpy.run_path(str(ROOT / "configs" / f"{name}.py"))["get_config"]())


def _front_door(config_file: str, line: str) -> Config:
    """`python -m moe_jax.train --config=FILE LINE`'s settings, read as the trainer reads
    them (the `--config` flag of `moe_jax.cli`, `moe_jax.config.load`), in process."""
    from absl import flags
    from ml_collections import config_flags

    from moe_jax import cli

    argv = ["moe_jax.train", f"--config={config_file}", *shlex.split(line)]
    assert cli.check_config_args(argv) is None
    values = flags.FlagValues()
    config_flags.DEFINE_config_file(
        "config", str(cli.DEFAULT_CONFIG), flag_values=values, sys_argv=argv
    )
    values(argv)
    return config_lib.load(values.config)


def test_printed_flags_and_layout_auto_run_the_plan_chosen():
    """The issue's `plan --config=configs/mixtral_8x7b.py --gpus=64` (in process: the
    command prints these lines): the flag line under the table, pasted after `python -m
    moe_jax.train --config=configs/mixtral_8x7b.py`, is exactly the plan chosen (its
    `ParallelConfig`, batch and micro-batches; every other setting the file's), and the
    printed `parallel.layout=auto` flags resolve, on 64 GPUs, to the same plan. The
    legend explains every column."""
    from moe_jax.plan.__main__ import Request, report
    from moe_jax.plan.resolve import resolve

    file = load("mixtral_8x7b")
    command = "python -m moe_jax.train --config=configs/mixtral_8x7b.py"
    request = Request(gpus=64, gpu="h800", batch=256, batch_name="train.batch_size")
    lines, result = report(file, file, command, request)
    best = result["best"]
    flags_line = lines[
        lines.index(f"to train plan #1 on 64 GPUs, add these flags to `{command}`:") + 1
    ]
    assert flags_line == f"  {result['flags']}"
    assert f"on 64 GPUs `{result['auto_flags']}` (parallel.layout=auto) picks the same plan" in (
        "\n".join(lines)
    )
    manual = _front_door(MIXTRAL, result["flags"])
    p = manual.parallel
    assert dataclasses.asdict(p) == result["parallel"]
    summary = (p.attention, p.experts, p.intra, p.stages, p.repeats, p.data, p.zero)
    assert summary == tuple(
        best[k] for k in ("attention", "experts", "n", "pp", "repeats", "data", "zero")
    )
    assert (p.overlap_chunks, p.collective_matmul, p.expert_fsdp) == (
        best["overlap_chunks"],
        best["collective_matmul"],
        best["expert_fsdp"],
    )
    assert manual.micro_batches == best["micro_batches"] and manual.train.batch_size == 256
    # unpipelined, the plan's micro-batches are the accumulation's
    assert manual.train.grad_accum == (1 if p.stages > 1 else best["micro_batches"])
    train = dataclasses.replace(manual.train, grad_accum=file.train.grad_accum)
    assert dataclasses.replace(manual, parallel=file.parallel, train=train) == file
    auto = _front_door(MIXTRAL, result["auto_flags"])
    assert auto.parallel.layout == "auto"
    resolved = resolve(auto, 64, platform="gpu")
    assert dataclasses.replace(resolved.parallel, gpu="") == p and resolved.train == manual.train
    head = next(line for line in lines if line.lstrip().startswith("# plan"))
    explained = {line.split()[0] for line in lines if line.startswith("  ") and line[2] != " "}
    assert set(re.findall(r"step|tokens/s|comm|mem|[^\s]+", head)) - {"ms", "GB"} <= explained
