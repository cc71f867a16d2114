"""The rules of `moe_jax.config.validate` that look at the config as a whole: every
float setting finite, no setting that another setting turns off, no window beyond
the run, and the parallel section's names and ranges.

Why here: `validate` checks each setting's own range; these rules read several
settings at once, or every setting of a kind, and kept `config.py` one screenful per
section. Like `config.py`, this module imports no jax.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import Any

from moe_jax import names

# `moe_jax.config`'s Config and ParallelConfig, which import this module: typed `Any`
# here so that the two modules make no import circle.
Config = ParallelConfig = Any

SEED_LIMIT = 2**32  # the data pipeline's and jax's seeds are 32-bit


def check(ok: bool, setting: str, value: Any, valid: str) -> None:
    """The one-line error of every rule: the setting, its value, and what is valid."""
    if not ok:
        raise ValueError(f"{setting}={value!r} is invalid: {valid}")


def float_settings(config: Config) -> Iterator[tuple[str, float]]:
    """("section.name", value) of every setting whose default is a float (found from
    the dataclasses, so that a new float setting is covered without a list)."""
    for section in dataclasses.fields(config):
        values = getattr(config, section.name)
        for field in dataclasses.fields(values):
            if isinstance(field.default, float):
                yield f"{section.name}.{field.name}", getattr(values, field.name)


def check_finite(config: Config) -> None:
    """inf and nan pass every `> 0` / `>= 0` check, and a learning rate of inf trains
    a checkpoint of NaN: no float setting means anything when not finite."""
    for setting, value in float_settings(config):
        check(math.isfinite(value), setting, value, "must be finite")


def validate_rope(m: Any, kinds: tuple[str, ...]) -> None:
    """The rotary scaling's own ranges (`model.rope_*`, see `moe_jax.model.rope`)."""
    check(m.rope_scaling in kinds, "model.rope_scaling", m.rope_scaling, f"valid: {kinds}")
    check(
        m.rope_factor >= 1,
        "model.rope_factor",
        m.rope_factor,
        "must be >= 1 (how many times the context is stretched)",
    )
    if m.rope_scaling != "yarn":
        return
    check(
        m.rope_original_max_position > 0,
        "model.rope_original_max_position",
        m.rope_original_max_position,
        "must be > 0 with model.rope_scaling='yarn' (the pretraining context length)",
    )
    check(m.rope_beta_slow > 0, "model.rope_beta_slow", m.rope_beta_slow, "must be > 0")
    check(
        m.rope_beta_fast >= m.rope_beta_slow,
        "model.rope_beta_fast",
        m.rope_beta_fast,
        f"must be >= model.rope_beta_slow={m.rope_beta_slow} (rotations of the fast end)",
    )
    for name in ("rope_mscale", "rope_mscale_all_dim", "rope_attention_factor"):
        check(getattr(m, name) >= 0, f"model.{name}", getattr(m, name), "must be >= 0 (0 = unset)")


# Settings only one rotary scaling reads, with the scalings that read them.
_ROPE_READERS = {
    "rope_factor": ("linear", "yarn"),
    "rope_original_max_position": ("yarn",),
    "rope_beta_fast": ("yarn",),
    "rope_beta_slow": ("yarn",),
    "rope_mscale": ("yarn",),
    "rope_mscale_all_dim": ("yarn",),
    "rope_attention_factor": ("yarn",),
    "rope_truncate": ("yarn",),
}


def _check_turned_off_rope_and_groups(config: Config) -> None:
    """A `model.rope_*` setting the chosen scaling does not read, and a group score
    without groups."""
    m, e = config.model, config.moe
    defaults = type(m)()
    for name, readers in _ROPE_READERS.items():
        value = getattr(m, name)
        check(
            value == getattr(defaults, name) or m.rope_scaling in readers,
            f"model.{name}",
            value,
            f"only model.rope_scaling in {readers} reads it (model.rope_scaling="
            f"{m.rope_scaling!r} here): leave it {getattr(defaults, name)!r}",
        )
    check(
        e.group_score == type(e)().group_score or e.n_groups > 1,
        "moe.group_score",
        e.group_score,
        "ranks the groups of group-limited routing, off here (moe.n_groups=1)",
    )


def check_meaningful(config: Config) -> None:
    """Settings that another setting turns off, so that the value given would be
    silently ignored, and windows that lie beyond the run."""
    d, t, p = config.data, config.train, config.parallel
    _check_turned_off_rope_and_groups(config)
    check(
        not d.path or d.source == "tokens",
        "data.path",
        d.path,
        f"only data.source='tokens' reads it (data.source={d.source!r} here): add "
        "--config.data.source=tokens, or clear it with --config.data.path=",
    )
    check(
        not d.verify or d.source == "tokens",
        "data.verify",
        d.verify,
        f"only prepared token files have checksums (data.source={d.source!r} here)",
    )
    check(
        p.stages > 1 or p.microbatches == 1 or p.layout == "auto",
        "parallel.microbatches",
        p.microbatches,
        "micro-batches of a pipeline (parallel.stages > 1); without one, "
        "train.grad_accum sets the micro-batches of a step",
    )
    check(
        p.stages > 1 or p.schedule == "gpipe" or p.layout == "auto",
        "parallel.schedule",
        p.schedule,
        "schedules a pipeline (parallel.stages > 1): leave it 'gpipe' without one",
    )
    check(
        p.stash_depth == 0
        or p.layout == "auto"
        or (p.schedule == "zero_bubble" and 0 < p.stash_depth < p.stages),
        "parallel.stash_depth",
        p.stash_depth,
        f"bounds zero_bubble's stash: from 1 to parallel.stages - 1 = {p.stages - 1} with "
        "parallel.schedule=zero_bubble, else 0 (0: S - 1)",
    )
    e = config.moe
    check(
        not e.tile_size or e.impl in ("auto", "tiled"),
        "moe.tile_size",
        e.tile_size,
        f"only moe.impl='tiled' (or 'auto', which picks it on CPU) uses it (moe.impl={e.impl!r} "
        "here): leave it 0",
    )
    check(
        t.wandb == "off" or bool(t.wandb_project),
        "train.wandb_project",
        t.wandb_project,
        f"train.wandb={t.wandb!r} logs to a W&B project: name one",
    )
    check(0 <= t.seed < SEED_LIMIT, "train.seed", t.seed, f"must be in [0, 2**32 = {SEED_LIMIT})")
    window = profile_steps(config.profile.steps)
    check(
        window is None or window[1] <= t.steps + 1,
        "profile.steps",
        config.profile.steps,
        f"the traced steps [start, stop) must lie in the run's steps 1..{t.steps} "
        f"(train.steps={t.steps}): stop <= {t.steps + 1}",
    )


def validate_mtp(config: Config) -> None:
    """Multi-token prediction: depth k scores the token k + 1 ahead, so each depth needs
    a position whose target lies inside the sequence."""
    m, t = config.model, config.train
    check(m.mtp_depth >= 0, "model.mtp_depth", m.mtp_depth, "must be >= 0 (0 turns MTP off)")
    check(
        m.mtp_depth < t.seq_len,
        "model.mtp_depth",
        m.mtp_depth,
        f"must be < train.seq_len={t.seq_len}: depth k predicts the token k + 1 ahead",
    )
    check(t.mtp_loss_weight >= 0, "train.mtp_loss_weight", t.mtp_loss_weight, "must be >= 0")


def validate_optimizer(config: Config) -> None:
    """`train.optimizer`, and the ranges of the optimizer's and its schedule's settings
    (`moe_jax.optimizer`)."""
    t = config.train
    check(
        t.optimizer in names.OPTIMIZERS,
        "train.optimizer",
        t.optimizer,
        f"valid: {names.OPTIMIZERS}",
    )
    check(
        t.moment_dtype in names.MOMENT_DTYPES,
        "train.moment_dtype",
        t.moment_dtype,
        f"valid: {names.MOMENT_DTYPES}",
    )
    for name in ("b1", "b2", "muon_momentum"):
        check(0 <= getattr(t, name) < 1, f"train.{name}", getattr(t, name), "must be in [0, 1)")
    check(
        0 < t.wsd_decay_fraction <= 1,
        "train.wsd_decay_fraction",
        t.wsd_decay_fraction,
        "must be in (0, 1]",
    )
    if t.qk_clip:
        validate_qk_clip(config)


def validate_qk_clip(config: Config) -> None:
    """`train.qk_clip`: a positive threshold, and a model and plan whose every attention
    head's peak logit reaches the update (`moe_jax.qk_clip`)."""
    t, m = config.train, config.model
    tau = t.qk_clip_threshold
    check(tau > 0, "train.qk_clip_threshold", tau, "must be > 0 (the largest logit kept)")
    check(
        m.qk_norm != "head",
        "model.qk_norm",
        m.qk_norm,
        "with train.qk_clip must be 'projection' or 'none': a per-head norm shares one "
        "scale across heads, so no single head can be rescaled",
    )


def validate_documents(config: Config) -> None:
    """A document mask needs an attention implementation that can apply it: this jax's
    cuDNN attention takes no segment ids (`moe_jax.kernels.attention`)."""
    d, impl = config.data, config.model.attention_impl
    check(
        not (d.document_mask and d.source != "synthetic" and impl == "cudnn"),
        "model.attention_impl",
        impl,
        "this jax's cuDNN attention takes no segment ids, so it cannot mask documents: "
        "set model.attention_impl=blockwise or xla, or data.document_mask=false",
    )


def profile_steps(steps: str) -> tuple[int, int] | None:
    """The [start, stop) steps of `profile.steps` to trace, or None when profiling is off."""
    if not steps:
        return None
    parts = steps.split(",")
    ok = len(parts) == 2 and all(p.strip().isdigit() for p in parts)
    ok = ok and 0 < int(parts[0]) < int(parts[1])
    check(ok, "profile.steps", steps, "must be 'start,stop' with 0 < start < stop")
    return int(parts[0]), int(parts[1])


def _positive(section: Any, prefix: str, *fields: str) -> None:
    for name in fields:
        value = getattr(section, name)
        check(value > 0, f"{prefix}.{name}", value, "must be > 0")


def validate_parallel(p: ParallelConfig) -> None:
    """Layout and GPU names from `moe_jax.names` (the registry's and the presets'
    names, without importing them)."""
    attention, experts = names.ATTENTION_LAYOUTS, (*names.EXPERT_LAYOUTS, "auto")
    gpus = ("", *names.GPU_PRESETS)
    _positive(p, "parallel", "intra", "etp", "overlap_chunks", "stages", "microbatches")
    _positive(p, "parallel", "repeats")
    check(p.data >= 0, "parallel.data", p.data, "must be >= 0 (0 uses every device)")
    check(p.attention in attention, "parallel.attention", p.attention, f"valid: {attention}")
    check(p.experts in experts, "parallel.experts", p.experts, f"valid: {experts}")
    schedules = names.PIPELINE_SCHEDULES
    check(p.schedule in schedules, "parallel.schedule", p.schedule, f"valid: {schedules}")
    check(p.layout in ("manual", "auto"), "parallel.layout", p.layout, "valid: manual or auto")
    check(
        p.token_dtype in ("native", "fp8"),
        "parallel.token_dtype",
        p.token_dtype,
        "valid: native or fp8",
    )
    check(
        p.grad_exchange in ("fp32", "bf16_a2a"),
        "parallel.grad_exchange",
        p.grad_exchange,
        "valid: fp32 or bf16_a2a",
    )
    check(p.gpu.lower() in gpus, "parallel.gpu", p.gpu, f"valid: {gpus}")
    check(p.zero in (0, 1, 2), "parallel.zero", p.zero, "valid: 0, 1 or 2 (fsdp covers weights)")
    check(p.ag_threshold > 0, "parallel.ag_threshold", p.ag_threshold, "must be > 0")
    check(
        p.a2a_buffer_factor >= 0,
        "parallel.a2a_buffer_factor",
        p.a2a_buffer_factor,
        "must be >= 0 (0: worst-case all-to-all buffers, exactly dropless)",
    )
