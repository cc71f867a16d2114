"""The SLURM launch path on a real one-node SLURM cluster that these tests bring
up themselves (launch/slurm/local_cluster.sh): the job template
launch/slurm/train.sbatch runs two JAX processes of 4 CPU devices each.

- its losses equal one process with 8 devices;
- its checkpoint, saved under sp+ep_ag over 8 devices by 2 processes, restores
  under tp+etp (intra 4, data 2) in 1 process with identical values, and that
  process continues the run with the losses of the uninterrupted run;
- `scancel --signal=TERM` mid-run leaves a checkpoint, the job requeues itself
  and reaches the uninterrupted run's final loss.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from moe_jax import trainer
from moe_jax.checkpoint import Checkpointer
from moe_jax.parallel import mesh as mesh_lib
from moe_jax.plan.resolve import resolve
from moe_jax.train_state import init_state
from tests.commands import xla_flags
from tests.multihost import MODEL, MORE_STEPS, ROOT, SAVED_PLAN, STEPS, flags, losses
from tests.settings import make_config

pytestmark = pytest.mark.slurm

CLUSTER = ROOT / "launch" / "slurm" / "local_cluster.sh"
TEMPLATE = ROOT / "launch" / "slurm" / "train.sbatch"
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL")
OTHER_PLAN = {"parallel.attention": "tp", "parallel.experts": "etp", "parallel.intra": 4}


def _free_port_pair() -> int:
    for port in range(20000, 30000, 2):
        with socket.socket() as a, socket.socket() as b:
            try:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError("no two free ports in [20000, 30000)")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> dict[str, str]:
    """The environment for SLURM commands talking to a fresh local cluster."""
    if shutil.which("sbatch") is None and os.geteuid() != 0:
        pytest.skip("SLURM is missing and only root can install it (local_cluster.sh up)")
    state = tmp_path_factory.mktemp("slurm")
    env = dict(os.environ, MOE_JAX_SLURM_DIR=str(state), MOE_JAX_SLURM_PORT=str(_free_port_pair()))
    up = subprocess.run([CLUSTER, "up"], env=env, capture_output=True, text=True, timeout=900)
    assert up.returncode == 0, up.stderr[-3000:]
    env["SLURM_CONF"] = str(state / "slurm.conf")
    yield env
    subprocess.run([CLUSTER, "down"], env=env, capture_output=True, timeout=120)


def _sbatch(cluster: dict, workdir: Path, train_flags: list[str]) -> str:
    """Submits the template as a 2-task job of 4 CPU devices per task: its job id."""
    env = dict(cluster, XLA_FLAGS=xla_flags(4))
    env.update(JAX_PLATFORMS="cpu", MOE_JAX_PYTHON=sys.executable, PYTHONUNBUFFERED="1")
    command = ["sbatch", "--parsable", "--nodes=1", "--ntasks=2", "--gpus-per-node=0"]
    command += ["--cpus-per-task=1", "--time=00:20:00", f"--output={workdir}.out"]
    command += [str(TEMPLATE), f"--workdir={workdir}", *train_flags]
    run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout.strip().split(";")[0]


def _job(cluster: dict, job: str) -> dict[str, str]:
    shown = subprocess.run(
        ["scontrol", "show", "job", job], env=cluster, capture_output=True, text=True, timeout=60
    ).stdout
    return dict(re.findall(r"(\w+)=(\S+)", shown))


def _wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _ended(cluster: dict, job: str, timeout: float) -> dict[str, str]:
    """The job's state once it has ended (polled every 0.2 s: `sbatch --wait` polls
    every few seconds)."""
    state = {}

    def ended() -> bool:
        state.update(_job(cluster, job))
        return state.get("JobState") in ENDED

    _wait_for(ended, timeout, f"job {job} to end")
    return state


def _restored_params(checkpoints: Path, settings: dict):
    """The step-20 params restored into the layout of `settings` on the 8 test devices."""
    config = make_config({**MODEL, **settings, "train.steps": STEPS})
    config = resolve(config, jax.device_count())
    layout = mesh_lib.make_layout(config, mesh_lib.make_mesh(config))
    _, state = init_state(config, layout)
    state = jax.device_put(state, mesh_lib.train_state_shardings(state, layout, 0))
    restored, _ = Checkpointer(checkpoints, keep=3).restore(STEPS, state)
    return state.params, restored.params


def test_sbatch_job_matches_one_process_and_restores_under_another_plan(
    cluster, single_process_run, tmp_path
):
    workdir = tmp_path / "job"
    job = _sbatch(cluster, workdir, flags({**MODEL, **SAVED_PLAN}))
    ended = _ended(cluster, job, 900)
    log = Path(f"{workdir}.out").read_text()
    assert (ended["JobState"], ended["ExitCode"]) == ("COMPLETED", "0:0"), log[-3000:]
    assert "2 tasks" in log
    got, want = losses(workdir), losses(single_process_run)
    assert sorted(got) == list(range(1, STEPS + 1))
    np.testing.assert_allclose(list(got.values()), [want[s] for s in got], rtol=1e-5)

    # Saved by 2 processes under sp+ep_ag (8 devices); restored by 1 under tp+etp (4 x data 2).
    fresh, saved_plan = _restored_params(workdir / "checkpoints", SAVED_PLAN)
    fresh_other, other_plan = _restored_params(workdir / "checkpoints", OTHER_PLAN)
    leaves = [jax.tree.leaves(tree) for tree in (fresh, saved_plan, fresh_other, other_plan)]
    moved = 0
    for init, a, init_other, b in zip(*leaves, strict=True):
        assert a.sharding == init.sharding and b.sharding == init_other.sharding
        moved += a.sharding != b.sharding
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert not np.array_equal(np.asarray(init), np.asarray(a))  # trained, not fresh
    assert moved >= len(leaves[0]) // 2  # most weights are laid out differently

    # One process (this one) continues the job under the other plan, as the
    # uninterrupted run went on.
    trainer.run(make_config({**MODEL, **OTHER_PLAN, "train.steps": STEPS + MORE_STEPS}), workdir)
    got = losses(workdir)
    after = range(STEPS + 1, STEPS + MORE_STEPS + 1)
    assert sorted(got) == list(range(1, STEPS + MORE_STEPS + 1))
    np.testing.assert_allclose([got[s] for s in after], [want[s] for s in after], rtol=1e-5)


def test_sigterm_saves_requeues_and_finishes_like_an_uninterrupted_run(
    cluster, single_process_run, tmp_path
):
    workdir = tmp_path / "job"
    train_flags = flags({**MODEL, **SAVED_PLAN, "train.checkpoint_every": 0})
    job = _sbatch(cluster, workdir, train_flags)
    assert job
    _wait_for(lambda: len(losses(workdir)) >= 3 if workdir.exists() else False, 600, "step 3")
    signal = subprocess.run(["scancel", "--signal=TERM", job], env=cluster, timeout=60)
    assert signal.returncode == 0

    # The job saves, exits 75 and requeues itself.
    def requeued() -> bool:
        state = _job(cluster, job)
        assert state.get("JobState") != "COMPLETED", "the job ended before SIGTERM reached it"
        return state.get("Restarts") == "1" and state.get("JobState") == "PENDING"

    _wait_for(requeued, 300, "the requeue")
    # SLURM holds a requeued job for about two minutes, which the test skips; but
    # not at once: a start in the same second as the requeue finds the old run's
    # credential revoked and fails the job.
    time.sleep(3)
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=cluster, timeout=60)

    def finished() -> bool:
        state = _job(cluster, job).get("JobState", "gone")
        assert state in ("PENDING", "RUNNING", "COMPLETING", "COMPLETED"), (
            f"job {job} is {state}: " + Path(f"{workdir}.out").read_text()[-3000:]
        )
        return state == "COMPLETED"

    _wait_for(finished, 600, "the rerun")

    log = Path(f"{workdir}.out").read_text()
    stopped = int(re.search(r"SIGTERM: saved step (\d+)", log)[1])
    assert 3 <= stopped < STEPS, log[-3000:]
    assert f"resumed from {workdir / 'checkpoints' / str(stopped)}" in log
    assert "requeueing job" in log
    assert (workdir / "checkpoints" / str(stopped)).is_dir()
    final = losses(workdir)[STEPS]
    np.testing.assert_allclose(final, losses(single_process_run)[STEPS], rtol=1e-5)
