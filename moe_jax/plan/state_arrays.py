"""The train state's arrays as the planner sees them: every array of the `TrainState`
(traced abstractly, so any model change is followed) and where a plan places it, the
rule of `moe_jax.parallel.mesh.train_state_shardings`.

Why a module of its own: the memory model (`moe_jax.plan.memory`) sums these bytes,
and the cost model reads the same arrays for the gradient sync (`moe_jax.plan.grad_sync`)
and the parameter traffic (`moe_jax.plan.param_traffic`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re

import jax
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from moe_jax import optimizer
from moe_jax.config import Config, ModelConfig, MoEConfig, TrainConfig
from moe_jax.parallel import distributed_optimizer, mesh, registry
from moe_jax.parallel.layout import Layout, split_size
from moe_jax.parallel.pipeline import PIPELINED
from moe_jax.train_state import init_state


@dataclasses.dataclass(frozen=True)
class StateArray:
    """One array of the train state, before placement."""

    path: str
    shape: tuple[int, ...]
    itemsize: int
    names: tuple[str | None, ...]  # logical axes; () for plain arrays (replicated)
    part: str  # 'params', 'biases', 'opt_state', 'step' or 'rng'
    moment: bool  # an optimizer variable (ZeRO-1 splits it over 'data')
    stack: str | None  # 'dense' or 'moe': stacked over that stack's units on axis 0
    block: int | None  # of a stacked array: its block's place in the unit (`block_of`)


@functools.cache
def _state_arrays(model: ModelConfig, moe: MoEConfig, train: TrainConfig) -> tuple:
    _, state = jax.eval_shape(lambda: init_state(Config(model=model, moe=moe, train=train)))
    arrays = []
    leaves = jax.tree_util.tree_leaves_with_path(
        state, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )
    for path, leaf in leaves:
        keys = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", "")))) for k in path]
        variable = isinstance(leaf, nnx.Variable)
        value = leaf.get_value() if variable else leaf
        if not hasattr(value, "shape"):  # an optimizer's masked-out part (no array)
            continue
        names = tuple(leaf.get_metadata().get("out_sharding") or ()) if variable else ()
        arrays.append(
            StateArray(
                path=jax.tree_util.keystr(path),
                shape=tuple(value.shape),
                itemsize=np.dtype(value.dtype).itemsize,
                names=names,
                part=keys[0],
                moment=variable and keys[0] == "opt_state",
                stack=next((k for k in keys if k in ("dense", "moe")), None),
                block=int(keys[keys.index("blocks") + 1]) if "blocks" in keys else None,
            )
        )
    return tuple(arrays)


def state_arrays(config: Config) -> tuple[StateArray, ...]:
    """Every array of the `TrainState` of `config` (shapes only; nothing is allocated)."""
    t = config.train  # of the train settings, those that shape the state
    shaping = TrainConfig(
        grad_clip=float(t.grad_clip > 0), optimizer=t.optimizer, moment_dtype=t.moment_dtype
    )
    return _state_arrays(config.model, config.moe, shaping)


mesh_sizes = registry.mesh_sizes


def placement(
    config: Config, array: StateArray, shape: tuple[int, ...] | None = None, master: bool = True
) -> list:
    """Mesh axes of each dimension, the rule of `mesh.train_state_shardings`: logical axes
    by the plan's rules; with ZeRO-1 a moment also goes over 'data' on its first
    unsplit dimension divisible by the data size; with the distributed optimizer
    (ZeRO-2) a parameter and its moments are split further over every axis its gradient
    is summed over (`distributed_optimizer.master_spec`), unless `master` is False:
    the step's compute copy and its gradient, placed as the layout places the weight."""
    shape = array.shape if shape is None else shape
    layout = Layout(param_rules=registry.param_rules(config))
    zero = config.parallel.zero
    names = names_of(config, array)
    over_data = array.moment and zero == 1
    pad = over_data and not (config.train.optimizer == "muon" and _is_muon_matrix(array))
    spec = mesh.placement(layout, names, shape, config.parallel.data, over_data, pad)
    if zero == 2 and master and (array.part == "params" or array.moment):
        spec = distributed_optimizer.master_spec(mesh_sizes(config), P(*spec), shape, names)
        spec = [*spec, *[None] * (len(shape) - len(spec))]
    return spec


def param_name(array: StateArray) -> str:
    """A state array's parameter name: the last string key of its path."""
    keys = re.findall(r"\['([^']+)'\]", array.path)
    return keys[-1] if keys else ""


def _is_muon_matrix(array: StateArray) -> bool:
    """Whether Muon orthogonalises the parameter `array` belongs to (its moments are
    never padded: `moe_jax.parallel.zero_padding`)."""
    return len(array.shape) >= 2 and param_name(array) in optimizer.MUON_MATRICES


def names_of(config: Config, array: StateArray) -> tuple[str | None, ...]:
    """The logical axes `array` is placed by: a pipelined stack's renamed, as split over
    stages (its [R, U / R] form holds as many bytes)."""
    if config.parallel.stages > 1 and array.stack == "moe" and array.part != "biases":
        return (PIPELINED[1], *array.names[1:])
    return array.names


def synced_in_backward(config: Config, array: StateArray) -> bool:
    """Whether the step reduces this parameter's gradient inside the backward, layer by
    layer (`moe_jax.parallel.layer_sync`): a stacked weight under the distributed
    optimizer, without a pipeline or gradient accumulation."""
    p = config.parallel
    syncs = distributed_optimizer.syncs_in_backward(p.zero, p.stages, config.train.grad_accum)
    stacked = distributed_optimizer.start_of(names_of(config, array)) == 1
    return syncs and array.part == "params" and stacked


def split_of(axes, sizes: dict[str, int]) -> int:
    """Devices one dimension is split over (1 when unsplit)."""
    return split_size(axes, sizes)


def device_bytes(config: Config, array: StateArray, master: bool = True) -> int:
    """Bytes of `array` on one device (the largest shard); `master`: as `placement`."""
    shape = array.shape
    sizes = mesh_sizes(config)
    spec = placement(config, array, shape, master)
    return array.itemsize * math.prod(
        -(-dim // split_of(axes, sizes)) for dim, axes in zip(shape, spec, strict=True)
    )


def units(config: Config) -> list[tuple[str, int]]:
    """The repeated units in order: ('dense', 1) per dense-prefix layer, then
    ('moe', moe_every) per MoE unit (moe_every - 1 dense blocks and one MoE block)."""
    blocks: dict[tuple[str, int], int] = {}  # by `ModelConfig.block_of`, the model's rule
    for layer in range(config.model.num_layers):
        stack, unit, _, _ = config.model.block_of(layer)
        blocks[stack, unit] = blocks.get((stack, unit), 0) + 1
    return [(stack, count) for (stack, _), count in blocks.items()]


def placement_key(config: Config) -> Config:
    """`config` without the settings that place no array (micro-batches, chunks, rings,
    repeats, the schedule, the batch): one cache entry for the planner's many plans of
    one placement."""
    parallel = dataclasses.replace(
        config.parallel,
        overlap_chunks=1,
        collective_matmul=False,
        microbatches=1,
        repeats=1,
        schedule="gpipe",
        stash_depth=0,
    )
    train = dataclasses.replace(config.train, batch_size=1, grad_accum=1)
    return dataclasses.replace(config, parallel=parallel, train=train)


def block_params(config: Config) -> dict[str, float]:
    """Parameters one device holds of one dense layer ('dense'), one MoE layer ('moe') and
    the embedding table ('table'), as the plan places them, for the cost model's gradient
    accumulation and optimizer times: the compute copy's placement, whose gradient is
    accumulated (under the distributed optimizer too, where the float32 masters are cut
    further; the optimizer's time divides by the data groups under ZeRO 1 and 2). A
    layer's share: its stacked arrays' over the units they stack (counted without a
    pipeline, which splits only the units over 'stage'). Computed once per placement: the
    planner asks for thousands of plans that differ only in their schedule, overlap and
    batch, which place no parameter differently."""
    placed = placement_key(config)
    flat = dataclasses.replace(placed.parallel, stages=1)
    return dict(_block_params(dataclasses.replace(placed, parallel=flat)))


@functools.lru_cache(maxsize=4096)
def _block_params(flat: Config) -> dict[str, float]:
    moe_block = {}  # (stack, block in the unit) -> is MoE, by the model's own rule
    for layer in range(flat.model.num_layers):
        stack, _, block, moe = flat.model.block_of(layer)
        moe_block[stack, block] = moe
    layers: dict[tuple[str, int], float] = {}
    out = {"table": 0.0}
    for array in state_arrays(flat):
        if array.part != "params":
            continue
        elements = device_bytes(flat, array, master=False) / array.itemsize
        if array.stack is not None:
            key = array.stack, array.block
            layers[key] = layers.get(key, 0.0) + elements / array.shape[0]
        elif array.path.startswith(".params['embed']"):
            out["table"] += elements
    for key, elements in layers.items():
        out.setdefault("moe" if moe_block[key] else "dense", elements)
    return out


def state_bytes(config: Config) -> dict[str, int]:
    """params / grads / optimizer bytes of one device's share of the train state (every
    stage holds the same: a pipeline's stack is split over 'stage' by `placement`).
    Under the distributed optimizer (ZeRO-2) params also count the step's compute copy
    of every parameter in `model.dtype`, and the float32 gradients are the compute
    copy's (whole as the layout places it, before the reduce-scatter). Computed once per
    placement (`placement_key`), as `block_params`."""
    return dict(_state_bytes(placement_key(config)))


@functools.lru_cache(maxsize=4096)
def _state_bytes(config: Config) -> dict[str, int]:
    distributed = config.parallel.zero == 2
    compute = np.dtype(config.model.dtype).itemsize
    out = {"params": 0, "grads": 0, "optimizer": 0}
    for array in state_arrays(config):
        size = device_bytes(config, array)
        if array.part in ("params", "biases"):
            out["params"] += size
            if array.part == "params":
                whole = device_bytes(config, array, master=False) if distributed else size
                out["grads"] += whole
                out["params"] += whole * compute // array.itemsize if distributed else 0
        else:
            out["optimizer"] += size
    return out
