"""A Hugging Face checkpoint into moe_jax parameters, placed straight into a plan's
shardings: each device shard is assembled from the tensors it covers (one layer's,
or one expert's, at a time) and sent to its devices, so no parameter is ever whole in
host memory, let alone the model."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from moe_jax.config import Config
from moe_jax.convert import deepseek, families, fp8
from moe_jax.convert.families import Family, Tensors
from moe_jax.convert.safetensors_files import SafetensorsDir


def _config_json(directory: Path) -> tuple[Path, dict[str, Any]]:
    path = directory / "config.json"
    if not path.is_file():
        raise ValueError(f"{directory}: no config.json (a Hugging Face checkpoint directory)")
    try:
        hf = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise ValueError(f"{path} is not JSON ({error})") from None
    if not isinstance(hf, dict):
        raise ValueError(
            f"{path} holds a JSON {type(hf).__name__}; a Hugging Face config.json is an "
            "object of settings"
        )
    return path, hf


def read_hf_config(directory: Path) -> tuple[Family, Config, dict[str, Any]]:
    """(family, moe_jax architecture, the raw config.json) of a checkpoint directory;
    one line for a setting it cannot take, its FP8 `quantization_config` included."""
    path, hf = _config_json(directory)
    try:
        family, config = families.to_config(hf, str(directory))
    except KeyError as key:
        raise ValueError(f"{path} has no {key} setting, which its family needs") from None
    except (TypeError, AttributeError, ArithmeticError) as error:
        raise ValueError(f"{path} has a setting of the wrong type or value ({error})") from None
    fp8.block_size(hf, str(path))
    return family, config, hf


def sources(family: Family, config: Config, fused: set[int]) -> dict[str, Any]:
    """moe_jax parameter path -> its `Tensors`: one for an unstacked parameter, a list
    over units for a stacked one, a list over units of lists over experts for experts.
    `fused`: the layers whose experts are stored fused. DeepSeek's also map the router
    biases (`ffn/bias`) and the MTP modules."""
    out: dict[str, Any] = dict(families.global_tensors(config))
    if family.architecture in families.DEEPSEEK:
        out = deepseek.with_mtp_copies(config, out)
        out.update(deepseek.mtp_tensors(config))
    for layer in range(config.model.num_layers):
        stack, unit, block, moe = config.model.block_of(layer)
        tensors = families.layer_tensors(family, config, layer, moe)
        if layer in fused:
            tensors.update(families.fused_expert_tensors(config, layer))
        for name, t in tensors.items():
            name, _, expert = name.partition("@")
            units = out.setdefault(f"{stack}/units/blocks/{block}/{name}", [])
            if unit == len(units):
                units.append([] if expert else t)
            if expert:
                units[unit].append(t)
    return out


def _all_tensors(tree) -> list[Tensors]:
    if isinstance(tree, Tensors):
        return [tree]
    return [t for item in tree for t in _all_tensors(item)]


def param_paths(params) -> dict[str, Any]:
    """'moe/units/blocks/0/attn/query' -> leaf, for an nnx.State of parameters."""
    flat = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        # A Variable's own field (`.value`) is an attribute key; names are dict keys.
        keys = [str(getattr(k, "key", getattr(k, "idx", ""))) for k in path]
        flat["/".join(k for k in keys if k)] = leaf
    return flat


def check_tensors(
    stored: dict[str, tuple[int, ...]],
    wanted: dict[str, Any],
    where: str,
    skipped: Callable[[str], bool] = lambda name: False,
):
    """One line for the first tensor that is missing, of the wrong shape, or left over
    (every tensor of the source must be consumed, but those `skipped` says hold nothing
    to read), before anything is read or written."""
    need: dict[str, tuple[int, ...]] = {}
    for tree in wanted.values():
        for t in _all_tensors(tree):
            need.update(t.shapes)
    missing = sorted(set(need) - set(stored))
    if missing:
        raise ValueError(f"{where}: tensor {missing[0]} is missing ({len(missing)} missing)")
    for name, shape in need.items():
        if tuple(stored[name]) != tuple(shape):
            raise ValueError(
                f"{where}: tensor {name} has shape {list(stored[name])}, expected {list(shape)}"
            )
    left = sorted(
        n
        for n in set(stored) - set(need)
        if not n.endswith(families.IGNORED_SUFFIXES) and not skipped(n)
    )
    if left:
        raise ValueError(
            f"{where}: tensor {left[0]} is not used by the {len(wanted)} parameters it maps "
            f"to ({len(left)} left over)"
        )


def _fused_layers(stored: dict[str, tuple[int, ...]], config: Config) -> set[int]:
    return {
        i
        for i in range(config.model.num_layers)
        if f"model.layers.{i}.mlp.experts.gate_up_proj" in stored
    }


def _block(source, read, index: tuple[slice, ...]) -> np.ndarray:
    """The part `index` of one parameter, built from the tensors it covers."""
    if isinstance(source, Tensors):
        return read(source)[index]
    picks = range(len(source))[index[0]]
    return np.stack([_block(source[i], read, index[1:]) for i in picks])


def _placed(leaf, sharding, source, read) -> jax.Array:
    """One parameter in `sharding`: each distinct device shard built once, sent to every
    device that holds it, then dropped from host memory."""
    by_index: dict[tuple, list] = {}
    for device, index in sharding.addressable_devices_indices_map(leaf.shape).items():
        key = tuple(s.indices(n) for s, n in zip(index, leaf.shape, strict=True))
        by_index.setdefault(key, [index, []])[1].append(device)
    arrays = []
    for index, devices in by_index.values():
        block = _block(source, read, index).astype(leaf.dtype)
        arrays += [jax.device_put(block, device) for device in devices]
    return jax.make_array_from_single_device_arrays(leaf.shape, sharding, arrays)


def load_params(directory: Path, family: Family, config: Config, abstract, shardings):
    """The parameters of the checkpoint in `directory`, laid out as `abstract` (an
    nnx.State of shapes) in `shardings`. One line for a missing shard, tensor, a wrong
    shape or a tensor left over, and for FP8 weights without their scales (`fp8`),
    before any tensor is read. Quantised weights are read as their float32 values."""
    return load_trees(directory, family, config, [(abstract, shardings)])[0]


def load_trees(directory: Path, family: Family, config: Config, trees: list) -> list:
    """`load_params` for several (abstract, shardings) trees: the parameters, every one
    of which a tensor must hold, then any others (the router biases: DeepSeek-V3's
    correction bias), whose leaves no tensor holds are zero."""
    path, hf = _config_json(directory)
    stored = SafetensorsDir(directory, fp8.block_size(hf, str(path)))
    wanted = sources(family, config, _fused_layers(stored.shapes, config))
    unmapped = sorted(set(param_paths(trees[0][0])) - set(wanted))
    if unmapped:
        raise ValueError(f"{directory}: no tensor maps to parameter {unmapped[0]}")
    if family.architecture in families.DEEPSEEK:  # MTP copies, or dropped MTP layers
        deepseek.check_mtp_stored(config, stored.shapes, str(directory))
        check_tensors(stored.shapes, wanted, str(directory), deepseek.skip(config))
    else:
        check_tensors(stored.shapes, wanted, str(directory))

    @functools.lru_cache(maxsize=16)  # shards of one parameter share their tensors
    def read(t: Tensors) -> np.ndarray:
        return np.asarray(t.read(stored.get), np.float32)

    def place(leaf, sharding, path: str) -> jax.Array:
        if path in wanted:
            return _placed(leaf, sharding, wanted[path], read)
        return jax.device_put(np.zeros(leaf.shape, leaf.dtype), sharding)

    out = []
    for abstract, shardings in trees:
        places = param_paths(shardings)
        flat = [place(leaf, places[p], p) for p, leaf in param_paths(abstract).items()]
        out.append(jax.tree.unflatten(jax.tree.structure(abstract), flat))
    return out
