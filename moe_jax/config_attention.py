"""The rules of `moe_jax.config.validate` for `model.attention` and its MLA widths.

Why apart: they read several model settings at once (MLA's widths, the kv heads, the
attention core) and kept `config.py` short. Like `config.py`, no jax is imported.
"""

from __future__ import annotations

from typing import Any

from moe_jax.config_rules import check
from moe_jax.kernels import requirements

ATTENTIONS = ("gqa", "mla")  # see moe_jax.model.attention and moe_jax.model.mla
MLA_WIDTHS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def mla_head_width(m: Any) -> int:
    """The head width the attention core computes on under MLA: queries and keys are
    qk_nope + qk_rope wide, values v_head_dim; cores that need one width pad to the wider."""
    return max(m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim)


def validate(m: Any) -> None:
    """One-line ValueError for the first MLA setting that does not fit (`m`: ModelConfig)."""
    check(m.attention in ATTENTIONS, "model.attention", m.attention, f"valid: {ATTENTIONS}")
    if m.attention != "mla":
        for name in MLA_WIDTHS:
            value = getattr(m, name)
            check(
                value == 0, f"model.{name}", value, "only model.attention='mla' reads it: leave 0"
            )
        return
    check(
        m.q_lora_rank >= 0, "model.q_lora_rank", m.q_lora_rank, "must be >= 0 (0: no query latent)"
    )
    for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        check(getattr(m, name) > 0, f"model.{name}", getattr(m, name), "must be > 0 under mla")
    check(
        m.qk_rope_head_dim % 2 == 0,
        "model.qk_rope_head_dim",
        m.qk_rope_head_dim,
        "must be even (rotary pairs)",
    )
    check(
        m.num_kv_heads == m.num_heads,
        "model.num_kv_heads",
        m.num_kv_heads,
        f"must equal model.num_heads={m.num_heads} under mla: every head gets its own key "
        "and value from the shared latent",
    )
    check(not m.qkv_bias, "model.qkv_bias", m.qkv_bias, "gqa only: mla has no projection biases")
    check(
        m.qk_norm == "none",
        "model.qk_norm",
        m.qk_norm,
        "gqa only: mla normalises its latents (leave 'none')",
    )
    if m.attention_impl == "cudnn":
        width = mla_head_width(m)
        found = requirements.cudnn_width_problems(
            width, f"mla heads {width} wide (max of qk_nope + qk_rope and v_head_dim)"
        )
        if found:
            raise ValueError(found[0])


def head_widths(m: Any) -> tuple[int, int]:
    """(query/key width, value width) of one head: head_dim twice under gqa;
    qk_nope + qk_rope and v_head_dim under mla."""
    if m.attention != "mla":
        return m.head_dim, m.head_dim
    return m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim


def shared_weights(m: Any) -> int:
    """Matmul weights of one attention block that carry no 'heads' axis, so no layout
    splits them: MLA's down-projections (query_down, kv_down); none under gqa."""
    if m.attention != "mla":
        return 0
    return m.embed_dim * (m.q_lora_rank + m.kv_lora_rank + m.qk_rope_head_dim)


def head_weights(m: Any) -> int:
    """Matmul weights of one attention block split by heads: gqa's q, k, v and out;
    mla's query (or query_up), kv_up and out."""
    if m.attention != "mla":
        return m.embed_dim * m.head_dim * (2 * m.num_heads + 2 * m.num_kv_heads)
    qk, v = head_widths(m)
    query = (m.q_lora_rank or m.embed_dim) * m.num_heads * qk
    kv_up = m.kv_lora_rank * m.num_heads * (m.qk_nope_head_dim + v)
    return query + kv_up + m.num_heads * v * m.embed_dim


def attention_weights(m: Any) -> int:
    """Every matmul weight of one attention block (what each token multiplies by)."""
    return shared_weights(m) + head_weights(m)
