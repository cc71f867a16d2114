"""A block's layout as data: which function runs attention and the MoE block, on which mesh.

Model code calls `layout.attend(...)` and `layout.moe(...)` and never asks
which layout it is in. `Layout()` (no mesh) is the single-device layout;
`moe_jax.parallel.mesh.make_layout` builds the others from a plan.
"""

from __future__ import annotations

import dataclasses

import jax


def local_attention(layout: Layout, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal GQA attention on whatever this device holds (whole sequences)."""
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)


def local_moe(layout: Layout, forward, x: jax.Array, params, cfg):
    """All experts on all tokens of the call: one device, or GSPMD's choice."""
    batch, seq, dim = x.shape
    y, stats = forward(x.reshape(batch * seq, dim), params, cfg, batch)
    return y.reshape(x.shape), stats


@dataclasses.dataclass(frozen=True)
class Layout:
    """How attention and MoE blocks run. Hashable, so it can live in the model graph."""

    mesh: jax.sharding.Mesh | None = None
    attention_fn: object = local_attention
    moe_fn: object = local_moe
    batch_axes: tuple[str, ...] = ()  # mesh axes the batch is split over
    seq_axes: tuple[str, ...] = ()  # mesh axes the sequence is split over

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return self.attention_fn(self, q, k, v)

    def moe(self, forward, x: jax.Array, params, cfg):
        return self.moe_fn(self, forward, x, params, cfg)


SINGLE_DEVICE = Layout()
