"""From a resolved plan (`config.parallel`, see `moe_jax.plan.resolve`) to a device
mesh, a `Layout`, and shardings.

One mesh with axes ('stage', 'data', 'expert', 'tensor'): `stage` pipeline stages
(outermost: consecutive devices, i.e. the nodes of a stage, stay together), each of
`data` data-parallel groups of an intra group of n = expert * tensor devices.
Attention and dense blocks use the intra group as one axis; expert blocks split
experts over 'expert' and expert width over 'tensor'. Parameters are placed by
logical-axis rules that come with the layout's specs (`moe_jax.parallel.registry`).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from moe_jax.config import Config
from moe_jax.data.documents import masked as documents_masked
from moe_jax.parallel import (
    distributed_optimizer,
    pipeline,
    pipeline_1f1b,
    registry,
    zero_padding,
)
from moe_jax.parallel.layout import DATA, MESH_AXES, STAGE, Layout, axes_of


def _resolved(config: Config) -> None:
    if not config.parallel.data or config.parallel.experts not in registry.EXPERTS:
        raise ValueError("the plan must be resolved first (moe_jax.plan.resolve.resolve)")


def make_mesh(config: Config, devices=None) -> Mesh:
    """The ('stage', 'data', 'expert', 'tensor') mesh of a resolved plan."""
    _resolved(config)
    devices = np.asarray(devices if devices is not None else jax.devices())
    p = config.parallel
    expert, tensor = registry.expert_split(config)
    return Mesh(devices.reshape(p.stages, p.data, expert, tensor), MESH_AXES)


def make_layout(config: Config, mesh: Mesh) -> Layout:
    _resolved(config)
    return Layout(
        mesh=mesh,
        attention_spec=registry.attention_spec(config),
        expert_spec=registry.expert_spec(config),
        param_rules=registry.param_rules(config),
        a2a_buffer_factor=config.parallel.a2a_buffer_factor,
        overlap_chunks=config.parallel.overlap_chunks,
        collective_matmul=config.parallel.collective_matmul,
        token_dtype=config.parallel.token_dtype,
        grad_exchange=config.parallel.grad_exchange,
        vocab_spec=registry.vocab_spec(config),
        pipeline_run=pipeline.run if config.parallel.stages > 1 else None,
        pipeline_loss=pipeline_1f1b.run_loss if config.parallel.schedule != "gpipe" else None,
        schedule=config.parallel.schedule,
        stash_depth=config.parallel.stash_depth,
        microbatches=config.parallel.microbatches,
        repeats=config.parallel.repeats,
        zero=config.parallel.zero,
        documents=documents_masked(config.data),
        track_peaks=config.train.qk_clip,
    )


def batch_sharding(layout: Layout) -> NamedSharding:
    """Token batches [batch, seq] as the attention layout splits them; a pipeline's also
    over 'stage' (each stage loads, embeds and scores its share of the rows)."""
    spec = layout.activation_spec(rank=2)
    if layout.stages > 1:
        spec = P((STAGE, *layout.batch_axes), *spec[1:])
    return NamedSharding(layout.mesh, spec)


def state_shardings(state, layout: Layout):
    """Shardings for any tree holding model variables (params, optimizer moments, ...).

    A variable is placed by its logical axis names and the layout's rules;
    anything else is replicated.
    """

    return _shardings(state, layout, over_data=False)


MASTERS = ("params", "opt_state")  # what the distributed optimizer splits


def train_state_shardings(state, layout: Layout, zero: int):
    """Shardings of a `TrainState`. ZeRO stage 1: the optimizer's moments also split over
    the 'data' axis (each data group updates its slice, then the new parameters are
    all-gathered). Stage 2, the distributed optimizer: the float32 master parameters and
    their moments placed as their reduced gradients are, split over every device that
    shares the parameter (`distributed_optimizer.master_spec`)."""
    shardings = _shardings(state, layout, over_data=False)
    if zero == 2:  # the router biases stay as they are: the sign rule updates them whole
        masters = {k: _shardings(getattr(state, k), layout, False, True) for k in MASTERS}
        return dataclasses.replace(shardings, **masters)
    if zero:
        opt_state = _shardings(state.opt_state, layout, over_data=True)
        shardings = dataclasses.replace(shardings, opt_state=opt_state)
    return shardings


def placement(
    layout: Layout, names, shape: tuple[int, ...], data: int, over_data: bool, pad: bool = False
) -> list:
    """Mesh axes of each dimension of an array with logical axes `names`: by the layout's
    rules; `over_data` (ZeRO-1 moments) also splits one unsplit dimension over 'data'
    (`zero_padding.data_dim`: one that `data` divides; with `pad`, of a moment's
    unpadded shape, the one it pads where none does). The planner's memory model places
    arrays with this too."""
    spec = list(layout.param_spec(names))
    spec += [None] * (len(shape) - len(spec))
    used = {a for entry in spec for a in axes_of(entry)}
    if over_data and data > 1 and DATA not in used:
        dim = zero_padding.data_dim(names, shape, spec, data, pad)
        if dim is not None:
            spec[dim] = DATA
    return spec


def moment_paddings(params, layout: Layout, eligible=None) -> tuple:
    """Per leaf of `params` (an nnx state, in `jax.tree.leaves` order) how ZeRO-1 pads its
    moments under `layout` (`zero_padding.Padding`): where `placement` splits one over
    'data' along a dimension the data size does not divide; `eligible`: which leaves may
    pad (all by default)."""
    variables = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, nnx.Variable))
    data = layout.mesh.shape[DATA] if layout.mesh is not None else 1
    if layout.zero != 1 or data == 1:
        return (None,) * len(variables)
    out = []
    for variable, pad in zip(variables, eligible or [True] * len(variables), strict=True):
        names = variable.get_metadata().get("out_sharding") or ()
        shape = variable.get_value().shape
        spec = placement(layout, names, shape, data, True, pad)
        uneven = [i for i, axes in enumerate(spec) if axes == DATA and shape[i] % data]
        dim = uneven[0] if uneven else None
        out.append(None if dim is None else (dim, zero_padding.padded_size(shape[dim], data)))
    return tuple(out)


def _shardings(state, layout: Layout, over_data: bool, master: bool = False):
    data = layout.mesh.shape[DATA]

    def spec(leaf):
        if not isinstance(leaf, nnx.Variable):
            return NamedSharding(layout.mesh, P())
        if not hasattr(leaf.get_value(), "shape"):  # an optimizer's masked-out part (no array)
            return leaf
        names = leaf.get_metadata().get("out_sharding") or ()
        shape = leaf.get_value().shape
        axes = P(*placement(layout, names, shape, data, over_data))
        if master:
            axes = distributed_optimizer.master_spec(layout.mesh.shape, axes, shape, names)
        return leaf.replace(NamedSharding(layout.mesh, axes))

    return jax.tree.map(spec, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
