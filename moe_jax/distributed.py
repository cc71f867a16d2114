"""Start JAX's multi-controller runtime: one process per host (or per GPU).

Explicit flags win; otherwise `jax.distributed.initialize()` finds the
cluster itself (SLURM and other launchers); a lone process needs nothing.
On CPU the processes exchange collectives through gloo.
"""

from __future__ import annotations

import os

import jax


def initialize(coordinator: str = "", num_processes: int = 0, process_id: int = -1) -> None:
    """Joins this process to the job before any other JAX call."""
    explicit = bool(coordinator) or num_processes > 1
    if not explicit and "SLURM_JOB_ID" not in os.environ:
        return
    # Only the CPU backend reads this; GPU collectives go through NCCL regardless.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if explicit:
        if not coordinator or num_processes < 1 or not 0 <= process_id < num_processes:
            raise ValueError(
                f"--coordinator={coordinator!r} --num_processes={num_processes} "
                f"--process_id={process_id}: give all three, with 0 <= process_id < num_processes"
            )
        jax.distributed.initialize(coordinator, num_processes, process_id)
    else:
        jax.distributed.initialize()
