"""ZeRO-1's moments where no dimension divides the data groups: padded until one does.

`parallel.zero=1` splits each optimizer moment over 'data' along its first unsplit
dimension that the data size divides (`moe_jax.parallel.mesh.placement`). Where none
does, the moments would stay whole on every data group: the paper's 352B plan has 12
data groups against dimensions of 2^k and 7 2^k, so there the split saved nothing. As
Megatron's distributed optimizer pads its flat buffer to a multiple of the data size,
such a moment is stored with one dimension padded with zeros up to a multiple of the data
size, and split along it: the unsplit dimension padded least (never a stack's layer
axis, which a pipeline's checkpoint form reshapes), so no device holds more than the
unpadded moment's 1/data and a row.

Each step pads the gradients and the parameters with zeros (`pad`), updates, and drops
the padding of the updates (`unpad`): zero gradients keep zero moments and give zero
updates, and every other element is computed as without the padding. Muon's matrices
are not padded (its update reads their shapes). Checkpoints hold the moments padded;
restoring pads or truncates the zeros to the restoring plan's form (`moe_jax.checkpoint`).
Which moment pads, and how much, is `moe_jax.parallel.mesh.moment_paddings`: the
placement that also gives the moments' shardings.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_jax.parallel.pipeline import PIPELINED

# A stack's layer axes: never padded (`moe_jax.model.transformer.Stack`, and the
# [repeats, layers / repeats] form a pipeline holds it in).
STACK_AXES = frozenset({"layers", *PIPELINED})

Padding = tuple[int, int] | None  # (dimension, padded size), or None: stored as it is


def data_dim(names, shape: tuple[int, ...], spec, data: int, pad: bool) -> int | None:
    """The dimension ZeRO-1 splits a moment over `data` groups along, `spec` its mesh
    axes per dimension: the first unsplit one that `data` divides; with `pad`, where
    none does, the unsplit one whose padding to a multiple of `data` adds the least
    (the first of equals), never a stack's layer axis. None: the moment stays whole."""
    names = (*names, *[None] * (len(shape) - len(names)))
    free = [i for i, axes in enumerate(spec) if axes is None]
    even = [i for i in free if shape[i] % data == 0]
    if even or not pad:
        return even[0] if even else None
    free = [i for i in free if names[i] not in STACK_AXES and shape[i] > 0]
    return min(free, key=lambda i: (padded_size(shape[i], data) / shape[i], i), default=None)


def padded_size(size: int, data: int) -> int:
    return -(-size // data) * data


def pad(tree, pads: tuple[Padding, ...]):
    """`tree` (leaves in `mesh.moment_paddings`' order) with each padded leaf's zeros appended."""
    if not any(pads):
        return tree
    leaves, treedef = jax.tree.flatten(tree)
    return treedef.unflatten([_pad(x, p) for x, p in zip(leaves, pads, strict=True)])


def unpad(tree, pads: tuple[Padding, ...], shapes):
    """`tree` with each padded leaf cut back to its shape in `shapes` (a tree like it)."""
    if not any(pads):
        return tree
    leaves, treedef = jax.tree.flatten(tree)
    sizes = [x.shape for x in jax.tree.leaves(shapes)]
    cut = lambda x, p, shape: x if p is None else jax.lax.slice_in_dim(x, 0, shape[p[0]], axis=p[0])
    return treedef.unflatten([cut(x, p, s) for x, p, s in zip(leaves, pads, sizes, strict=True)])


def _pad(x: jax.Array, padding: Padding) -> jax.Array:
    if padding is None:
        return x
    dim, size = padding
    widths = [(0, size - x.shape[dim] if i == dim else 0) for i in range(x.ndim)]
    return jnp.pad(x, widths)
