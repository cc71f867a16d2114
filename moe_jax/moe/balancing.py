"""Aux-loss-free load balancing (DeepSeek-V3): nudge each expert's router bias
toward uniform load by the sign rule, outside the optimizer."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def update_bias(bias: jax.Array, load: jax.Array, rate: float) -> jax.Array:
    """bias_i += rate * sign(mean load - load_i); works on [..., E] (e.g. stacked layers)."""
    return bias + rate * jnp.sign(load.mean(-1, keepdims=True) - load)


def update_biases(biases, metrics: dict, rate: float):
    """Every router bias of a model's bias tree by the loads of its own layers: the
    multi-token prediction modules' (under 'mtp', depth j's by row j of `mtp_load`)
    and the stack's (by `load`)."""

    def one(path, bias):
        keys = [getattr(k, "key", getattr(k, "idx", None)) for k in path]
        if keys[0] == "mtp":
            return update_bias(bias, metrics["mtp_load"][keys[2]], rate)
        return update_bias(bias, metrics["load"], rate)

    return jax.tree_util.tree_map_with_path(one, biases)
