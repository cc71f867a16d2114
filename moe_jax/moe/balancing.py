"""Aux-loss-free load balancing (DeepSeek-V3): nudge each expert's router bias
toward uniform load by the sign rule, outside the optimizer."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def update_bias(bias: jax.Array, load: jax.Array, rate: float) -> jax.Array:
    """bias_i += rate * sign(mean load - load_i); works on [..., E] (e.g. stacked layers)."""
    return bias + rate * jnp.sign(load.mean(-1, keepdims=True) - load)
