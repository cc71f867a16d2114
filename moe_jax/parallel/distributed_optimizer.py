"""The distributed optimizer (`parallel.zero=2`): float32 master weights and AdamW moments
split over every device that shares a parameter, compute weights gathered in the model's
dtype once per step, gradients reduce-scattered back to the masters.

Megatron's distributed optimizer, built on the step run per device
(`moe_jax.parallel.per_device_step`): a parameter replicated over mesh axes (the intra
group where a layout does not split it, 'data', 'stage' outside a pipelined stack) is
stored as 1/g of itself, cut along the first dimension the g devices divide (the
placement `grad_exchange.reduced_spec` gives a reduced gradient; a stacked weight never
along its layer axis), and so are its two moments. Each step:

1. `compute_weights`: each master shard is cast to `model.dtype` and all-gathered over
   those axes: bf16 on the wire in a bfloat16 model, and the whole copy the step's
   forward and backward read (held until the step ends).
2. The loss and its gradients run per device; micro-batches accumulate in float32 on
   the device, unreduced.
3. `reduce_gradient`: once per step, each float32 gradient is reduce-scattered to its
   master's shard (a float32 reduce-scatter, or with `parallel.grad_exchange='bf16_a2a'`
   bf16 shards summed in float32, `grad_exchange.exchange`). With one micro-batch and
   no pipeline, a stacked layer weight's is reduced inside the backward, layer by
   layer, as soon as the layer scan's backward has it (`moe_jax.parallel.layer_sync`),
   while the layer below computes; the rest after the backward.
4. AdamW updates each shard where it lives: no gather of float32 parameters after the
   update (ZeRO stage 1 gathers them back; here the next step's gather in the model's
   dtype does instead).

The master placement is a sharding, not a shape: checkpoints hold the same global arrays
as with `zero` 0 or 1 and restore under any plan.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from moe_jax.parallel import grad_exchange
from moe_jax.parallel.grad_exchange import cut_dimension, summed_axes
from moe_jax.parallel.scopes import GRAD_EXCHANGE, WEIGHT_GATHER

LAYERS = "layers"  # the logical axis of a stack's layers (`moe_jax.model.transformer.Stack`)


def start_of(names) -> int:
    """The leading dimensions a master is never cut along: a stacked weight's layer axis,
    so that each layer's slice is itself cut into shards, and the backward can reduce a
    layer's gradient as soon as it has it (`moe_jax.parallel.layer_sync`)."""
    return 1 if tuple(names[:1]) == (LAYERS,) else 0


def syncs_in_backward(zero: int, stages: int, grad_accum: int) -> bool:
    """Whether the step reduces the stacked weights' gradients inside the backward
    (`moe_jax.parallel.layer_sync`): under the distributed optimizer, with one
    micro-batch and no pipeline. The trainer and the planner's models both ask here."""
    return zero == 2 and stages == 1 and grad_accum == 1


def starts(params):
    """`start_of` each parameter of an nnx state, read from its logical axes."""
    start = lambda v: v.replace(start_of(v.get_metadata().get("out_sharding") or ()))
    return jax.tree.map(start, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def master_spec(sizes: Mapping[str, int], spec: P, shape: tuple[int, ...], names=()) -> P:
    """Where a parameter placed by `spec` (logical axes `names`) keeps its float32 master
    and moments: split further over the axes its gradient is summed over
    (`grad_exchange.reduced_spec`, from `start_of(names)` on), or as `spec` where no
    dimension divides."""
    return grad_exchange.reduced_spec(sizes, spec, shape, start_of(names))


def compute_weights(
    sizes: Mapping[str, int], master: jax.Array, spec: P, shape, dtype, start: int = 0
):
    """Inside the step's shard_map: this device's master shard -> its piece of the
    parameter as `spec` places it, in `dtype` (cast before the gather: the wire carries
    the compute dtype)."""
    dim, axes = cut_dimension(sizes, spec, shape, start), summed_axes(spec)
    weights = master.astype(dtype)
    if dim is None or not axes:
        return weights
    with jax.named_scope(WEIGHT_GATHER):
        return jax.lax.all_gather(weights, axes, axis=dim, tiled=True)


def reduce_gradient(
    sizes: Mapping[str, int], g: jax.Array, spec: P, shape, compressed: bool, start: int = 0
):
    """Inside the step's shard_map: this device's partial gradient (any dtype) -> its
    master's shard of the float32 sum over the devices that share the parameter."""
    g = g.astype(jnp.float32)
    if compressed:
        return grad_exchange.exchange(sizes, g, spec, shape, start)
    dim, axes = cut_dimension(sizes, spec, shape, start), summed_axes(spec)
    if not axes:
        return g
    with jax.named_scope(GRAD_EXCHANGE):
        if dim is None:
            return jax.lax.psum(g, axes)
        return jax.lax.psum_scatter(g, axes, scatter_dimension=dim, tiled=True)
