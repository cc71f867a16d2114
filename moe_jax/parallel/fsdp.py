"""Fully sharded data parallelism for attention and dense blocks.

The batch is split over every device, as in plain data parallelism, but each
weight of these blocks is stored split over the 'data' axis. A block
all-gathers its weights just before use; the gather's transpose in the
backward pass is a reduce-scatter, so each device keeps only its shard of the
gradient. Weight memory of these blocks drops by the data-parallel size for
one all-gather per block forward and one reduce-scatter backward.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from moe_jax.parallel import checks
from moe_jax.parallel.grad_exchange import gather_over_data
from moe_jax.parallel.layout import ALL, DATA
from moe_jax.parallel.spec import AttentionSpec


def _over_data(axis) -> bool:
    """Whether a dimension placed on mesh `axis` is split over 'data' as its minor part
    (a lone 'data', or a tuple ending in it), so a gather over 'data' undoes just that."""
    return axis == DATA or (isinstance(axis, tuple) and axis[-1:] == (DATA,))


def gather_weights(layout, weights, axes):
    """The weights with their 'data' split gathered, as stored (float32): their transpose,
    the gradient reduce-scatter (or `parallel.grad_exchange`'s bf16 all-to-all), then
    sums in float32 too. Used inside `shard_map`."""

    def gather(w, names):
        dims = [i for i, axis in enumerate(layout.param_spec(names)) if _over_data(axis)]
        return gather_over_data(layout, w, dims[0]) if dims else w

    return jax.tree.map(gather, weights, axes, is_leaf=lambda t: isinstance(t, tuple))


def fsdp_attention(layout, block, x, positions, weights, axes, attend):
    def body(x, positions, weights):
        return block(x, positions, gather_weights(layout, weights, axes), attend)

    spec = layout.activation_spec()
    in_specs = (spec, P(*spec[:2]), layout.weight_specs(axes))
    return layout.block_map(body, in_specs, spec)(x, positions, weights)


def fsdp_mlp(layout, block, x, weights, axes):
    def body(x, weights):
        return block(x, gather_weights(layout, weights, axes))

    spec = layout.activation_spec()
    in_specs = (spec, layout.weight_specs(axes))
    return layout.block_map(body, in_specs, spec)(x, weights)


def _problems(config) -> list[str]:
    d = config.parallel.data
    what = f"parallel.data={d} for parallel.attention='fsdp'"
    return checks.split_heads(config, d, what, splits_sequence=False) + checks.split_widths(
        config, d, what
    )


FSDP = AttentionSpec(
    name="fsdp",
    attention=fsdp_attention,
    mlp=fsdp_mlp,
    batch_axes=ALL,
    rules=lambda config: (("heads", DATA), ("kv_heads", DATA), ("mlp", DATA)),
    problems=_problems,
    weights_over=DATA,
)
