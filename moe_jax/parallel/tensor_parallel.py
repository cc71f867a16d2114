"""Megatron-style tensor parallelism with sequence-parallel norms.

Between blocks every device of the intra group holds s/n tokens of each
sequence (so norms and residual adds are split too). A block all-gathers the
sequence, runs its column-parallel projection (attention heads, or MLP
hidden columns, split n ways), its row-parallel output projection gives
partial sums, and a reduce-scatter sums them and hands each device its s/n
tokens back: 2·b·s·h·(n-1)/n bytes per block and device, whatever n.

Grouped-query attention with kv heads K < n (n divisible by K): the key and
value weights stay whole on every device and each device slices the one kv
head its query heads use, as Megatron replicates kv heads.
"""

from __future__ import annotations

from fractions import Fraction

import jax
from jax.sharding import PartitionSpec as P

from moe_jax.model.layers import cast_like
from moe_jax.parallel import checks
from moe_jax.parallel import collective_matmul as cm
from moe_jax.parallel.layout import DATA, INTRA, take_along
from moe_jax.parallel.scopes import TOKEN_EXCHANGE
from moe_jax.parallel.spec import AttentionSpec, Sizes


def _gather_sequence(x: jax.Array) -> jax.Array:
    with jax.named_scope(TOKEN_EXCHANGE):
        return jax.lax.all_gather(x, INTRA, axis=1, tiled=True)


def _sum_and_scatter_sequence(x: jax.Array) -> jax.Array:
    with jax.named_scope(TOKEN_EXCHANGE):
        return jax.lax.psum_scatter(x, INTRA, scatter_dimension=1, tiled=True)


def _my_kv_head(weights, axes, n: int):
    """The one kv head this device's query heads use (with its biases and norm scale),
    out of whole kv weights."""
    index = jax.lax.axis_index(INTRA) * weights.key.shape[1] // n
    return take_along(weights, axes, "kv_heads", index, 1)


def tp_attention(layout, block, x, positions, weights, axes, attend):
    """x [b, s, d] with the sequence split over the intra group -> the same."""
    n = layout.size(INTRA)
    key = getattr(axes, "key", None)  # MLA has no kv weights of their own: none to slice
    whole_kv = key is not None and layout.param_spec(key)[1] is None  # fewer kv heads than n

    def body(x, positions, weights):
        if whole_kv:
            weights = _my_kv_head(weights, axes, n)
        if not layout.collective_matmul:
            out = block(_gather_sequence(x), positions, weights, attend)
            return _sum_and_scatter_sequence(out)
        # The QKV GEMM on each source's block while the next travels, then the output
        # GEMM of each target's block while the previous partial sum travels.
        weights = cast_like(weights, x)
        parts = cm.ring_gather(lambda x: block.project(x, weights), x, n)
        q, k, v = (cm.place(list(p), cm.ring_sources(n), axis=1) for p in zip(*parts, strict=True))
        q, k = block.rotate(q, k, positions)
        o = attend(q, k, v, positions)
        out = lambda j: block.out(cm.block_of(o, (cm.me() - j) % n, n, axis=1), weights)
        return cm.ring_reduce_scatter(out, n)

    spec = layout.activation_spec()
    in_specs = (spec, P(spec[0], None), layout.weight_specs(axes))
    return layout.block_map(body, in_specs, spec)(x, positions, weights)


def tp_mlp(layout, block, x, weights, axes):
    n = layout.size(INTRA)

    def body(x, weights):
        if not layout.collective_matmul:
            return _sum_and_scatter_sequence(block(_gather_sequence(x), weights))
        # Per token end to end: each source's block runs the whole MLP on arrival, and
        # its partial sums join the travelling accumulator of their target.
        weights = cast_like(weights, x)
        parts = cm.ring_gather(lambda x: block(x, weights), x, n)
        return cm.ring_reduce_scatter(lambda j: parts[j], n)

    spec = layout.activation_spec()
    in_specs = (spec, layout.weight_specs(axes))
    return layout.block_map(body, in_specs, spec)(x, weights)


def _rules(config) -> tuple:
    kv_heads = (
        (("kv_heads", INTRA),) if config.model.num_kv_heads % config.parallel.intra == 0 else ()
    )
    return (("heads", INTRA), ("mlp", INTRA), *kv_heads)


def _problems(config) -> list[str]:
    n = config.parallel.intra
    what = f"parallel.intra={n} for parallel.attention='tp'"
    return (
        checks.split_heads(config, n, what, splits_sequence=True)
        + checks.split_widths(config, n, what)
        + checks.whole_projections(config, n, what)
    )


def exchanged_bytes(config, s: Sizes) -> Fraction:
    """All-gather of the sequence in, reduce-scatter out: 2·T·h·B·(n-1)/n (Eq. 1)."""
    return 2 * s.T * s.h * s.B * s.f


TP = AttentionSpec(
    name="tp",
    attention=tp_attention,
    mlp=tp_mlp,
    batch_axes=(DATA,),
    seq_axes=INTRA,
    rules=_rules,
    problems=_problems,
    weights_over=INTRA,
    heads_split=True,
    ring=True,
    gathers_sequence=True,
    attention_bytes=exchanged_bytes,
    mlp_bytes=exchanged_bytes,
    paper_bytes=exchanged_bytes,
    paper_equation="Eq. 1",
)
