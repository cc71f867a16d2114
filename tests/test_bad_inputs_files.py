"""Bad paths and files given to `prepare`, `sample`, `evaluate` and `convert` (the rules:
`tests/bad_inputs.py`): devices, kernel file systems, paths under a file, missing or
garbled inputs, evaluate's overrides and sample's lengths, each refused in one line
naming the flag or setting and the path, before anything is built or written."""

from __future__ import annotations

import gc
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.bad_inputs import WORKDIR, Case, Place, check, names
from tests.bad_inputs import case as _c
from tests.commands import COMMANDS, subprocess_env

RUN = "--workdir={root}/run"
PROC = "/proc/moe_jax_bad_input"  # nothing can be made there, whoever runs the tests


def _jsonl_with_lone_surrogate(place: Place) -> None:
    # A JSON escape of half a UTF-16 pair: json.loads gives a str no codec can encode.
    place.file("docs.jsonl", '{"text": "fine"}\n{"text": "broken \\ud800 here"}\n')


def _hf_dir(place: Place, config_text: str | None = None) -> Path:
    hf = place.root / "hf"
    hf.mkdir()
    if config_text is not None:
        (hf / "config.json").write_text(config_text)
    return hf


def _run_on_data(place: Place, meta_text: str | None) -> None:
    """The trained run, its config.json pointing at prepared data beside it (as a run
    trained with data.source=tokens stores it) whose meta.json is `meta_text`, or absent
    data when None."""
    run = place.trained()
    saved = json.loads((run / "config.json").read_text())
    saved["data"].update(source="tokens", path="../data")
    (run / "config.json").write_text(json.dumps(saved, indent=2) + "\n")
    if meta_text is not None:
        place.prepared()
        (place.root / "data" / "meta.json").write_text(meta_text)


CASES = [
    # prepare: its input, output and tokenizer paths, and text no tokenizer can take
    _c(
        "prepare_input_is_a_device",
        "prepare",
        ["--input=/dev/null", "--output={root}/out"],
        "--input=/dev/null is a device",
    ),
    _c(
        "prepare_output_is_a_device",
        "prepare",
        ["--input={root}/blocker", "--output=/dev/null"],
        "--output=/dev/null is a device",
        setup=Place.file,
    ),
    _c(
        "prepare_output_on_proc",
        "prepare",
        ["--input={root}/blocker", f"--output={PROC}"],
        f"--output={PROC}",
        "proc file system",
        setup=Place.file,
    ),
    _c(
        "prepare_input_under_a_file",
        "prepare",
        ["--input={root}/blocker/text.txt", "--output={root}/out"],
        "--input={root}/blocker/text.txt does not exist",
        "blocker is a file",
        setup=Place.file,
    ),
    _c(
        "prepare_tokenizer_is_a_directory",
        "prepare",
        ["--input={root}/blocker", "--output={root}/out", "--tokenizer={root}"],
        "--tokenizer={root} is a directory",
        setup=Place.file,
    ),
    _c(
        "prepare_tokenizer_is_a_device",
        "prepare",
        ["--input={root}/blocker", "--output={root}/out", "--tokenizer=/dev/null"],
        "--tokenizer=/dev/null is a device",
        setup=Place.file,
    ),
    _c(
        "prepare_lone_surrogate",
        "prepare",
        ["--input={root}/docs.jsonl", "--output={root}/out"],
        "docs.jsonl:2",
        "lone surrogate \\ud800",
        setup=_jsonl_with_lone_surrogate,
    ),
    # sample: the run directory, the tokenizer, the run's data and the length asked for
    _c("sample_workdir_is_a_device", "sample", ["--workdir=/dev/null"], "--workdir=/dev/null"),
    _c(
        "sample_workdir_missing",
        "sample",
        ["--workdir={root}/nowhere"],
        "--workdir={root}/nowhere does not exist",
    ),
    _c(
        "sample_workdir_is_a_file",
        "sample",
        ["--workdir={root}/blocker"],
        "--workdir={root}/blocker is a file",
        setup=Place.file,
    ),
    _c(
        "sample_tokenizer_is_a_device",
        "sample",
        [RUN, "--tokenizer=/dev/null"],
        "--tokenizer=/dev/null is a device",
        setup=Place.trained,
    ),
    _c(
        "sample_tokenizer_missing",
        "sample",
        [RUN, "--tokenizer={root}/tok.json"],
        "--tokenizer={root}/tok.json does not exist",
        setup=Place.trained,
    ),
    _c(
        "sample_too_long_for_memory",
        "sample",
        [RUN, "--max_new_tokens=1000000000000"],
        "--max_new_tokens=1000000000000",
        "lower --max_new_tokens",
        setup=Place.trained,
    ),
    _c(
        "sample_data_gone",
        "sample",
        [RUN],
        "data.path={root}/data does not exist",
        setup=lambda p: _run_on_data(p, None),
    ),
    _c(
        "sample_data_meta_garbled",
        "sample",
        [RUN],
        "meta.json is not valid JSON",
        setup=lambda p: _run_on_data(p, "{not json"),
    ),
    _c(
        "sample_config_json_is_a_list",
        "sample",
        [RUN],
        "config.json holds a JSON list",
        setup=lambda p: (p.trained(), p.file("run/config.json", "[1, 2]\n")),
    ),
    # evaluate: its overrides, validated as train's, and its paths
    _c(
        "evaluate_seq_len_zero",
        "evaluate",
        [RUN, "--config.train.seq_len=0"],
        "train.seq_len=0 is invalid",
        setup=Place.trained,
    ),
    _c(
        "evaluate_eval_batches_zero",
        "evaluate",
        [RUN, "--config.train.eval_batches=0"],
        "train.eval_batches=0 is invalid",
        setup=Place.trained,
    ),
    _c("evaluate_workdir_is_a_device", "evaluate", ["--workdir=/dev/null"], "--workdir=/dev/null"),
    _c(
        "evaluate_workdir_missing",
        "evaluate",
        [WORKDIR],
        "--workdir={root}/run does not exist",
    ),
    _c(
        "evaluate_data_path_missing",
        "evaluate",
        [RUN, "--config.data.source=tokens", "--config.data.path={root}/nowhere"],
        "--config.data.path={root}/nowhere does not exist",
        setup=Place.trained,
    ),
    _c(
        "evaluate_split_unknown",
        "evaluate",
        [RUN, "--split=test"],
        "--split='test' is invalid",
        setup=Place.trained,
    ),
    _c(
        "evaluate_data_meta_garbled",
        "evaluate",
        [RUN],
        "meta.json is not valid JSON",
        setup=lambda p: _run_on_data(p, "{not json"),
    ),
    # convert: both directories of both commands, and a Hugging Face config.json
    _c(
        "convert_export_hf_is_a_device",
        "convert",
        ["export", RUN, "--hf=/dev/null"],
        "--hf=/dev/null is a device",
        setup=Place.trained,
    ),
    _c(
        "convert_export_hf_on_proc",
        "convert",
        ["export", RUN, f"--hf={PROC}"],
        f"--hf={PROC}",
        "proc file system",
        setup=Place.trained,
    ),
    _c(
        "convert_export_hf_under_a_file",
        "convert",
        ["export", RUN, "--hf={root}/blocker/hf"],
        "--hf={root}/blocker/hf lies under",
        setup=lambda p: (p.trained(), p.file()),
    ),
    _c(
        "convert_export_workdir_is_a_device",
        "convert",
        ["export", "--workdir=/dev/null", "--hf={root}/hf"],
        "--workdir=/dev/null is a device",
    ),
    _c(
        "convert_import_workdir_under_a_file",
        "convert",
        ["import", "--hf={root}/hf", "--workdir={root}/blocker/run"],
        "--workdir={root}/blocker/run lies under",
        setup=lambda p: (_hf_dir(p), p.file()),
    ),
    _c(
        "convert_import_workdir_on_proc",
        "convert",
        ["import", "--hf={root}/hf", f"--workdir={PROC}"],
        f"--workdir={PROC}",
        "proc file system",
        setup=_hf_dir,
    ),
    _c(
        "convert_import_hf_is_a_file",
        "convert",
        ["import", "--hf={root}/blocker", WORKDIR],
        "--hf={root}/blocker is a file",
        setup=Place.file,
    ),
    _c(
        "convert_import_hf_config_is_a_list",
        "convert",
        ["import", "--hf={root}/hf", WORKDIR],
        "config.json holds a JSON list",
        setup=lambda p: _hf_dir(p, "[1, 2]\n"),
    ),
    _c(
        "convert_import_hf_config_missing_keys",
        "convert",
        ["import", "--hf={root}/hf", WORKDIR],
        "config.json has no 'num_hidden_layers' setting",
        setup=lambda p: _hf_dir(p, '{"architectures": ["MixtralForCausalLM"]}\n'),
    ),
]

# Real subprocesses, proving the command line itself (each costs seconds: sample's is
# `test_ctrl_c_during_sample_is_one_line`, evaluate's in tests/test_bad_inputs.py).
REAL = {"prepare_lone_surrogate", "convert_export_hf_is_a_device"}


def test_every_command_has_five_cases():
    for command in ("prepare", "sample", "evaluate", "convert"):
        assert sum(case.command == command for case in CASES) >= 5, command
    assert set(names(CASES)) >= REAL


@pytest.mark.parametrize("case", CASES, ids=names(CASES))
def test_bad_path_is_one_line_and_changes_nothing(tmp_path: Path, bad_input_run: Path, case: Case):
    check(tmp_path, bad_input_run, case, real=case.name in REAL)


def _handles_sigterm(pid: int) -> bool:
    """Whether process `pid` runs the command and has a handler for SIGTERM (Python has
    none by default: the command's own, installed as its main starts)."""
    if b"moe_jax.sample" not in Path(f"/proc/{pid}/cmdline").read_bytes():
        return False  # not yet past exec: the handlers are this test process's
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) & (1 << (signal.SIGTERM - 1)))
    return False


def test_ctrl_c_during_sample_is_one_line(tmp_path: Path, bad_input_run: Path):
    """Ctrl-C (SIGINT) once `sample` runs: one line, exit status 130, no traceback."""
    run = tmp_path / "run"
    shutil.copytree(bad_input_run, run)
    argv = [sys.executable, *COMMANDS["sample"], f"--workdir={run}", "--max_new_tokens=100000"]
    env = subprocess_env(JAX_PLATFORMS="cpu")
    child = subprocess.Popen(argv, cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not _handles_sigterm(child.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        child.send_signal(signal.SIGINT)
        _, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:  # never left running, whatever failed
            child.kill()
            child.wait()
    assert child.returncode == 130, err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    assert err.strip().splitlines()[-1] == (
        "error: interrupted (SIGINT) during sampling; nothing was written"
    )


def test_an_interrupt_inside_a_gc_callback_is_raised_again_after_it():
    """The handler, called while a garbage-collector callback runs (jax registers one:
    CI once caught Ctrl-C there, and Python printed "Exception ignored" with a traceback
    before the resend stopped the command), raises nothing there and sets the retry."""
    from moe_jax import signals

    seen: list = []

    def callback(phase: str, info: dict) -> None:
        if phase != "start" or seen:
            return
        try:
            signals._raise(signal.SIGINT, sys._getframe())  # the frame a signal finds
        except KeyboardInterrupt:
            seen.append("raised")
            return
        seen.append(signal.getitimer(signal.ITIMER_REAL)[0])

    alarm = signal.signal(signal.SIGALRM, signal.SIG_IGN)  # the retry must not fire here
    gc.callbacks.append(callback)
    try:
        gc.collect()
    finally:
        gc.callbacks.remove(callback)
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, alarm)
        signals._received.clear()
    assert seen and seen[0] != "raised" and 0 < seen[0] <= signals.RETRY_S
    with pytest.raises(KeyboardInterrupt):  # outside such a callback it is raised at once
        try:
            signals._raise(signal.SIGINT, sys._getframe())
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signals._received.clear()
