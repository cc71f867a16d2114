"""End-of-run pictures drawn from `metrics.jsonl`: the loss curves and expert load."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from moe_jax.metrics import read_rows


def plot_loss(rows: list[dict], path: Path) -> None:
    """Train loss (language-model part) and validation loss against step."""
    fig, ax = plt.subplots(figsize=(7, 4))
    train = [(r["step"], r["lm_loss"]) for r in rows if "lm_loss" in r]
    val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    if train:
        ax.plot(*zip(*train, strict=True), label="train (lm_loss)")
    if val:
        ax.plot(*zip(*val, strict=True), "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per token)")
    ax.set_title("Loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _edges(steps: list[int]) -> np.ndarray:
    """Cell edges around each logged step, halfway to its neighbours (any spacing)."""
    s = np.asarray(steps, np.float64)
    if s.size == 1:
        return np.array([s[0] - 0.5, s[0] + 0.5])
    mid = (s[1:] + s[:-1]) / 2
    return np.concatenate([[s[0] - (mid[0] - s[0])], mid, [s[-1] + (s[-1] - mid[-1])]])


def plot_expert_load(rows: list[dict], path: Path) -> None:
    """One heatmap per MoE layer: share of assignments per expert (rows) over steps, on
    one colour scale for every layer, white at the uniform share 1 / experts."""
    logged = [r for r in rows if "expert_load" in r]
    if not logged:
        return
    steps = [r["step"] for r in logged]
    load = np.asarray([r["expert_load"] for r in logged])  # [time, layers, experts]
    layers, experts = load.shape[1], load.shape[2]
    uniform = 1.0 / experts
    norm = matplotlib.colors.TwoSlopeNorm(
        vcenter=uniform, vmin=0.0, vmax=max(2 * uniform, float(load.max()))
    )
    fig, axes = plt.subplots(layers, 1, figsize=(8, 1.0 + 1.6 * layers), squeeze=False)
    x, y = _edges(steps), np.arange(experts + 1) - 0.5
    for layer, ax in enumerate(axes[:, 0]):
        image = ax.pcolormesh(x, y, load[:, layer, :].T, cmap="RdBu_r", norm=norm)
        ax.invert_yaxis()
        ax.set_ylabel(f"MoE layer {layer}\nexpert")
    axes[-1, 0].set_xlabel("step")
    fig.colorbar(
        image, ax=axes[:, 0].tolist(), label=f"share of tokens (white: uniform {uniform:.3g})"
    )
    fig.suptitle("Expert load")
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_run(workdir: Path) -> list[Path]:
    rows = read_rows(workdir / "metrics.jsonl")
    outputs = [workdir / "loss.png", workdir / "expert_load.png"]
    plot_loss(rows, outputs[0])
    plot_expert_load(rows, outputs[1])
    return [p for p in outputs if p.exists()]
