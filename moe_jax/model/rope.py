"""Rotary scaling a checkpoint was trained with: linear position interpolation and YaRN.

The frequencies follow transformers' `_compute_linear_scaling_rope_parameters` and
`_compute_yarn_parameters` (the same YaRN as DeepSeek's `precompute_freqs_cis`): the
correction range comes from the pretraining length (`rope_original_max_position`),
never from the extended one. YaRN scales attention twice, independently: cos/sin by
`cos_sin_factor` (every attention), and the softmax scale by `softmax_multiplier`
(DeepSeek's MLA only, which reads `mscale_all_dim`). Plain Python and NumPy: the
frequencies are constants of the traced program.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from moe_jax.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """The `model.rope_*` settings besides θ (hashable: a static part of the model)."""

    kind: str = "none"  # none, linear or yarn
    factor: float = 1.0
    original_max_position: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0  # 0: unset, as HF's None
    mscale_all_dim: float = 0.0
    attention_factor: float = 0.0  # 0: derived from factor and the mscales
    truncate: bool = True

    @classmethod
    def of(cls, m: ModelConfig) -> RopeScaling:
        return cls(
            kind=m.rope_scaling,
            factor=m.rope_factor,
            original_max_position=m.rope_original_max_position,
            beta_fast=m.rope_beta_fast,
            beta_slow=m.rope_beta_slow,
            mscale=m.rope_mscale,
            mscale_all_dim=m.rope_mscale_all_dim,
            attention_factor=m.rope_attention_factor,
            truncate=m.rope_truncate,
        )


NO_SCALING = RopeScaling()


def get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched `scale` times."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def cos_sin_factor(s: RopeScaling) -> float:
    """What cos and sin are multiplied by (HF's `attention_factor`): 1 unless YaRN."""
    if s.kind != "yarn":
        return 1.0
    if s.attention_factor:
        return s.attention_factor
    if s.mscale and s.mscale_all_dim:
        return get_mscale(s.factor, s.mscale) / get_mscale(s.factor, s.mscale_all_dim)
    return get_mscale(s.factor)


def softmax_multiplier(s: RopeScaling) -> float:
    """What multiplies MLA's softmax scale `qk_head_dim ** -0.5`: get_mscale(factor,
    mscale_all_dim)² under YaRN with `mscale_all_dim` set (HF `yarn_apply_mscale`),
    else 1. Grouped-query attention does not use it (transformers' Llama family does not)."""
    if s.kind != "yarn" or not s.mscale_all_dim:
        return 1.0
    return get_mscale(s.factor, s.mscale_all_dim) ** 2


def _correction_dim(rotations: float, dim: int, theta: float, length: int) -> float:
    """The pair index whose wavelength turns `rotations` times over `length` tokens."""
    return dim * math.log(length / (rotations * 2 * math.pi)) / (2 * math.log(theta))


def yarn_ramp(dim: int, theta: float, s: RopeScaling) -> np.ndarray:
    """[dim // 2] weight of the interpolated frequency per pair: 0 for the fast pairs
    (kept), 1 for the slow ones (divided by the factor), linear between."""
    low = _correction_dim(s.beta_fast, dim, theta, s.original_max_position)
    high = _correction_dim(s.beta_slow, dim, theta, s.original_max_position)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as HF: no division by zero
    return np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)


def inverse_frequencies(dim: int, theta: float, s: RopeScaling) -> np.ndarray:
    """[dim // 2] float32 inverse wavelengths of a rotary over `dim` channels, scaled."""
    base = theta ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
    if s.kind == "linear":
        base = base / s.factor
    elif s.kind == "yarn":
        ramp = yarn_ramp(dim, theta, s)
        base = base / s.factor * ramp + base * (1 - ramp)
    return base.astype(np.float32)
