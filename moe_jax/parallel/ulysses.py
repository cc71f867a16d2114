"""Ulysses sequence-parallel attention (the paper's SP; DeepSpeed-Ulysses).

Each device of the intra group holds s/n tokens of every sequence and the
whole attention weights. An all-to-all turns sequence shards into head
shards, attention runs over full sequences for h/n heads, and a second
all-to-all turns it back.

Grouped-query attention: each device needs the key/value heads of its query
heads. With kv heads K >= n (K divisible by n) they split like the query
heads. With K < n (n divisible by K) every kv head is repeated n/K times
before the exchange, so device i gets the one kv head its query heads use;
that sends n/K times the key/value bytes of an unrepeated exchange, i.e. the
kv part of the traffic is as large as with n kv heads.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

INTRA = "intra"


def _seq_to_heads(x: jax.Array) -> jax.Array:
    return jax.lax.all_to_all(x, INTRA, split_axis=2, concat_axis=1, tiled=True)


def _heads_to_seq(x: jax.Array) -> jax.Array:
    return jax.lax.all_to_all(x, INTRA, split_axis=1, concat_axis=2, tiled=True)


def ulysses_attention(layout, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """q [b, s, h, d], k/v [b, s, kv, d], sequence split over 'intra' -> o like q."""
    n = layout.mesh.shape[INTRA]
    if k.shape[2] < n:
        k, v = (jnp.repeat(t, n // t.shape[2], axis=2) for t in (k, v))
    spec = P(layout.batch_axes or None, INTRA, None, None)

    def body(q, k, v):
        q, k, v = _seq_to_heads(q), _seq_to_heads(k), _seq_to_heads(v)
        return _heads_to_seq(jax.nn.dot_product_attention(q, k, v, is_causal=True))

    return jax.shard_map(body, mesh=layout.mesh, in_specs=(spec, spec, spec), out_specs=spec)(
        q, k, v
    )
