"""A Hugging Face parameter's tensors, as data: the names and shapes a moe_jax parameter
is stored under, and the conversions both ways (shared by every `convert` family)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any


class Unsupported(ValueError):
    """A checkpoint or model that a family cannot hold (one line)."""


# A parameter's tensors: HF name -> its shape, and the two conversions between them:
# `read(tensors)` -> the moe_jax array; `write(array)` -> {HF name: tensor}.
Read = Callable[[Callable[[str], Any]], Any]


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity: a cache key
class Tensors:
    shapes: dict[str, tuple[int, ...]]
    read: Read  # (name -> numpy array, or a lazy slice of it) -> moe_jax array
    write: Callable[[Any], dict[str, Any]]


def linear(name: str, out_shape: tuple[int, ...], in_shape: tuple[int, ...]) -> Tensors:
    """A torch Linear weight [out, in] as a moe_jax [*in_shape, *out_shape] matrix."""
    rows, cols = math.prod(out_shape), math.prod(in_shape)
    return Tensors(
        {name: (rows, cols)},
        lambda get: get(name)[...].T.reshape(*in_shape, *out_shape),
        lambda w: {name: w.reshape(cols, rows).T},
    )


def vector(name: str, shape: tuple[int, ...]) -> Tensors:
    size = math.prod(shape)
    return Tensors(
        {name: (size,)},
        lambda get: get(name)[...].reshape(shape),
        lambda w: {name: w.reshape(size)},
    )


def same(name: str, shape: tuple[int, ...]) -> Tensors:
    return Tensors({name: shape}, lambda get: get(name)[...], lambda w: {name: w})


def mlp(prefix: str, path: str, d: int, width: int) -> dict[str, Tensors]:
    return {
        path + "gate": linear(prefix + "gate_proj.weight", (width,), (d,)),
        path + "up": linear(prefix + "up_proj.weight", (width,), (d,)),
        path + "down": linear(prefix + "down_proj.weight", (d,), (width,)),
    }
