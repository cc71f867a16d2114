"""Multi-process training on this machine: `launch/local.py -n 2` (two JAX processes of
4 CPU devices each, joined by jax.distributed over gloo) logs the same losses as one
process with 8 devices; SLURM task layouts become the right local GPUs."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from moe_jax import distributed
from tests.commands import TINY, run_command, subprocess_env
from tests.multihost import MODEL, ROOT, SAVED_PLAN, STEPS, flags, losses, run


def test_two_local_processes_match_one(tmp_path, single_process_run):
    workdir = tmp_path / "two"
    launch = [sys.executable, "launch/local.py", "-n", "2", "--devices", "4", "--"]
    done = run([*launch, f"--workdir={workdir}", *flags({**MODEL, **SAVED_PLAN})], devices=4)
    assert done.returncode == 0, done.stderr[-3000:]
    got, want = losses(workdir), losses(single_process_run)
    assert sorted(got) == list(range(1, STEPS + 1))  # one writer: process 0 alone logs
    np.testing.assert_allclose(list(got.values()), [want[s] for s in got], rtol=1e-5)
    assert (workdir / "checkpoints" / str(STEPS)).is_dir()
    assert "process_1.log" in os.listdir(workdir)
    # gloo's connection lines are not the user's business (shown with --verbosity)
    assert "[Gloo]" not in done.stdout + (workdir / "process_1.log").read_text()
    assert "[Gloo]" not in done.stderr


def test_incomplete_distributed_flags_are_one_line():
    args = ["--num_processes=2", "--config.train.steps=1"]
    done = run_command(ROOT, "train", args, warm=True)  # one CPU device
    assert done.returncode == 1
    error = done.stderr.strip().splitlines()[-1]
    assert error.startswith("error: --coordinator=''") and "process_id" in error


def _slurm_env(tasks_per_node: str, local_id: int, node: int = 0, **extra) -> dict[str, str]:
    env = {"SLURM_STEP_TASKS_PER_NODE": tasks_per_node, "SLURM_LOCALID": str(local_id)}
    return {**env, "SLURM_NODEID": str(node), **extra}


def test_slurm_tasks_get_their_share_of_the_node_gpus():
    # One task per node drives all 8 GPUs (plain JAX would give it GPU 0 only).
    assert distributed.slurm_local_devices(_slurm_env("1(x16)", 0), gpus=8) == list(range(8))
    # One task per GPU: task 5 of a node drives GPU 5.
    assert distributed.slurm_local_devices(_slurm_env("8(x16)", 5, node=3), gpus=8) == [5]
    # Two tasks per node split the 8 GPUs in halves; nodes may differ ("4,2(x2)").
    assert distributed.slurm_local_devices(_slurm_env("2(x2)", 1), gpus=8) == [4, 5, 6, 7]
    assert distributed.slurm_local_devices(_slurm_env("4,2(x2)", 1, node=2), gpus=4) == [2, 3]
    # SLURM already bound each task to its own GPU(s): all of the visible ones.
    visible = _slurm_env("8(x2)", 6, CUDA_VISIBLE_DEVICES="6")
    assert distributed.slurm_local_devices(visible) == [0]
    bound = _slurm_env("2", 1, CUDA_VISIBLE_DEVICES="4,5,6,7", SLURM_GPUS_PER_TASK="4")
    assert distributed.slurm_local_devices(bound) == [0, 1, 2, 3]
    # No GPUs: JAX's CPU backend ignores device ids.
    assert distributed.slurm_local_devices(_slurm_env("2", 1), gpus=0) is None
    with pytest.raises(ValueError, match="3 tasks on this node cannot share 8 GPUs"):
        distributed.slurm_local_devices(_slurm_env("3", 0), gpus=8)


def test_only_multi_task_srun_steps_start_the_distributed_runtime():
    step = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1"}
    step |= {"SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NODELIST": "node[1-2]"}
    assert distributed.in_slurm_step(step)
    batch_script = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2", "SLURM_PROCID": "0"}
    assert not distributed.in_slurm_step(batch_script)  # the script itself, outside srun
    assert not distributed.in_slurm_step({**step, "SLURM_STEP_NUM_TASKS": "1"})


def test_job_template_xla_flags_are_known_to_this_xla():
    """An unknown flag in XLA_FLAGS aborts every process at start-up."""
    template = (ROOT / "launch" / "slurm" / "train.sbatch").read_text()
    block = template.split("GPU_XLA_FLAGS=(")[1].split(")")[0]
    flags = block.split()
    assert len(flags) >= 5 and all(f.startswith("--xla_gpu_") for f in flags)
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join(flags))
    code = "import jax; jax.numpy.ones(1).block_until_ready()"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    bad = dict(env, XLA_FLAGS="--xla_gpu_no_such_flag=true")
    done = subprocess.run([sys.executable, "-c", code], env=bad, capture_output=True, text=True)
    assert done.returncode != 0 and "Unknown flag" in done.stderr


def _local():
    import runpy

    return runpy.run_path(str(ROOT / "launch" / "local.py"))


def test_local_launch_keeps_the_users_xla_flags(monkeypatch):
    local = _local()
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=2")
    assert local["xla_flags"](4) == "--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=4"


# No process outlives the launcher. Each launch below is stopped while its two training
# processes are still starting (importing jax), before anything compiles.
LAUNCH = [sys.executable, "launch/local.py", "-n", "2", "--devices", "1", "--"]


def _stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat's fields from the state on (state, ppid, ..., start time at
    [19]), or None when the process is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()


def _alive(pid: int, started: str) -> bool:
    """Whether this process (not a later one with its pid) still runs (a zombie is dead)."""
    fields = _stat(pid)
    return fields is not None and fields[19] == started and fields[0] != "Z"


def _training_children(parent: int) -> dict[int, str]:
    """The training processes (past their exec) of `parent`: pid -> start time."""
    found = {}
    for entry in Path("/proc").iterdir():
        fields = _stat(int(entry.name)) if entry.name.isdigit() else None
        if fields and fields[1] == str(parent):
            with contextlib.suppress(OSError):
                if b"moe_jax.train" in (entry / "cmdline").read_bytes():
                    found[int(entry.name)] = fields[19]
    return found


def _wait_until(condition, timeout: float):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = condition()
        if value:
            return value
        time.sleep(0.02)
    return condition()


def _launch(workdir: Path, *config: str) -> subprocess.Popen:
    return subprocess.Popen(
        [*LAUNCH, *config, *TINY, f"--workdir={workdir}", "--config.train.steps=2"],
        cwd=ROOT,
        env=subprocess_env(JAX_PLATFORMS="cpu"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def _start_two(workdir: Path) -> tuple[subprocess.Popen, dict[int, str]]:
    launcher = _launch(workdir)
    children = _wait_until(lambda: len(_training_children(launcher.pid)) == 2, 60)
    assert children, launcher.stderr.read() if launcher.poll() is not None else "no children"
    return launcher, _training_children(launcher.pid)


def _all_gone(children: dict[int, str], timeout: float = 30) -> bool:
    return _wait_until(lambda: not any(_alive(p, s) for p, s in children.items()), timeout)


STOPS = [signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP]


@pytest.mark.parametrize("sig", STOPS, ids=[s.name for s in STOPS])
def test_no_process_outlives_a_stopped_launcher(tmp_path, sig):
    launcher, children = _start_two(tmp_path / "run")
    launcher.send_signal(sig)
    _, stderr = launcher.communicate(timeout=120)
    assert _all_gone(children), children
    if sig == signal.SIGKILL:  # the kernel ends the children (their death signal)
        assert launcher.returncode == -signal.SIGKILL
        return
    # passed on; the processes stopped before training, so nothing was saved: 130 for a
    # Ctrl-C before training, as train's; 75 (stopped, run again) for the others
    assert launcher.returncode == (130 if sig == signal.SIGINT else 75), stderr[-2000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: stopped by {sig.name} before every process saved (")
    assert "Traceback" not in stderr


def test_a_failed_process_takes_the_others_along(tmp_path):
    launcher, children = _start_two(tmp_path / "run")
    second = next(
        p for p in children if b"--process_id=1" in Path(f"/proc/{p}/cmdline").read_bytes()
    )
    os.kill(second, signal.SIGKILL)  # process 1 dies at start (as the OOM killer would)
    _, stderr = launcher.communicate(timeout=120)
    assert _all_gone(children), children
    assert launcher.returncode == 128 + signal.SIGKILL
    last = stderr.strip().splitlines()[-1]
    said = "process 1 of 2 failed (killed by SIGKILL), the others were stopped: no error output"
    assert last == f"error: {said}"


# A config that fails in one process only (the launcher and the other process load it).
ONE_FAILS = """import runpy, sys
def get_config():
    if "--process_id={i}" in sys.argv:
        raise ValueError("process {i} cannot read its settings")
    return runpy.run_path({default!r})["get_config"]()
"""


@pytest.mark.parametrize("failing", [0, 1])
def test_a_process_that_fails_at_start_stops_the_others(tmp_path, failing):
    config = tmp_path / "config.py"
    config.write_text(ONE_FAILS.format(i=failing, default=str(ROOT / "configs" / "default.py")))
    workdir = tmp_path / "run"
    launcher = _launch(workdir, f"--config={config}")
    children: dict[int, str] = {}
    while launcher.poll() is None:  # the processes it started, however briefly
        children |= _training_children(launcher.pid)
        time.sleep(0.01)
    _, stderr = launcher.communicate(timeout=120)
    assert children and _all_gone(children), children
    assert launcher.returncode == 1
    # one error line (process 0's own, shown, is held back and said by the launcher)
    said = f"process {failing} of 2 failed (exit status 1), the others were stopped: "
    said += f"cannot load --config={config}: get_config() raised ValueError: "
    said += f"process {failing} cannot read its settings"
    assert [line for line in stderr.splitlines() if "error:" in line] == [f"error: {said}"]
    assert stderr.strip().splitlines()[-1] == f"error: {said}"
    assert not workdir.exists()  # bad input: the launcher's process_1.log is taken back


def test_a_bad_workdir_starts_no_process(tmp_path):
    (tmp_path / "blocker").write_text("a user's file\n")
    for workdir in (tmp_path / "blocker", tmp_path / "blocker" / "run"):
        done = subprocess.run(
            [*LAUNCH, *TINY, f"--workdir={workdir}"],
            cwd=ROOT,
            env=subprocess_env(JAX_PLATFORMS="cpu"),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 1 and "Traceback" not in done.stderr
        assert done.stderr.strip().splitlines()[-1].startswith(f"error: --workdir={workdir} ")
        # no process anywhere was started for this launch (its command lines name the path)
        assert not [
            entry.name
            for entry in Path("/proc").iterdir()
            if entry.name.isdigit() and str(tmp_path).encode() in _cmdline(entry)
        ]


def _cmdline(entry: Path) -> bytes:
    try:
        return (entry / "cmdline").read_bytes()
    except OSError:
        return b""


def test_the_launcher_checks_without_importing_jax():
    """Its checks cost a fraction of a second: no jax until a process starts."""
    code = (
        "import runpy, sys\n"
        "sys.argv = ['launch/local.py', '-n', '2', '--', '--config.moe.top_k=99']\n"
        "try:\n"
        "    runpy.run_path('launch/local.py', run_name='__main__')\n"
        "except SystemExit as stop:\n"
        "    print(stop.code, 'jax' in sys.modules, 'flax' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=subprocess_env(), capture_output=True, text=True
    )
    assert done.stdout.startswith("error: moe.top_k=99 is invalid"), done.stdout + done.stderr
    assert done.stdout.strip().endswith("False False")
