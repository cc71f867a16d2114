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
replace 5 x 3 exchanges of matrix-sized operands (`docs/training.md`, Muon). Both are
written out in one shard_map, an all-to-all (or all-gather) per mesh axis: left to the
partitioner (sharding constraints), a weight split over two axes on matrix dimensions
(Mixtral's experts over data and tensor) was replicated whole instead, tripling the
64-device step's memory.
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


class Move(NamedTuple):
    """One mesh axis taken off a matrix dimension: `all_to_all` onto stacking dimension
    `stack` (its stack then split over the axis), or `all_gather` where `stack` is None
    (those devices then each orthogonalise the same matrices)."""

    axis: str
    matrix: int
    stack: int | None


class Placement(NamedTuple):
    """Where one Muon matrix's Newton-Schulz runs (`whole`: each matrix whole, the stack
    split), where its update goes back to (`own`: the weight's sharding), and the
    `moves` between them, in the order they run."""

    whole: NamedSharding
    own: NamedSharding
    moves: tuple[Move, ...]

    def run(self, fn: Callable[[jax.Array], jax.Array], x: jax.Array) -> jax.Array:
        """`fn` (Newton-Schulz on a block of whole matrices) on each device's block of
        `x` moved to `whole`, its result moved back to `own`, in one shard_map over the
        mesh whose blocks are the weight's own: each axis of `moves` taken off its
        matrix dimension by an explicit all-to-all (or all-gather), and put back by the
        inverse all-to-all (or each device's slice). Left to XLA's partitioner, a move
        of two axes at once is done by replicating the whole weight."""

        def local(block):
            with jax.named_scope(MUON_EXCHANGE):
                for m in self.moves:
                    if m.stack is None:
                        block = jax.lax.all_gather(block, m.axis, axis=m.matrix, tiled=True)
                    else:
                        block = jax.lax.all_to_all(block, m.axis, m.stack, m.matrix, tiled=True)
            block = fn(block)
            with jax.named_scope(MUON_EXCHANGE):
                for m in reversed(self.moves):
                    if m.stack is None:
                        size = block.shape[m.matrix] // self.own.mesh.shape[m.axis]
                        start = jax.lax.axis_index(m.axis) * size
                        block = jax.lax.dynamic_slice_in_dim(block, start, size, m.matrix)
                    else:
                        block = jax.lax.all_to_all(block, m.axis, m.matrix, m.stack, tiled=True)
            return block

        spec = self.own.spec
        return jax.shard_map(local, mesh=self.own.mesh, in_specs=spec, out_specs=spec)(x)


def whole_matrix_moves(
    sizes: Mapping[str, int], spec: P, shape: tuple[int, ...], batch: int
) -> tuple[P, tuple[Move, ...]]:
    """`spec` with the matrix dimensions (all but the first `batch`) whole, and the moves
    there: a mesh axis already on a batch dimension stays there; one on a matrix
    dimension moves to the last batch dimension whose per-device size it divides, or is
    dropped. Each matrix dimension's axes move innermost first (each all-to-all then
    concatenates whole blocks in order), each onto its stacking dimension's end."""
    full = [axes_of(entry) for entry in (*spec, *[None] * (len(shape) - len(spec)))]
    placed, moves = full[:batch], []
    for dim in range(batch, len(shape)):
        for axis in reversed(full[dim]):
            if sizes[axis] == 1:
                continue
            target = None
            for stack in reversed(range(batch)):
                local = shape[stack] // math.prod(sizes[a] for a in placed[stack])
                if local % sizes[axis] == 0:
                    placed[stack], target = (*placed[stack], axis), stack
                    break
            moves.append(Move(axis, dim, target))
    entry = lambda axes: None if not axes else (axes[0] if len(axes) == 1 else axes)
    whole = P(*(entry(axes) for axes in placed), *[None] * (len(shape) - batch))
    return whole, tuple(moves)


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
        mesh = sharding.mesh
        spec, moves = whole_matrix_moves(mesh.shape, sharding.spec, param.shape, batch)
        return Placement(NamedSharding(mesh, spec), sharding, moves)

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
