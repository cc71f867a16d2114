"""Start JAX's multi-controller runtime: one process per host, or per GPU.

Explicit flags win. Inside a SLURM job step (`srun`) the step's tasks become
the processes; the batch script itself, or a lone process, stays single.
On CPU the processes exchange collectives through gloo.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

import jax


def _expand_counts(spec: str) -> list[int]:
    """SLURM's compressed per-node counts ("8(x2),4") as one int per node."""
    counts = []
    for part in spec.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not match:
            raise ValueError(f"cannot read SLURM task counts {spec!r}")
        counts += [int(match[1])] * int(match[2] or 1)
    return counts


def _visible_gpus(env: Mapping[str, str]) -> int:
    """GPUs this process may use, counted without starting CUDA."""
    if "CUDA_VISIBLE_DEVICES" in env:
        return len([d for d in env["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()])
    if "SLURM_GPUS_ON_NODE" in env:
        return int(env["SLURM_GPUS_ON_NODE"])
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


def slurm_local_devices(env: Mapping[str, str], gpus: int | None = None) -> list[int] | None:
    """The local GPU ids of this SLURM task: the node's GPUs split among its tasks.

    JAX alone gives every task [SLURM_LOCALID], so one process per node would
    drive one of its eight GPUs. Here one task per node takes all of them,
    eight tasks take one each, and a task that SLURM already bound to its own
    GPUs (fewer visible than tasks, or --gpus-per-task) takes all it sees.
    None on machines without GPUs.
    """
    gpus = _visible_gpus(env) if gpus is None else gpus
    if gpus == 0:
        return None
    tasks = _expand_counts(env["SLURM_STEP_TASKS_PER_NODE"])[int(env.get("SLURM_NODEID", 0))]
    if "SLURM_GPUS_PER_TASK" in env or gpus < tasks:
        return list(range(gpus))
    if gpus % tasks:
        raise ValueError(
            f"{tasks} tasks on this node cannot share {gpus} GPUs evenly; "
            "use --ntasks-per-node=1 or one task per GPU"
        )
    per_task = gpus // tasks
    local = int(env["SLURM_LOCALID"])
    return list(range(local * per_task, (local + 1) * per_task))


def in_slurm_step(env: Mapping[str, str]) -> bool:
    """Whether this process is one task of a multi-task `srun` step."""
    needed = ("SLURM_STEP_ID", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_NODELIST")
    return all(key in env for key in needed) and int(env["SLURM_STEP_NUM_TASKS"]) > 1


def initialize(coordinator: str = "", num_processes: int = 0, process_id: int = -1) -> bool:
    """Joins this process to the job before any other JAX call; whether there was one."""
    explicit = bool(coordinator) or num_processes > 1
    env = os.environ
    if not explicit and not in_slurm_step(env):
        return False
    # Only the CPU backend reads this; GPU collectives go through NCCL regardless.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if explicit:
        if not coordinator or num_processes < 1 or not 0 <= process_id < num_processes:
            raise ValueError(
                f"--coordinator={coordinator!r} --num_processes={num_processes} "
                f"--process_id={process_id}: give all three, with 0 <= process_id < num_processes"
            )
        jax.distributed.initialize(coordinator, num_processes, process_id)
        return True
    # JAX finds the coordinator (first node of the step) itself; the process
    # count is the step's, which may be fewer than the job's SLURM_NTASKS.
    devices = None if "JAX_LOCAL_DEVICE_IDS" in env else slurm_local_devices(env)
    jax.distributed.initialize(
        num_processes=int(env["SLURM_STEP_NUM_TASKS"]),
        process_id=int(env["SLURM_PROCID"]),
        local_device_ids=devices,
    )
    return True
