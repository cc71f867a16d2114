"""Divisibility checks shared by the layout specs: each returns one-line messages of
what does not split (empty: it fits)."""

from __future__ import annotations

from moe_jax.config import Config


def dense_widths(config: Config) -> dict[str, int]:
    """Hidden widths of the dense MLPs the model has (dense layers, shared experts), by
    the setting that sets them: what tensor parallelism and FSDP split."""
    m, e = config.model, config.moe
    widths = {}
    if m.first_k_dense or m.moe_every > 1 or not m.num_moe_layers:
        widths["model.mlp_dim"] = m.mlp_dim
    if e.num_shared_experts:
        widths["moe.num_shared_experts * moe.shared_mlp_dim"] = (
            e.num_shared_experts * e.shared_mlp_dim
        )
    return widths


def split_heads(config: Config, size: int, what: str, splits_sequence: bool) -> list[str]:
    """Heads split `size` ways (and the sequence too, unless the batch carries the split).

    Fewer kv heads than devices works when the sequence is split (each device
    takes, or receives, the kv head its query heads use), not for weight shards.
    """
    m, t = config.model, config.train
    kv = m.num_kv_heads
    problems = [
        (m.num_heads % size == 0, f"model.num_heads={m.num_heads} must be divisible by {what}")
    ]
    if splits_sequence:
        problems += [
            (t.seq_len % size == 0, f"train.seq_len={t.seq_len} must be divisible by {what}"),
            (
                kv % size == 0 or size % kv == 0,
                f"model.num_kv_heads={kv} and {what} must divide one another",
            ),
        ]
    else:
        problems.append((kv % size == 0, f"model.num_kv_heads={kv} must be divisible by {what}"))
    return [message for ok, message in problems if not ok]


def split_widths(config: Config, size: int, what: str) -> list[str]:
    """Dense MLP widths split `size` ways."""
    return [
        f"{key}={width} must be divisible by {what}"
        for key, width in dense_widths(config).items()
        if width % size
    ]


def whole_projections(config: Config, size: int, what: str) -> list[str]:
    """model.qk_norm='projection' normalises over all heads of a projection at once, so
    a layout that projects a head shard per device (over `size` > 1 devices) cannot run
    it; the per-head norm splits like the heads."""
    if config.model.qk_norm != "projection" or size == 1:
        return []
    return [
        f"model.qk_norm='projection' needs every head of a projection on one device, which "
        f"{what} splits; use parallel.attention='sp' or 'fsdp' without "
        "parallel.collective_matmul, or model.qk_norm='head'"
    ]
