"""Logical axis names for parameters and activations.

Model code names axes only logically ('batch', 'seq', 'embed', 'heads',
'kv_heads', 'head_dim', 'mlp', 'experts', 'vocab', 'layers'). How those map
onto mesh axes is decided in `moe_jax.parallel`: parameters by the layout's
`param_rules`. Activations carry no annotation: each layout's `shard_map` specs
say where they are between blocks (`Layout.activation_spec`), and under plain
data parallelism GSPMD follows the batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

AxisNames = tuple[str | None, ...]


def param(
    rngs: nnx.Rngs, shape: Sequence[int], names: AxisNames, fan_in: int | None = None
) -> nnx.Param:
    """A float32 parameter, normal with std 1/sqrt(fan_in), tagged with logical axes."""
    std = 1.0 / math.sqrt(fan_in if fan_in is not None else shape[0])
    value = nnx.initializers.normal(std)(rngs.params(), tuple(shape), jnp.float32)
    return _tagged(value, names)


def ones_param(shape: Sequence[int], names: AxisNames) -> nnx.Param:
    return _tagged(jnp.ones(tuple(shape), jnp.float32), names)


def zeros_param(shape: Sequence[int], names: AxisNames) -> nnx.Param:
    return _tagged(jnp.zeros(tuple(shape), jnp.float32), names)


def _tagged(value: jax.Array, names: AxisNames) -> nnx.Param:
    # Placement is applied later by moe_jax.parallel, so no eager sharding here.
    return nnx.Param(value, out_sharding=names, eager_sharding=False)
