"""Bad input on `python -m moe_jax.plan` and `python -m moe_jax.tools.comm_report` (the
rules: `tests/bad_inputs.py`), every comm_report case refused before anything compiles;
and both commands stopped by a signal: one line, exit status 130."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.bad_inputs import Case, check, names
from tests.bad_inputs import case as _c
from tests.commands import COMMANDS, ROOT, subprocess_env

PLAN = [
    _c("plan_gpus_huge", "plan", ["--gpus=10000000000000"], "--gpus=10000000000000: at most"),
    _c("plan_gpus_negative", "plan", ["--gpus=-8"], "--gpus=-8"),
    _c("plan_gpus_not_integer", "plan", ["--gpus=1.5"], "--gpus=1.5"),
    _c("plan_batch_negative", "plan", ["--global-batch=-4"], "--global-batch=-4"),
    _c(
        "plan_batch_huge",
        "plan",
        ["--global-batch=10000000000000"],
        "--global-batch=10000000000000: at most",
    ),
    _c("plan_batch_not_dividing", "plan", ["--global-batch=7"], "no layout", "--global-batch=7"),
    _c("plan_batch_zero_in_config", "plan", ["--config.train.batch_size=0"], "train.batch_size"),
    _c("plan_pp_beyond_layers", "plan", ["--pp=64"], "--pp=64", "2 layers"),
    _c(
        "plan_pp_not_dividing",
        "plan",
        ["--config.model.num_layers=4", "--pp=3"],
        "--pp=3 must divide --gpus=8",
    ),
    _c("plan_pp_negative", "plan", ["--pp=-1"], "--pp=-1"),
    _c("plan_compare_unknown", "plan", ["--compare=deepspeed"], "--compare=deepspeed", "megatron"),
    _c("plan_compare_twice", "plan", ["--compare=megatron,megatron"], "--compare"),
    _c("plan_overlap_unknown", "plan", ["--overlap=all"], "--overlap=all", "chunked"),
    _c("plan_json_not_bool", "plan", ["--json=maybe"], "--json"),
    _c("plan_nan_setting", "plan", ["--config.parallel.ag_threshold=nan"], "ag_threshold"),
    _c(
        "plan_searched_setting",
        "plan",
        ["--config.parallel.attention=tp"],
        "--config.parallel.attention",
        "searches",
    ),
    _c("plan_searched_stages", "plan", ["--config.parallel.stages=2"], "use --pp"),
    _c("plan_searched_accumulation", "plan", ["--config.train.grad_accum=4"], "train.grad_accum"),
    _c("plan_preset_setting", "plan", ["--config.parallel.gpu=h100"], "preset is --gpu"),
    _c(
        "plan_two_batches",
        "plan",
        ["--global-batch=32", "--config.train.batch_size=8"],
        "--global-batch=32 and --config.train.batch_size=8 disagree",
    ),
    _c("plan_extra_argument", "plan", ["h800"], "unexpected arguments ['h800']"),
]

COMM_REPORT = [
    _c(
        "comm_report_compare_twice",
        "comm_report",
        ["--compare=tp+etp,tp+etp"],
        "--compare entry 'tp+etp' is given twice",
    ),
    _c(
        "comm_report_compare_unknown_layout",
        "comm_report",
        ["--compare=xx+ep_a2a"],
        "--compare entry 'xx+ep_a2a' names no layout",
        "'sp'",
    ),
    _c("comm_report_compare_empty", "comm_report", ["--compare=tp+etp,"], "--compare entry ''"),
    _c("comm_report_compare_three_parts", "comm_report", ["--compare=tp+etp+x"], "'tp+etp+x'"),
    _c("comm_report_intra_too_big", "comm_report", ["--config.parallel.intra=8"], "intra=8"),
    _c("comm_report_stages_too_many", "comm_report", ["--config.parallel.stages=2"], "stages=2"),
    _c(
        "comm_report_ragged_on_cpu",
        "comm_report",
        ["--config.parallel.experts=ep_a2a_ragged"],
        "ep_a2a_ragged",
        "needs a GPU",
    ),
    _c("comm_report_nan_setting", "comm_report", ["--config.parallel.ag_threshold=nan"], "nan"),
    _c("comm_report_unknown_preset", "comm_report", ["--config.parallel.gpu=v100"], "'v100'"),
    _c("comm_report_extra_argument", "comm_report", ["tp+etp"], "unexpected arguments"),
    _c("comm_report_json_not_bool", "comm_report", ["--json=2"], "--json=2"),
]

CASES = PLAN + COMM_REPORT
REAL = {"plan_searched_setting", "comm_report_compare_twice"}


@pytest.mark.parametrize("case", CASES, ids=names(CASES))
def test_bad_input_is_one_line_and_changes_nothing(tmp_path: Path, case: Case):
    check(tmp_path, tmp_path, case, real=case.name in REAL)  # no case reads a trained run


def _caught(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler of its own for `signum` (/proc's SigCgt)."""
    status = Path(f"/proc/{pid}/status").read_text()
    mask = int(
        next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt")), 16
    )
    return bool(mask >> (signum - 1) & 1)


@pytest.mark.parametrize(
    "command,args,signum",
    [
        ("plan", ["--config=configs/mixtral_8x7b.py", "--gpus=64"], signal.SIGINT),
        ("comm_report", [], signal.SIGTERM),
    ],
)
def test_a_signal_is_one_line_and_exit_130(tmp_path: Path, command, args, signum):
    """Sent once the command's handlers are in place (the search and the compile each
    take seconds): no traceback, one `error:` line naming the signal, status 130, and
    nothing written where it ran."""
    process = subprocess.Popen(
        [sys.executable, *COMMANDS[command], *args],
        cwd=ROOT,
        env=subprocess_env(JAX_PLATFORMS="cpu"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while process.poll() is None and not _caught(process.pid, signal.SIGTERM):
        assert time.monotonic() < deadline, "the command never set its handlers"
        time.sleep(0.02)
    process.send_signal(signum)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr
    lines = stderr.strip().splitlines()
    assert "Traceback" not in stderr and len(lines) == 1, stderr
    assert lines[0].startswith("error: interrupted") and signum.name in lines[0]
