"""A Hugging Face checkpoint directory's `*.safetensors` shards, read lazily, and sharded
writing of new ones. Only headers are read up front; a tensor (or a slice of it, such
as one expert of a fused [E, ...] tensor) is read when asked for, so a model never
sits whole in host memory. Block-scaled FP8 weights (`fp8`) read as their float32
values."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import numpy as np
from safetensors import safe_open
from safetensors.flax import save_file

from moe_jax import paths
from moe_jax.convert import fp8

INDEX = "model.safetensors.index.json"


class Lazy:
    """One stored tensor; indexing reads just that part, as float32 numpy."""

    def __init__(self, handle, name: str):
        self._slice = handle.get_slice(name)

    def __getitem__(self, key) -> np.ndarray:
        if key is Ellipsis:
            key = slice(None)
        return np.asarray(self._slice[key], np.float32)


def _header(path: Path) -> tuple[dict[str, Any], int]:
    """A safetensors file's JSON header, and where its tensor bytes begin (after the
    8-byte little-endian length of the header and the header)."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(size)), 8 + size


class SafetensorsDir:
    """The tensors of a checkpoint directory: by `model.safetensors.index.json` when
    there is one (every shard it names must exist), else every `*.safetensors` file.
    `block`: the FP8 `quantization_config.weight_block_size`, if the checkpoint has one.
    `shapes` holds the tensors as the model reads them: a quantised weight's block
    scales are part of it, not tensors of their own."""

    def __init__(self, directory: Path, block: tuple[int, int] | None = None):
        self.directory, self._block = directory, block
        index = directory / INDEX
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
            missing = [f for f in files if not (directory / f).exists()]
            if missing:
                raise ValueError(
                    f"{directory}: shard {missing[0]} named by {INDEX} is missing "
                    f"({len(missing)} of {len(files)} shards missing)"
                )
        else:
            files = sorted(p.name for p in directory.glob("*.safetensors"))
            if not files:
                raise ValueError(f"{directory}: no *.safetensors files and no {INDEX}")
        cpu = jax.devices("cpu")[0]  # read into host memory, never onto an accelerator
        self._handles: dict[str, Any] = {}
        self._files: dict[str, Path] = {}
        self._headers: dict[Path, tuple[dict[str, Any], int]] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        dtypes: dict[str, str] = {}
        with jax.default_device(cpu):
            for name in files:
                try:
                    handle = safe_open(str(directory / name), framework="flax")
                except Exception as error:  # safetensors' own error types vary by damage
                    reason = (str(error).splitlines() or [type(error).__name__])[0]
                    raise ValueError(
                        f"{directory / name} is not a readable safetensors file ({reason})"
                    ) from None
                for key in handle.keys():  # noqa: SIM118 (a safe_open handle, not a dict)
                    self._handles[key], self._files[key] = handle, directory / name
                    view = handle.get_slice(key)
                    self.shapes[key], dtypes[key] = tuple(view.get_shape()), view.get_dtype()
        self._scales = fp8.quantised(dtypes, self.shapes, block, str(directory))
        self._power_of_two = {
            s for s in self._scales.values() if dtypes[s] in fp8.POWER_OF_TWO_SCALES
        }
        self._scale_shapes = {s: self.shapes.pop(s) for s in self._scales.values()}

    def _mapped(self, name: str, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        """A tensor as a read-only memory map of `dtype`, read as it is indexed:
        safetensors' numpy and flax readers cannot name the float8 dtypes (numpy has
        none), so those are mapped from the file, where its header says they lie."""
        path = self._files[name]
        if path not in self._headers:  # parsed once per shard, when first needed
            self._headers[path] = _header(path)
        header, start = self._headers[path]
        begin, _ = header[name]["data_offsets"]
        return np.memmap(path, dtype, "r", offset=start + begin, shape=shape)

    def get(self, name: str) -> Lazy | fp8.Dequantised:
        with jax.default_device(jax.devices("cpu")[0]):
            if name not in self._scales:
                return Lazy(self._handles[name], name)
            scale = self._scales[name]
            if scale in self._power_of_two:
                scales = self._mapped(scale, fp8.E8M0, self._scale_shapes[scale])
            else:
                scales = Lazy(self._handles[scale], scale)
            weight = self._mapped(name, fp8.E4M3, self.shapes[name])
            return fp8.Dequantised(weight, scales, self._block)


def write_shards(
    tensors, directory: Path, max_shard_bytes: int, dtype: str
) -> tuple[list[str], dict[str, str]]:
    """Writes (name, numpy array) pairs as it receives them into shards of at most
    `max_shard_bytes` (a tensor larger than that gets a shard of its own) with the
    metadata transformers requires ({'format': 'pt'}), then the index; returns the shard
    files and the weight map."""
    directory.mkdir(parents=True, exist_ok=True)
    cast = jax.numpy.dtype(dtype)
    pending: dict[str, Any] = {}
    pending_bytes, written, weight_map = 0, [], {}

    def flush() -> None:
        nonlocal pending, pending_bytes
        if not pending:
            return
        name = f"model-{len(written) + 1:05d}.safetensors"
        with jax.default_device(jax.devices("cpu")[0]):
            arrays = {k: jax.numpy.asarray(v, cast) for k, v in pending.items()}
            save_file(arrays, str(directory / name), metadata={"format": "pt"})
        paths.follow_umask(directory / name)  # safetensors writes 0600
        written.append(name)
        weight_map.update({k: name for k in pending})
        pending, pending_bytes = {}, 0

    total = 0
    for name, array in tensors:
        size = array.size * cast.itemsize
        if pending and pending_bytes + size > max_shard_bytes:
            flush()
        pending[name] = array
        pending_bytes += size
        total += size
    flush()
    # Shards are named -0000i-of-0000n by transformers; renamed once n is known.
    count = len(written)
    renamed = {}
    for i, name in enumerate(written, 1):
        final = f"model-{i:05d}-of-{count:05d}.safetensors"
        (directory / name).rename(directory / final)
        renamed[name] = final
    weight_map = {k: renamed[v] for k, v in sorted(weight_map.items())}
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return [renamed[n] for n in written], weight_map
