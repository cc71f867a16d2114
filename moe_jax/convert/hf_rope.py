"""Rotary settings in and out of a Hugging Face `config.json`, for every family.

A checkpoint states its rotary as transformers 5's `rope_parameters` (θ inside) or the
older `rope_scaling` beside `rope_theta`; both are read, and both are written (the
same dict) so that either generation of transformers loads the export. Read as
transformers 5.24 reads them (`standardize_rope_params`, `_compute_yarn_parameters`):
a YaRN dict without `original_max_position_embeddings` takes the config's
`original_max_position_embeddings`, else `max_position_embeddings`; one without
`factor` takes `max_position_embeddings / original_max_position_embeddings`; a
`beta_fast` or `beta_slow` of 0 or none is the default 32 or 1.
"""

from __future__ import annotations

from typing import Any

from moe_jax.config import ModelConfig


class RopeUnsupported(ValueError):
    """A rotary a checkpoint states that moe_jax cannot run (one line)."""


def _rope_dict(hf: dict[str, Any]) -> dict[str, Any]:
    return dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})


def rope_settings(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """The `model.rope_*` settings (θ included) of a `config.json`, or one line."""
    rope = _rope_dict(hf)
    kind = rope.get("rope_type", rope.get("type", "default"))
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise RopeUnsupported(
            f"{where}: partial_rotary_factor={partial} is not supported (rotary on every channel)"
        )
    if kind == "default":
        return {"rope_theta": theta}
    if kind == "linear":
        return {"rope_theta": theta, "rope_scaling": "linear", "rope_factor": float(rope["factor"])}
    if kind != "yarn":
        raise RopeUnsupported(
            f"{where}: rope_type={kind!r} is not supported (valid: 'default', 'linear', 'yarn')"
        )
    original = rope.get("original_max_position_embeddings") or hf.get(
        "original_max_position_embeddings", hf.get("max_position_embeddings")
    )
    if not original:
        raise RopeUnsupported(f"{where}: a yarn rope needs original_max_position_embeddings")
    factor = rope.get("factor")
    if factor is None:
        factor = hf["max_position_embeddings"] / original
    return {
        "rope_theta": theta,
        "rope_scaling": "yarn",
        "rope_factor": float(factor),
        "rope_original_max_position": int(original),
        "rope_beta_fast": float(rope.get("beta_fast") or 32.0),
        "rope_beta_slow": float(rope.get("beta_slow") or 1.0),
        "rope_mscale": float(rope.get("mscale") or 0.0),
        "rope_mscale_all_dim": float(rope.get("mscale_all_dim") or 0.0),
        "rope_attention_factor": float(rope.get("attention_factor") or 0.0),
        "rope_truncate": bool(rope.get("truncate", True)),
    }


def rope_parameters(m: ModelConfig) -> dict[str, Any]:
    """transformers 5's `rope_parameters` for `m` (unset YaRN settings left out)."""
    out: dict[str, Any] = {"rope_type": "default", "rope_theta": m.rope_theta}
    if m.rope_scaling == "none":
        return out
    out.update(rope_type=m.rope_scaling, factor=m.rope_factor)
    if m.rope_scaling == "yarn":
        out.update(
            original_max_position_embeddings=m.rope_original_max_position,
            beta_fast=m.rope_beta_fast,
            beta_slow=m.rope_beta_slow,
        )
        optional = {
            "mscale": m.rope_mscale,
            "mscale_all_dim": m.rope_mscale_all_dim,
            "attention_factor": m.rope_attention_factor,
        }
        out.update({k: v for k, v in optional.items() if v})
        if not m.rope_truncate:
            out["truncate"] = False
    return out


def rope_config_keys(m: ModelConfig) -> dict[str, Any]:
    """The rotary keys of an exported `config.json`: `rope_theta` and `rope_parameters`,
    and, when scaled, the same dict as `rope_scaling` for transformers 4."""
    params = rope_parameters(m)
    out: dict[str, Any] = {"rope_theta": m.rope_theta, "rope_parameters": params}
    if m.rope_scaling != "none":
        out["rope_scaling"] = dict(params)
    return out
