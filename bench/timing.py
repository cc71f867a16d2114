"""Timing shared by the benchmark scripts (run as `python bench/<script>.py`)."""

from __future__ import annotations

import time

import jax


def median_seconds(fn, args, repeats: int) -> float:
    """Median seconds per call of the compiled jitted `fn` on `args`, after one
    untimed warm-up call when repeated (compilation is never timed)."""
    compiled = fn.lower(*args).compile()
    if repeats > 1:
        jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]
