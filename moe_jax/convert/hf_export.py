"""moe_jax parameters out as a Hugging Face checkpoint: `config.json` and sharded
`safetensors` that `from_pretrained` loads. Tensors are pulled off the devices one
layer (one expert) at a time and written as shards fill, so the host holds at most a
shard's worth."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jax
import numpy as np

from moe_jax.config import Config
from moe_jax.convert import families
from moe_jax.convert.families import Family
from moe_jax.convert.hf_import import param_paths, sources
from moe_jax.convert.safetensors_files import write_shards


def _hf_tensors(family: Family, config: Config, params, biases) -> Iterator[tuple[str, np.ndarray]]:
    leaves = {**param_paths(params), **param_paths(biases)}
    for path, source in sources(family, config, fused=set()).items():
        leaf = leaves[path]
        if isinstance(source, families.Tensors):
            yield from source.write(np.asarray(jax.device_get(leaf))).items()
            continue
        for unit, item in enumerate(source):
            if isinstance(item, families.Tensors):
                yield from item.write(np.asarray(jax.device_get(leaf[unit]))).items()
                continue
            for expert, t in enumerate(item):
                yield from t.write(np.asarray(jax.device_get(leaf[unit, expert]))).items()


def check_biases(biases) -> None:
    """A trained aux-loss-free routing bias steers selection; no family can hold it."""
    for path, value in param_paths(biases).items():
        if np.any(np.asarray(jax.device_get(value)) != 0):
            raise families.Unsupported(
                f"the router bias {path} is not zero (moe.bias_update_rate trained it); "
                "Hugging Face's routers have none, so the export would route differently"
            )


def export(family: Family, config: Config, params, biases, out: Path, dtype: str, shard_gb: float):
    """Writes `out`/config.json and the shards; returns the shard file names. `biases`:
    the router biases (written by the families that hold one, DeepSeek-V3)."""
    hf = families.to_hf_config(family, config, dtype)
    tensors = _hf_tensors(family, config, params, biases)
    shards, _ = write_shards(tensors, out, int(shard_gb * 2**30), dtype)
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    return shards
