"""The workdir is checked before anything runs and held by one run at a time (a
crashed run's hold is taken over)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from moe_jax import workdir
from tests.test_trainer import TINY, _start, _train_cli, _train_cmd, _wait_for


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

    second = _train_cli(run, *args, "--config.train.steps=4", timeout=120, warm=True)
    assert second.returncode == 1
    assert "Traceback" not in second.stderr
    last = second.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {run} is in use by process {first.pid}"), second.stderr

    first.send_signal(signal.SIGKILL)
    first.wait()
    step = max(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
    third = _train_cli(run, *args, f"--config.train.steps={step + 2}", timeout=240, warm=True)
    assert third.returncode == 0, third.stderr[-3000:]
    assert f"took over {run} from process {first.pid}" in third.stdout
    assert f"resumed from {run / 'checkpoints' / str(step)}" in third.stdout
    assert (run / workdir.LOCK_NAME).read_text() == ""  # released at the end
