"""Where Muon's Newton-Schulz runs: each matrix whole on one device, the stack of
matrices (layers x experts x a pipeline's repeats) split over the devices.

Left to XLA, the five Newton-Schulz steps run on the weight's own sharding: each of
their 15 matmuls per matrix multiplies operands split along a matrix dimension, so
the partitioner gathers or reduces matrix-sized operands inside every step. Here the
Nesterov momentum is moved once to a placement where every matrix is whole and only
the batch (stacking) dimensions are split, over as many of the mesh axes the weight
was split over as divide them, the rest replicated; the orthogonalised update is
moved back to the weight's own placement once (torchtitan's block-wise sharding,
Megatron's layer-wise distributed optimizer). Two exchanges of the matrix per weight
replace 5 x 3 exchanges of matrix-sized operands (`docs/training.md`, Muon).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import NamedTuple

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from optax.contrib import MuonDimensionNumbers

from moe_jax.parallel import mesh as mesh_lib
from moe_jax.parallel.layout import Layout, axes_of
from moe_jax.parallel.scopes import MUON_EXCHANGE


class Placement(NamedTuple):
    """Where one Muon matrix's Newton-Schulz runs (`whole`), and where its update goes
    back to (`own`: the weight's sharding)."""

    whole: NamedSharding
    own: NamedSharding

    def run(self, fn: Callable[[jax.Array], jax.Array], x: jax.Array) -> jax.Array:
        """`fn` (Newton-Schulz on a block of whole matrices) on each device's block of
        `x` moved to `whole`, its result moved back to `own`: the two exchanges. In a
        shard_map, so that XLA cannot spread `fn`'s matmuls over the devices again (a
        constraint on the input alone lets the output's sharding propagate back in). `x`
        is pinned to `own` first: the momentum before it stays where the weight is (else
        XLA moves the gradient and the momentum, not their one Nesterov sum)."""
        with jax.named_scope(MUON_EXCHANGE):
            x = jax.lax.with_sharding_constraint(x, self.own)
            x = jax.lax.with_sharding_constraint(x, self.whole)
        spec = self.whole.spec
        out = jax.shard_map(fn, mesh=self.whole.mesh, in_specs=spec, out_specs=spec)(x)
        with jax.named_scope(MUON_EXCHANGE):
            return jax.lax.with_sharding_constraint(out, self.own)


def whole_matrix_spec(sizes: Mapping[str, int], spec: P, shape: tuple[int, ...], batch: int) -> P:
    """`spec` with the matrix dimensions (all but the first `batch`) whole: a mesh axis
    already on a batch dimension stays there; one on a matrix dimension moves to the
    last batch dimension whose per-device size it divides, or is dropped (those devices
    then each orthogonalise the same matrices)."""
    full = [axes_of(entry) for entry in (*spec, *[None] * (len(shape) - len(spec)))]
    moving = [axis for entry in full[batch:] for axis in entry if sizes[axis] > 1]
    placed = full[:batch]
    for axis in moving:
        for dim in reversed(range(batch)):
            local = shape[dim] // math.prod(sizes[a] for a in placed[dim])
            if local % sizes[axis] == 0:
                placed[dim] = (*placed[dim], axis)
                break
    entry = lambda axes: None if not axes else (axes[0] if len(axes) == 1 else axes)
    return P(*(entry(axes) for axes in placed), *[None] * (len(shape) - batch))


def batch_dims(shape: tuple[int, ...], dims) -> int:
    """How many leading dimensions of a Muon matrix of `shape` are batch dimensions, by
    its `MuonDimensionNumbers` (`moe_jax.optimizer.MUON_MATRICES`: the matrix
    dimensions are the trailing ones)."""
    matrix = {a % len(shape) for a in (*dims.reduction_axis, *dims.output_axis)}
    return len(shape) - len(matrix)


def placements(params, shardings, dimensions):
    """Per parameter its `Placement`, or None where AdamW updates it. `params`: the
    parameters (or their shapes), `shardings`: theirs as the step holds them
    (`moe_jax.parallel.mesh`), `dimensions`: their `moe_jax.optimizer.muon_dimensions`."""

    def place(dims, sharding, param):
        if dims is None:
            return None
        batch = batch_dims(param.shape, dims)
        spec = whole_matrix_spec(sharding.mesh.shape, sharding.spec, param.shape, batch)
        return Placement(NamedSharding(sharding.mesh, spec), sharding)

    is_dims = lambda x: x is None or isinstance(x, MuonDimensionNumbers)
    return jax.tree.map(place, dimensions, shardings, params, is_leaf=is_dims)


def of_state(state, layout: Layout | None, dimensions):
    """`placements` of a `TrainState`'s parameters as `layout` holds them (the
    distributed optimizer's masters included); None without a mesh (one device: the
    matrices are whole already). `dimensions`: `moe_jax.optimizer.muon_dimensions`."""
    if layout is None or layout.mesh is None:
        return None
    shardings = mesh_lib.train_state_shardings(state, layout, layout.zero).params
    return placements(state.params, shardings, dimensions(state.params))
