"""Resuming without retyping: `python -m moe_jax.train --workdir=RUN` alone continues a
run started with a dozen flags, from its checkpoint, with its saved settings; flags given
change them and are listed; `--config=RUN/config.json` is a config like any other.

The run is the TINY model of the bad-input runs (one device, batch 4): its programs are
in the session's compilation cache already."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from moe_jax.metrics import read_rows
from tests.bad_inputs import snapshot
from tests.commands import ROOT, TINY, run_command

# Twelve and more flags, none of them a default, none changing a compiled program.
FLAGS = [
    *TINY,
    "--config.train.steps=2",
    "--config.train.eval_every=0",
    "--config.train.checkpoint_every=2",
    "--config.train.learning_rate=0.002",
    "--config.train.warmup_steps=1",
    "--config.train.schedule=constant",
    "--config.train.keep_checkpoints=2",
]


def _train(cwd: Path, *args: str):
    done = run_command(cwd, "train", list(args), warm=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_workdir_alone_resumes_a_run_started_with_a_dozen_flags(tmp_path: Path):
    run = tmp_path / "run"
    _train(tmp_path, *FLAGS, f"--workdir={run}")
    first = json.loads((run / "config.json").read_text())
    assert first["train"]["batch_size"] == 4 and first["train"]["seq_len"] == 32

    out = _train(tmp_path, f"--workdir={run}", "--config.train.steps=4")
    assert f"resuming {run} with its saved settings ({run}/config.json); changed: " in out
    assert "changed: train.steps 2 -> 4\n" in out  # the one setting given, and nothing else
    assert f"resumed from {run}/checkpoints/2" in out
    second = json.loads((run / "config.json").read_text())
    assert second == {**first, "train": {**first["train"], "steps": 4}}
    rows = [row for row in read_rows(run / "metrics.jsonl") if "loss" in row]
    assert [row["step"] for row in rows] == [1, 2, 3, 4]  # continued, not restarted
    # The saved schedule, not the default's (cosine to 0.003 after 100 warmup steps):
    # constant at the saved rate after one warmup step.
    assert [row["lr"] for row in rows] == pytest.approx([0.0, 0.002, 0.002, 0.002])
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["2", "4"]


def test_the_runs_config_json_is_a_config(bad_input_run: Path, tmp_path: Path):
    """`--config=RUN/config.json` loads (and is compared with the checkpoint, as any
    `--config` file is): with the run's own settings and a smaller train.steps it says
    the run is complete, writing nothing."""
    run = tmp_path / "run"
    shutil.copytree(bad_input_run, run)
    before = snapshot(tmp_path)
    config = f"--config={run}/config.json"
    done = run_command(tmp_path, "train", [config, f"--workdir={run}"], warm=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "already complete at step 4 (train.steps=4); nothing to do" in done.stdout
    assert "resuming" not in done.stdout  # --config given: the file is the base
    overridden = [config, f"--workdir={run}", "--config.train.steps=3"]
    done = run_command(tmp_path, "train", overridden, warm=True)
    assert "already complete at step 4 (train.steps=3)" in done.stdout, done.stderr[-2000:]
    assert snapshot(tmp_path) == before


def test_workdir_alone_that_holds_no_run_says_so_first(tmp_path: Path):
    """`--workdir=RUN` alone where RUN holds no run starts a new one from
    configs/default.py (as `python -m moe_jax.train` does), saying so before anything
    else, so a mistyped run directory shows at once (here it then fails: it lies under a
    file, which keeps the test from training)."""
    (tmp_path / "blocker").write_text("a file\n")
    done = run_command(tmp_path, "train", [f"--workdir={tmp_path}/blocker/run"], warm=True)
    assert done.returncode == 1
    first = done.stdout.splitlines()[0]
    assert first == (
        f"{tmp_path}/blocker/run holds no run (no config.json): a new one from "
        f"{ROOT}/configs/default.py"
    )
    assert "lies under" in done.stderr.splitlines()[-1]
