"""Analytic activation traffic of one MoE layer (attention + MoE block), per device.

Why: it is what a plan is chosen by (the paper's Eq. 1-4), and what the compiled
program is checked against (`moe_jax.tools.comm_report`). Forward pass only;
router-statistic psums are left out (tiny).

Convention (the same as `moe_jax.tools.hlo_collectives`): bytes ONE device
SENDS; an all-gather, reduce-scatter or all-to-all of a per-device buffer of
S bytes over n devices sends S·(n-1)/n. The paper's Eq. 2 counts the Ulysses
all-to-alls twice this: the per-device bytes of its two all-to-alls are
(2+2/m)·b·s·h·(n-1)/n², half of Eq. 2. `paper_bytes` gives the equations as
the paper writes them (elements times bytes per element, no capacity padding),
for reference only; `activation_bytes` is the per-device prediction, with the
real buffer shapes (repeated kv heads, capacity padding).

Symbols: n = parallel.intra; B = bytes of model.dtype; T = tokens of one
data-parallel group per micro-batch = batch_size / data / grad_accum · seq_len;
t = T/n tokens per device; h = embed_dim; f = (n-1)/n.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction

from moe_jax.config import Config

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
PAPER_EQUATION = {
    "tp": "Eq. 1",
    "sp": "Eq. 2",
    "ep_a2a": "Eq. 3 (all-to-all)",
    "ep_ag": "Eq. 3 (all-gather)",
    "etp": "Eq. 4",
    "ep_etp": "Eq. 4",
}


@dataclasses.dataclass(frozen=True)
class LayerBytes:
    """Bytes of one layer's activation exchanges, split by block."""

    attention: float
    experts: float

    @property
    def total(self) -> float:
        return self.attention + self.experts


@dataclasses.dataclass(frozen=True)
class _Symbols:
    n: int
    B: int
    T: Fraction
    t: Fraction
    h: int
    f: Fraction


def _symbols(config: Config) -> _Symbols:
    p, tc = config.parallel, config.train
    if p.data < 1:
        raise ValueError("comm_volume needs a resolved plan (parallel.data >= 1)")
    tokens = Fraction(tc.batch_size, p.data * tc.grad_accum) * tc.seq_len
    n = p.intra
    return _Symbols(
        n=n,
        B=DTYPE_BYTES[config.model.dtype],
        T=tokens,
        t=tokens / n,
        h=config.model.embed_dim,
        f=Fraction(n - 1, n),
    )


def _attention(config: Config, s: _Symbols) -> Fraction:
    layout, m = config.parallel.attention, config.model
    if layout in ("dp", "fsdp"):
        return Fraction(0)  # fsdp's weight gathers are parameter traffic, not activations
    if layout == "tp":  # all-gather in, reduce-scatter out (sequence-parallel norms)
        return 2 * s.T * s.h * s.B * s.f
    if layout == "sp":  # Ulysses: q, k, v to head shards, the output back
        q_width = m.num_heads * m.head_dim
        kv_heads = m.num_kv_heads if m.num_kv_heads >= s.n else s.n  # repeated up to n
        return s.f * s.t * (2 * q_width + 2 * kv_heads * m.head_dim) * s.B
    raise ValueError(f"no communication model for parallel.attention={layout!r}")


def _experts(config: Config, s: _Symbols) -> Fraction:
    layout, moe = config.parallel.experts, config.moe
    if layout in ("ep_ag", "etp", "ep_etp"):  # all-gather tokens, reduce-scatter outputs
        return 2 * s.T * s.h * s.B * s.f
    if layout == "ep_a2a":  # static buffers of `slots` rows per destination
        if moe.dropless:
            slots = s.t * moe.top_k
        else:
            slots = Fraction(moe.num_experts, s.n) * moe.capacity(int(s.t))
        rows = s.n * slots
        return 2 * s.f * rows * s.h * s.B + s.f * rows * 4  # rows there and back + int32 ids
    raise ValueError(f"no communication model for parallel.experts={layout!r}")


def activation_bytes(config: Config) -> LayerBytes:
    """Predicted forward bytes per device of one MoE layer, by block (resolved config)."""
    s = _symbols(config)
    return LayerBytes(round(_attention(config, s)), round(_experts(config, s)))


def predicted_activation_bytes_per_layer(config: Config) -> int:
    """Forward bytes one device sends for one MoE layer's token exchanges."""
    return int(activation_bytes(config).total)


def paper_bytes(config: Config) -> LayerBytes:
    """The paper's Eq. 1-4 as written (its own counting; uniform routing, no padding)."""
    s, m, moe = _symbols(config), config.model, config.moe
    ratio = Fraction(m.num_heads, m.num_kv_heads)  # GQA ratio m
    attention = {
        "dp": Fraction(0),
        "fsdp": Fraction(0),
        "tp": 2 * s.T * s.h * s.f,
        "sp": (4 + 4 / ratio) * s.T * s.h * s.f / s.n,
    }
    experts = {
        "ep_a2a": 2 * moe.top_k * s.T * s.h * s.f / s.n,
        "ep_ag": 2 * s.T * s.h * s.f,
        "etp": 2 * s.T * s.h * s.f,
        "ep_etp": 2 * s.T * s.h * s.f,
    }
    p = config.parallel
    if p.attention not in attention or p.experts not in experts:
        raise ValueError(f"no paper formula for the plan {p.attention}+{p.experts}")
    return LayerBytes(float(attention[p.attention] * s.B), float(experts[p.experts] * s.B))
