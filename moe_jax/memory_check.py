"""Whether a plan fits the devices' memory, decided before anything is compiled.

Why: a plan that does not fit otherwise fails minutes later, in XLA's allocator, with
a message about buffers rather than settings. The planner's memory model
(`moe_jax.plan.memory`) predicts the bytes per device; this compares them with what
the device offers and says what to change.
"""

from __future__ import annotations

import math
import os

import jax

from moe_jax.config import Config
from moe_jax.flops import active_matmul_params
from moe_jax.plan import memory, state_arrays
from moe_jax.plan.describe import plan_line

GB = 1e9
HOST_SHARE = 0.9  # of the machine's RAM, left to CPU devices (the rest: Python, the OS)


def device_limit(config: Config) -> tuple[float, str]:
    """(bytes per device, where the figure comes from)."""
    if config.train.memory_limit_gb:
        return config.train.memory_limit_gb * GB, "train.memory_limit_gb"
    device = jax.local_devices()[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and stats.get("bytes_limit"):
        return float(stats["bytes_limit"]), f"{device.device_kind}'s limit"
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    n = jax.local_device_count()
    return ram * HOST_SHARE / n, f"{HOST_SHARE:.0%} of this machine's RAM over {n} device(s)"


def parameter_counts(config: Config) -> tuple[int, int]:
    """(all parameters, those one token multiplies by)."""
    arrays = state_arrays.state_arrays(config)
    total = sum(math.prod(a.shape) for a in arrays if a.part == "params")
    return total, sum(active_matmul_params(config.model, config.moe).values())


def summary(config: Config) -> tuple[memory.Memory, float, list[str]]:
    """(predicted memory per device, the limit, start-up lines saying both)."""
    need = memory.memory_per_device(config)
    limit, source = device_limit(config)
    total, active = parameter_counts(config)
    lines = [
        f"devices: {jax.device_count()} x {jax.devices()[0].device_kind}; "
        f"plan: {plan_line(config.parallel)}",
        f"parameters: {total / 1e6:,.1f}M, {active / 1e6:,.1f}M active per token",
        f"memory per device (predicted): {need.total / GB:.2f} GB ({_parts(need)}) of "
        f"{limit / GB:.2f} GB ({source})",
    ]
    return need, limit, lines


def _parts(m: memory.Memory) -> str:
    return (
        f"params {m.params / GB:.2f}, grads {m.grads / GB:.2f}, "
        f"optimizer {m.optimizer / GB:.2f}, activations {m.activations / GB:.2f}"
    )


def check(config: Config, need: memory.Memory, limit: float) -> None:
    """A one-line ValueError when the resolved plan needs more than `limit` per device."""
    if need.total <= limit:
        return
    raise ValueError(
        f"the plan needs {need.total / GB:.1f} GB per device ({_parts(need)}) but "
        f"{limit / GB:.1f} GB are available; lower train.batch_size or raise "
        "train.grad_accum, set model.remat='selective' or 'full', parallel.zero=1, "
        "parallel.expert_fsdp=True, parallel.vocab_parallel=True or parallel.attention="
        "'fsdp', use more devices, or set train.memory_limit_gb if the limit is wrong"
    )
