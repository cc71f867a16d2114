"""One line that names a plan, in `ParallelConfig`'s own words, and the flags that run it.

Why one function: the trainer's start-up block, the memory check, `python -m
moe_jax.plan` and `comm_report` each print the plan they run or predict; printed
from one list of fields, no printout leaves a setting out or names it differently.
"""

from __future__ import annotations

import dataclasses
import shlex

from moe_jax.config import SECTIONS, Config, ParallelConfig

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
    "schedule",
    "stash_depth",
)


def plan_line(parallel: ParallelConfig) -> str:
    """`attention=sp experts=ep_a2a intra=8 ...`: every field of `PLAN_FIELDS`."""
    return " ".join(f"{name}={getattr(parallel, name)}" for name in PLAN_FIELDS)


def changed_settings(run: Config, base: Config) -> list[tuple[str, object]]:
    """(`section.setting`, value) of every setting `run` holds differently from `base`:
    the parallel ones first, in `PLAN_FIELDS` order, then the rest section by section."""
    found = []
    for section in ("parallel", *(s for s in SECTIONS if s != "parallel")):
        ran, was = getattr(run, section), getattr(base, section)
        names = [f.name for f in dataclasses.fields(ran)]
        if section == "parallel":
            names.sort(key=lambda n: PLAN_FIELDS.index(n) if n in PLAN_FIELDS else -1)
        found += [
            (f"{section}.{n}", getattr(ran, n)) for n in names if getattr(ran, n) != getattr(was, n)
        ]
    return found


def flag_line(run: Config, base: Config) -> str:
    """The `--config.<section>.<setting>=value` flags that turn `base` (a config file's
    settings) into `run`, as one line to paste after `--config=FILE`."""
    return " ".join(
        f"--config.{name}={shlex.quote(_flag_value(value))}"
        for name, value in changed_settings(run, base)
    )


def _flag_value(value: object) -> str:
    """A value as the config flags parse it back (floats exactly, by repr)."""
    return repr(value) if isinstance(value, float) else str(value)
