"""Timing shared by the benchmark scripts (run as `python bench/<script>.py`)."""

from __future__ import annotations

import time

import jax

HEADROOM = 0.9  # of the device's free memory a timed program may plan to use


class DoesNotFit(Exception):
    """A compiled program whose buffers would not fit in the device's free memory: it
    is skipped (with this message), not run into an out-of-memory error."""


def check_fits(compiled, free_bytes: int | None = None) -> None:
    """Raises DoesNotFit when `compiled`'s temporaries and outputs (XLA's memory
    analysis, known before it runs) exceed HEADROOM of `free_bytes` (default: what
    the first device's allocator has left; unknown on CPU, so nothing is checked).
    On a GPU `lax.ragged_dot` may become a zero-padded dense product whose temporary
    is experts times the output: that is what this catches."""
    if free_bytes is None:
        try:
            stats = jax.devices()[0].memory_stats() or {}
        except Exception:  # a backend without memory statistics
            stats = {}
        if "bytes_limit" not in stats:
            return
        free_bytes = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    try:
        analysis = compiled.memory_analysis()
    except Exception:  # not every backend implements it
        return
    if analysis is None:
        return
    need = analysis.temp_size_in_bytes + analysis.output_size_in_bytes
    if need > HEADROOM * free_bytes:
        raise DoesNotFit(
            f"needs {need / 2**30:.2f} GiB (temporaries {analysis.temp_size_in_bytes / 2**30:.2f}"
            f" GiB), {free_bytes / 2**30:.2f} GiB free"
        )


def median_seconds(fn, args, repeats: int) -> float:
    """Median seconds per call of the compiled jitted `fn` on `args`, after one
    untimed warm-up call when repeated (compilation is never timed). Raises
    DoesNotFit, before running anything, for a program the device cannot hold."""
    compiled = fn.lower(*args).compile()
    check_fits(compiled)
    if repeats > 1:
        jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]
