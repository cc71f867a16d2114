"""The MoE block per `moe.impl` on the device (sections `block_correctness` and
`block_timing` of `gpu_check.py`).

* Correctness: the block's output and gradients for `ragged_dot` (the GPU default),
  `tiled`, `pallas` and `tokamax` (when installed) against the `dense` reference,
  float32, several routings, capacity mode included, on fresh random inputs.
* Time: forward+backward per impl at the benchmark shape (top-2, d=512, expert width
  1024, 8192 tokens, E = 8 and 64) in float32 and bfloat16, as a ratio to a dense
  SwiGLU of the same useful FLOPs measured in the same run.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import repo_root  # noqa: F401  (before moe_jax: this checkout on the path)
from flax import nnx
from gpu_session import Section, raised, timed
from timing import median_seconds

from moe_jax.config import MoEConfig
from moe_jax.kernels import tokamax_gmm
from moe_jax.moe.block import MoE, RouterBias

CASES = {
    "softmax_top2": MoEConfig(num_experts=8, top_k=2),
    "sigmoid_top6": MoEConfig(num_experts=16, top_k=6, score_fn="sigmoid", renormalize=False),
    "grouped": MoEConfig(num_experts=16, top_k=4, n_groups=4, topk_groups=2),
    "capacity": MoEConfig(num_experts=8, top_k=2, capacity_factor=0.6),
}
# The block's worst relative error against `dense` (float32; XLA's dots at "highest"
# precision); Triton's float32 dot in the Pallas kernels may use TF32.
TOLERANCE = {"pallas": 2e-3}
DEFAULT_TOLERANCE = 1e-4
ITEM_SECONDS = {"small": 1.0, "full": 8.0}  # one block timing: compile and 10 calls


def dropless_impls() -> tuple[str, ...]:
    """The sorted-row implementations this machine can run (tokamax if installed)."""
    return ("ragged_dot", "tiled", "pallas") + (() if tokamax_gmm.missing() else ("tokamax",))


def _grad_fn(cfg: MoEConfig, dim: int, dtype):
    block = MoE(dim, cfg, rngs=nnx.Rngs(0))
    graphdef, params, biases = nnx.split(block, nnx.Param, RouterBias)

    def loss(params, x):
        y, _ = nnx.merge(graphdef, params, biases)(x.astype(dtype))
        return jnp.mean(jnp.square(y.astype(jnp.float32)))

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1))), params


def correctness(ctx: Section) -> None:
    """Worst relative error of loss and gradients against the dense reference, per
    routing case and impl; an impl that raises is a failure, the others still run."""
    tokens, dim = (256, 64) if ctx.small else (4096, 64)
    cases = ("softmax_top2", "capacity") if ctx.small else tuple(CASES)
    x = jax.random.normal(jax.random.key(1), (tokens // 64, 64, dim))
    with jax.default_matmul_precision("highest"):
        for name in cases:
            base = CASES[name]
            ref_fn, params = _grad_fn(dataclasses.replace(base, impl="dense"), dim, jnp.float32)
            ref = ref_fn(params, x)
            for impl in dropless_impls():
                fn, _ = _grad_fn(dataclasses.replace(base, impl=impl), dim, jnp.float32)
                try:
                    got = fn(params, x)
                except Exception as error:
                    ctx.fail(f"{name}/{impl} {raised(error)}")
                    continue
                worst = max(
                    float(jnp.abs(a - b).max() / (jnp.abs(b).max() + 1e-30))
                    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True)
                )
                ctx.record(f"{name}/{impl}", worst, "max_rel_error")
                if not worst < TOLERANCE.get(impl, DEFAULT_TOLERANCE):
                    ctx.fail(f"{name}/{impl}: {worst:.2e}")


def timing(ctx: Section) -> None:
    """Forward+backward per impl against a dense SwiGLU (`small`: bfloat16, E=8 only)."""
    tokens, dim, width, repeats = (512, 64, 128, 1) if ctx.small else (8192, 512, 1024, 10)
    item = ITEM_SECONDS["small" if ctx.small else "full"]
    for dtype in (jnp.bfloat16,) if ctx.small else (jnp.float32, jnp.bfloat16):
        name = jnp.dtype(dtype).name
        w = jax.random.normal(jax.random.key(0), (3, dim, width), dtype) / np.sqrt(dim)
        rows = jax.random.normal(jax.random.key(1), (tokens * 2, dim), dtype)

        def dense(w, rows):
            h = jax.nn.silu(rows @ w[0]) * (rows @ w[1])
            return jnp.mean(jnp.square((h @ w[2].T).astype(jnp.float32)))

        base = median_seconds(jax.jit(jax.grad(dense, argnums=(0, 1))), (w, rows), repeats)
        ctx.record(f"{name}/matmul_ms", round(base * 1e3, 3))
        seq = min(tokens, 1024)
        x = jax.random.normal(jax.random.key(2), (tokens // seq, seq, dim))
        impls = [(impl, 0.0) for impl in dropless_impls()] + [("capacity", 1.25)]
        for experts in (8,) if ctx.small else (8, 64):
            for impl, cf in impls:
                key = f"{name}/E{experts}/{impl}"
                if not ctx.time_for(item, key):
                    continue
                cfg = MoEConfig(
                    num_experts=experts,
                    top_k=2,
                    expert_mlp_dim=width,
                    impl=impl,
                    capacity_factor=cf,
                    aux_loss_coef=0.0,
                    z_loss_coef=0.0,
                )
                fn, params = _grad_fn(cfg, dim, dtype)
                seconds = timed(ctx, key, fn, (params, x), repeats)
                if seconds is None:
                    continue
                ctx.record(f"{key}_ms", round(seconds * 1e3, 3))
                ctx.record(f"{key}_vs_matmul", round(base / seconds, 3))
