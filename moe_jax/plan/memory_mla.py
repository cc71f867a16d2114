"""What one MLA attention block stores for its backward (`moe_jax.model.mla`), a part of
`moe_jax.plan.memory`'s activation count.

Why apart: MLA's tensors differ from GQA's in kind, not only in width. Its
down-projections carry no 'heads' axis, so every layout runs them whole on the rows it
projects (tp: the gathered group's) and never splits their weights; the latents and
their norms are stored beside q/k/v; every head has its own key and value, q and k
qk = qk_nope + qk_rope wide and v (the core's output too) v_head_dim wide.
"""

from __future__ import annotations

from typing import Any

from moe_jax import config_attention
from moe_jax.config import Config
from moe_jax.parallel import registry
from moe_jax.parallel.layout import DATA, INTRA

FP32 = 4


def _norm(tokens: int, width: int, B: int) -> int:
    """An RMSNorm of `width` on `tokens` rows: float32 input and normalised value, two
    statistics, and its output as the next GEMM reads it (B bytes)."""
    return tokens * ((2 * width + 2) * FP32 + width * B)


def latent_bytes(config: Config, z: Any) -> int:
    """What model.remat='selective' keeps of the latents (`remat.MLA_LATENT`): the
    outputs of the down-projections, before their norms, on the projected rows."""
    m, spec = config.model, registry.attention_spec(config)
    rows = z.b * z.s if spec.gathers_sequence else z.t
    return rows * (m.q_lora_rank + m.kv_lora_rank + m.qk_rope_head_dim) * z.B


def attention_terms(config: Config, z: Any) -> dict[str, int]:
    """Stored by one MLA attention block (with its norm), by tensor; the keys of
    `memory._attention_terms` plus 'latents' (the down-projections' outputs, their
    norms' terms and normed outputs)."""
    m, spec = config.model, registry.attention_spec(config)
    a, n = m.num_heads, z.n
    qk, v = config_attention.head_widths(m)
    if not spec.heads_split:
        seqs, heads, rows = z.b // n, a, z.t
    else:  # tp and sp attend over whole sequences for a/n heads
        seqs, heads = z.b, a // n
        rows = z.b * z.s if spec.gathers_sequence else z.t
    down = config_attention.shared_weights(m)
    per_head = config_attention.head_weights(m)
    if spec.weights_over == DATA:  # the head-split weights gathered whole; down cast
        cast = per_head * z.B + (down * z.B if z.B != FP32 else 0)
    elif spec.weights_over == INTRA:  # this device's heads, the down-projections whole
        cast = (down + per_head // n) * z.B if z.B != FP32 else 0
    else:
        cast = (down + per_head) * z.B if z.B != FP32 else 0
    if m.attention_impl == "xla":
        scores = seqs * heads * z.s * (z.s * (FP32 + z.B) + 2 * FP32)
    else:
        exchanged = spec.heads_split and not spec.gathers_sequence
        scores = seqs * heads * z.s * (FP32 + (v * z.B if exchanged else 0))
    latents = _norm(rows, m.kv_lora_rank, z.B) + rows * m.qk_rope_head_dim * z.B
    if m.q_lora_rank:
        latents += _norm(rows, m.q_lora_rank, z.B)
    out_width = heads if spec.gathers_sequence else a
    return {
        "norm": z.t * (2 * z.h + 2) * FP32 + rows * z.h * z.B,
        "latents": latents,
        "qkv": seqs * z.s * heads * (2 * qk + v) * z.B,
        "scores": scores,
        "attention_out": rows * out_width * v * z.B,
        "attention_weights": cast,
    }
