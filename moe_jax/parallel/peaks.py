"""Each attention head's peak logit out of the layout that runs it (QK-clip's
statistic, `train.qk_clip`).

Why a recorder: the peak is found where attention runs, inside a layout's block on
the heads and sequences one device holds, and a layout's block function returns only
the block's output. Rather than every layout threading a second output through its
shard_map, the model's attention function `record`s its peaks while the block runs
(`recording`), and `Layout.block_map` returns them out of the block's shard_map,
reduced there to every head's maximum over all devices (`global_peaks`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp

from moe_jax.kernels.varying import varying_axes
from moe_jax.parallel.mesh_axes import STAGE
from moe_jax.parallel.scopes import ATTENTION_PEAKS

METRIC = "attention_peaks"  # the step's metric of each layer's peaks (`train_step.loss_fn`)
_OPEN: list[list[jax.Array]] = []  # the recordings open, innermost last


@contextlib.contextmanager
def recording() -> Iterator[list[jax.Array]]:
    """The peaks `record`ed while the block runs (one per attention call: a layout that
    attends chunk by chunk records each chunk's)."""
    seen: list[jax.Array] = []
    _OPEN.append(seen)
    try:
        yield seen
    finally:
        _OPEN.pop()


def recording_now() -> bool:
    return bool(_OPEN)


def record(peak: jax.Array) -> None:
    _OPEN[-1].append(peak)


def global_peaks(seen: list[jax.Array], heads_axis=None, shards: int = 1) -> jax.Array:
    """[heads] float32: the largest of `seen`, each device's heads put in place when
    the heads are split in `shards` contiguous blocks over mesh `heads_axis`, then the
    maximum over every mesh axis it varies over (inside shard_map; outside, itself)."""
    peak = jax.lax.stop_gradient(jnp.max(jnp.stack(seen), 0))
    if heads_axis is not None and shards > 1:
        whole = jnp.full((peak.shape[0] * shards,), -jnp.inf, peak.dtype)
        start = jax.lax.axis_index(heads_axis) * peak.shape[0]
        peak = jax.lax.dynamic_update_slice(whole, peak, (start,))
    # not over a pipeline's stages: they hold different layers (`pipeline.mean_stats`)
    return maximum(peak, varying_axes(peak) - {STAGE})


def maximum(x: jax.Array, axes) -> jax.Array:
    """`x`'s maximum over mesh `axes` (a set; empty: `x` itself), no gradient through
    it, under the peaks' scope."""
    if not axes:
        return x
    with jax.named_scope(ATTENTION_PEAKS):
        return jax.lax.pmax(jax.lax.stop_gradient(x), tuple(sorted(axes)))


def returning(body: Callable, heads_axis, shards: int) -> Callable:
    """`body` -> (its output, the global peaks recorded while it ran)."""

    def run(*args):
        with recording() as seen:
            out = body(*args)
        return out, global_peaks(seen, heads_axis, shards)

    return run


def recorded(fn: Callable) -> Callable:
    """`fn` -> (out, peaks) as its output alone, the peaks `record`ed."""

    def run(*args):
        out, peak = fn(*args)
        record(peak)
        return out

    return run


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class WithPeaks:
    """A block's, unit's or model's statistics where the peaks are tracked
    (`Layout.track_peaks`): the MoE statistics as without them (or None), and the
    peaks: [heads] for a block, [blocks, heads] for a unit, stacked over a stack's
    units, and per stack name for the model (`Transformer.features`)."""

    moe: object
    peaks: jax.Array | dict


def split_peaks(stats):
    """(the MoE statistics, the peaks or None) of statistics with or without peaks."""
    return (stats.moe, stats.peaks) if isinstance(stats, WithPeaks) else (stats, None)


def max_over_devices(peaks):
    """`peaks` (a tree) as their maximum over every mesh axis they still vary over: a
    step's metric, after a pipeline's stages have each put in their own layers'."""

    return jax.tree.map(lambda x: maximum(x, varying_axes(x)), peaks)


def map_stats(summed: Callable, topped: Callable, *trees):
    """`summed` over every leaf of statistics `trees` alike, `topped` over their peaks'
    leaves instead: where statistics are summed or averaged (micro-batches, stages),
    the peaks take their maximum."""

    def node(*nodes):
        if not isinstance(nodes[0], WithPeaks):
            return jax.tree.map(summed, *nodes)
        moe = jax.tree.map(summed, *(n.moe for n in nodes))
        return WithPeaks(moe, jax.tree.map(topped, *(n.peaks for n in nodes)))

    return jax.tree.map(node, *trees, is_leaf=lambda x: isinstance(x, WithPeaks))
