"""`moe.impl=tokamax`: the grouped GEMM of openxla's tokamax kernel library.

`tokamax.ragged_dot` has `jax.lax.ragged_dot`'s contract (rows sorted by group,
unpadded, `group_sizes` per group) and picks a kernel per device: Mosaic GPU on
NVIDIA GPUs (Hopper and later), Mosaic on TPU, Triton when jax-triton is installed,
else XLA's own ragged_dot (so on CPU it equals `ragged_dot`). tokamax brings heavy
dependencies, so it is optional (`pip install tokamax==0.0.17`; it needs
jax>=0.11.1) and imported only when used.
"""

from __future__ import annotations

import functools
from types import ModuleType

import jax
import jax.numpy as jnp

from moe_jax.kernels.requirements import TOKAMAX_MISSING


@functools.cache
def _module() -> ModuleType | None:
    try:
        import tokamax
    except ImportError:
        return None
    return tokamax


def missing() -> str | None:
    """None when tokamax imports, else the one-line reason `moe.impl=tokamax` cannot run."""
    return None if _module() is not None else TOKAMAX_MISSING


def tokamax_gmm(
    x: jax.Array, w: jax.Array, group_sizes: jax.Array, implementation: str | None = None
) -> jax.Array:
    """[M, d] x [E, d, f] -> [M, f] for rows grouped by `group_sizes` [E];
    `implementation`: None (tokamax's choice for the device), 'mosaic', 'triton' or 'xla'."""
    tokamax = _module()
    if tokamax is None:
        raise ImportError(missing())
    return tokamax.ragged_dot(x, w, group_sizes.astype(jnp.int32), implementation=implementation)
