"""The workdir is checked before anything runs and held by one run at a time (a
crashed run's hold is taken over)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from moe_jax import workdir
from tests.test_trainer import TINY, _start, _train_cli, _train_cmd, _wait_for


@pytest.mark.parametrize("kind", ["file", "under_a_file", "read_only_parent"])
def test_a_path_that_cannot_be_a_workdir_is_one_line(tmp_path: Path, kind: str):
    if kind == "read_only_parent" and os.geteuid() == 0:
        pytest.skip("root may write anywhere")
    blocker = tmp_path / "blocker"
    target = {"file": blocker, "under_a_file": blocker / "run"}.get(kind, tmp_path / "ro" / "run")
    if kind == "read_only_parent":
        (tmp_path / "ro").mkdir(mode=0o500)
    else:
        blocker.write_text("a user's file\n")
    run = _train_cli(target, *TINY, "--config.train.steps=1", timeout=120)
    assert run.returncode == 1
    assert "Traceback" not in run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("error: --workdir=") and str(target) in last, run.stderr[-2000:]
    if kind != "read_only_parent":
        assert blocker.read_text() == "a user's file\n"


def test_check_reports_each_kind(tmp_path: Path):
    (tmp_path / "f").write_text("")
    with pytest.raises(ValueError, match="is a file"):
        workdir.check(tmp_path / "f")
    with pytest.raises(ValueError, match="lies under"):
        workdir.check(tmp_path / "f" / "run")
    workdir.check(tmp_path / "new" / "run")  # not there yet: fine
    assert not (tmp_path / "new").exists()  # and nothing was made


def test_second_run_refuses_and_a_dead_runs_lock_is_taken_over(tmp_path: Path):
    run = tmp_path / "run"
    args = [*TINY, "--config.train.checkpoint_every=2", "--config.train.eval_every=0"]
    first = _start(_train_cmd(run, *args, "--config.train.steps=100000"))
    _wait_for(lambda: (run / "checkpoints" / "2").is_dir(), 240, first)

    second = _train_cli(run, *args, "--config.train.steps=4", timeout=120)
    assert second.returncode == 1
    assert "Traceback" not in second.stderr
    last = second.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {run} is in use by process {first.pid}"), second.stderr

    first.send_signal(signal.SIGKILL)
    first.wait()
    step = max(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
    third = _train_cli(run, *args, f"--config.train.steps={step + 2}", timeout=240)
    assert third.returncode == 0, third.stderr[-3000:]
    assert f"took over {run} from process {first.pid}" in third.stdout
    assert f"resumed from {run / 'checkpoints' / str(step)}" in third.stdout
    assert (run / workdir.LOCK_NAME).read_text() == ""  # released at the end
