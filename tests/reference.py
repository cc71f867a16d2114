"""An independent, deliberately plain MoE block for tests: argsort instead of
top_k, a Python loop over experts, and capacity decided in NumPy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from moe_jax.config import MoEConfig


def select(logits: jax.Array, bias: jax.Array, cfg: MoEConfig):
    """(scores [T, E], chosen experts [T, k]) as a textbook router would pick them."""
    scores = jax.nn.softmax(logits, -1) if cfg.score_fn == "softmax" else jax.nn.sigmoid(logits)
    biased = np.asarray(scores + bias)
    num_tokens, num_experts = biased.shape
    size = num_experts // cfg.n_groups
    chosen = np.zeros((num_tokens, cfg.top_k), np.int64)
    for t in range(num_tokens):
        row = biased[t].copy()
        if cfg.n_groups > 1:
            groups = row.reshape(cfg.n_groups, size)
            best = 1 if cfg.group_score == "max" else min(2, size)
            group_score = np.sort(groups, -1)[:, -best:].sum(-1)
            best_groups = np.argsort(-group_score, kind="stable")[: cfg.topk_groups]
            for g in range(cfg.n_groups):
                if g not in best_groups:
                    row[g * size : (g + 1) * size] = -np.inf
        chosen[t] = np.argsort(-row, kind="stable")[: cfg.top_k]
    return scores, jnp.asarray(chosen)


def gate_weights(scores: jax.Array, chosen: jax.Array, cfg: MoEConfig) -> jax.Array:
    w = jnp.take_along_axis(scores, chosen, axis=-1)
    if cfg.renormalize:
        w = w / w.sum(-1, keepdims=True)
    return w * cfg.routed_scaling


def keep_mask(weights: np.ndarray, chosen: np.ndarray, cfg: MoEConfig) -> np.ndarray:
    """Per expert, keep the `capacity` heaviest assignments (earlier token wins ties)."""
    keep = np.ones(chosen.shape, bool)
    if cfg.capacity_factor == 0:
        return keep
    capacity = cfg.capacity(chosen.shape[0])
    for e in range(cfg.num_experts):
        slots = [
            (-weights[t, j], t * chosen.shape[1] + j)
            for t, j in zip(*np.nonzero(chosen == e), strict=True)
        ]
        for _, flat in sorted(slots)[capacity:]:
            keep[flat // chosen.shape[1], flat % chosen.shape[1]] = False
    return keep


def swiglu(x, gate, up, down):
    return (jax.nn.silu(x @ gate) * (x @ up)) @ down


def moe_forward(x, params: dict, bias, cfg: MoEConfig, keep: np.ndarray | None = None):
    """x [B, S, d] -> (y, chosen, keep). `keep` may be passed to differentiate."""
    batch, seq, dim = x.shape
    tokens = x.reshape(-1, dim)
    logits = tokens.astype(jnp.float32) @ params["router"]
    scores, chosen = select(jax.lax.stop_gradient(logits), bias, cfg)
    scores = jax.nn.softmax(logits, -1) if cfg.score_fn == "softmax" else jax.nn.sigmoid(logits)
    weights = gate_weights(scores, chosen, cfg)
    if keep is None:
        keep = keep_mask(np.asarray(weights), np.asarray(chosen), cfg)
    y = jnp.zeros_like(tokens)
    for e in range(cfg.num_experts):
        gate = jnp.sum(jnp.where((chosen == e) & keep, weights, 0.0), axis=-1, keepdims=True)
        y = y + gate * swiglu(tokens, params["gate"][e], params["up"][e], params["down"][e])
    if "shared_gate" in params:
        shared = swiglu(tokens, params["shared_gate"], params["shared_up"], params["shared_down"])
        if "shared_output_gate" in params:  # Qwen2-MoE: scaled by a sigmoid per token
            shared = shared / (1.0 + jnp.exp(-(tokens @ params["shared_output_gate"])))
        y = y + shared
    return y.reshape(batch, seq, dim), chosen, keep
