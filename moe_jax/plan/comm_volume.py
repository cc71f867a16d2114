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

Symbols (`moe_jax.parallel.spec.Sizes`): n = parallel.intra; B = bytes of
model.dtype; T = tokens of one data-parallel group per micro-batch = batch_size /
data / grad_accum · seq_len; t = T/n tokens per device; h = embed_dim;
f = (n-1)/n. Each layout's formula lives in its spec, next to the code it models.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction

from moe_jax.config import Config
from moe_jax.data.documents import masked
from moe_jax.parallel import registry
from moe_jax.parallel.spec import Sizes

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


@dataclasses.dataclass(frozen=True)
class LayerBytes:
    """Bytes of one layer's activation exchanges, split by block."""

    attention: float
    experts: float

    @property
    def total(self) -> float:
        return self.attention + self.experts


def sizes(config: Config) -> Sizes:
    """The per-device sizes of one micro-batch of a resolved plan."""
    p, tc = config.parallel, config.train
    if p.data < 1:
        raise ValueError("comm_volume needs a resolved plan (parallel.data >= 1)")
    tokens = Fraction(tc.batch_size, p.data * config.micro_batches) * tc.seq_len
    n = p.intra
    return Sizes(
        n=n,
        B=DTYPE_BYTES[config.model.dtype],
        T=tokens,
        t=tokens / n,
        h=config.model.embed_dim,
        f=Fraction(n - 1, n),
    )


def activation_bytes(config: Config) -> LayerBytes:
    """Predicted forward bytes per device of one MoE layer, by block (resolved config):
    each layout's own formula, from its spec."""
    s = sizes(config)
    attention = registry.attention_spec(config).attention_bytes(config, s)
    experts = registry.expert_spec(config).token_bytes(config, s)
    return LayerBytes(round(attention), round(experts))


def mlp_bytes(config: Config) -> int:
    """Predicted forward bytes per device of one dense MLP block (the attention layout's)."""
    return round(registry.attention_spec(config).mlp_bytes(config, sizes(config)))


def predicted_activation_bytes_per_layer(config: Config) -> int:
    """Forward bytes one device sends for one MoE layer's token exchanges."""
    return int(activation_bytes(config).total)


def paper_bytes(config: Config) -> LayerBytes:
    """The paper's Eq. 1-4 as written (its own counting; uniform routing, no padding)."""
    s = sizes(config)
    attention = registry.attention_spec(config).paper_bytes(config, s)
    experts = registry.expert_spec(config).paper_bytes(config, s)
    return LayerBytes(float(attention), float(experts))


def paper_equations(config: Config) -> tuple[str, str]:
    """Which of the paper's equations each block's layout follows."""
    attention, experts = registry.attention_spec(config), registry.expert_spec(config)
    return attention.paper_equation, experts.paper_equation


def document_positions_bytes(config: Config) -> int:
    """Bytes one device receives per step gathering the batch's per-document positions
    (`data.document_mask` on a source with documents), int32 for each of its rows (the
    batch over its split and the stages): a layout that splits the sequence over the
    intra group (tp, sp) hands attention the whole sequence's, one all-gather over its n
    devices ((n - 1) / n of them arrive); a pipeline hands every stage every
    micro-batch's, one all-gather over the S stages (S - 1 stages' rows arrive)."""
    p, tc = config.parallel, config.train
    if not masked(config.data):
        return 0
    row = tc.seq_len * 4  # int32 positions of one whole sequence
    rows = Fraction(tc.batch_size, registry.batch_split(config) * p.stages)
    whole = registry.attention_spec(config).seq_axes  # else rows arrive whole
    intra = rows * row * Fraction(p.intra - 1, p.intra) if whole else 0
    return round(intra + rows * row * (p.stages - 1))
