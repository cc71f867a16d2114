"""One line that names a plan, in `ParallelConfig`'s own words.

Why one function: the trainer's start-up block, the memory check, `python -m
moe_jax.plan` and `comm_report` each print the plan they run or predict; printed
from one list of fields, no printout leaves a setting out or names it differently.
"""

from __future__ import annotations

from moe_jax.config import ParallelConfig

# The settings that decide what a step runs, in the order they are printed.
PLAN_FIELDS = (
    "attention",
    "experts",
    "intra",
    "data",
    "zero",
    "etp",
    "expert_fsdp",
    "vocab_parallel",
    "overlap_chunks",
    "collective_matmul",
    "token_dtype",
    "grad_exchange",
    "stages",
    "microbatches",
    "repeats",
)


def plan_line(parallel: ParallelConfig) -> str:
    """`attention=sp experts=ep_a2a intra=8 ...`: every field of `PLAN_FIELDS`."""
    return " ".join(f"{name}={getattr(parallel, name)}" for name in PLAN_FIELDS)
