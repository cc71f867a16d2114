"""One script for a GPU session: checks the GPU paths against the CPU-tested ones
and times them, in a single run (device time is scarce).

    python bench/gpu_check.py            # on the GPU machine
    python bench/gpu_check.py --small    # a quick dry run anywhere

1. Correctness on the device: the MoE block's output and gradients for
   `ragged_dot` (the GPU default) and `tiled` against the `dense` reference,
   float32, several routings, capacity mode included.
2. Speed: forward+backward of the MoE block per impl at the benchmark shape
   (top-2, d=512, expert width 1024, tokens 8192, E = 8 and 64) in float32 and
   bfloat16, as a ratio to a dense SwiGLU of the same useful FLOPs measured in
   the same run.
3. The ragged all-to-all expert layout (`bench/gpu_ragged_exchange.py`, GPU
   only: XLA:CPU does not implement `ragged_all_to_all`) against the padded
   all-to-all layout: loss, gradients and time.
4. The attention cores (`bench/gpu_attention.py`): cuDNN flash attention and the
   blockwise core against float32 `xla` attention, and their time; one model step
   with `model.remat='offload'` against `selective`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import gpu_attention
import gpu_ragged_exchange
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from timing import median_seconds

from moe_jax.config import MoEConfig
from moe_jax.moe.block import MoE, RouterBias

CASES = {
    "softmax_top2": MoEConfig(num_experts=8, top_k=2),
    "sigmoid_top6": MoEConfig(num_experts=16, top_k=6, score_fn="sigmoid", renormalize=False),
    "grouped": MoEConfig(num_experts=16, top_k=4, n_groups=4, topk_groups=2),
    "capacity": MoEConfig(num_experts=8, top_k=2, capacity_factor=0.6),
}


def _grad_fn(cfg: MoEConfig, dim: int, dtype):
    block = MoE(dim, cfg, rngs=nnx.Rngs(0))
    graphdef, params, biases = nnx.split(block, nnx.Param, RouterBias)

    def loss(params, x):
        y, _ = nnx.merge(graphdef, params, biases)(x.astype(dtype))
        return jnp.mean(jnp.square(y.astype(jnp.float32)))

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1))), params


def check_correctness(tokens: int, dim: int) -> dict[str, float]:
    """Worst relative error of loss and gradients against the dense reference."""
    x = jax.random.normal(jax.random.key(1), (tokens // 64, 64, dim))
    worst = {}
    for name, base in CASES.items():
        ref_fn, params = _grad_fn(dataclasses.replace(base, impl="dense"), dim, jnp.float32)
        ref = ref_fn(params, x)
        for impl in ("ragged_dot", "tiled"):
            fn, _ = _grad_fn(dataclasses.replace(base, impl=impl), dim, jnp.float32)
            got = fn(params, x)
            errors = [
                float(jnp.abs(a - b).max() / (jnp.abs(b).max() + 1e-30))
                for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True)
            ]
            worst[f"{name}/{impl}"] = max(errors)
    return worst


def time_block(tokens: int, dim: int, width: int, repeats: int) -> dict:
    results = {}
    for dtype in (jnp.float32, jnp.bfloat16):
        w = jax.random.normal(jax.random.key(0), (3, dim, width), dtype) / np.sqrt(dim)
        rows = jax.random.normal(jax.random.key(1), (tokens * 2, dim), dtype)

        def dense(w, rows):
            h = jax.nn.silu(rows @ w[0]) * (rows @ w[1])
            return jnp.mean(jnp.square((h @ w[2].T).astype(jnp.float32)))

        base = median_seconds(jax.jit(jax.grad(dense, argnums=(0, 1))), (w, rows), repeats)
        name = jnp.dtype(dtype).name
        results[f"{name}/matmul_ms"] = round(base * 1e3, 3)
        x = jax.random.normal(jax.random.key(2), (tokens // 1024, 1024, dim))
        for experts in (8, 64):
            for impl, cf in (("ragged_dot", 0.0), ("tiled", 0.0), ("capacity", 1.25)):
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
                seconds = median_seconds(fn, (params, x), repeats)
                results[f"{name}/E{experts}/{impl}_ms"] = round(seconds * 1e3, 3)
                results[f"{name}/E{experts}/{impl}_vs_matmul"] = round(base / seconds, 3)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny sizes, for a dry run")
    args = parser.parse_args()
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    tokens, dim, width, repeats = (2048, 64, 128, 2) if args.small else (8192, 512, 1024, 10)
    report = {"device": jax.devices()[0].device_kind, "jax": jax.__version__}
    report["max_rel_error"] = check_correctness(1024 if args.small else 4096, 64)
    for key, value in report["max_rel_error"].items():
        print(f"correctness {key}: {value:.2e}", flush=True)
    report["timing"] = time_block(tokens, dim, width, repeats)
    for key, value in report["timing"].items():
        print(f"timing {key}: {value}", flush=True)
    report["ok"] = all(v < 1e-4 for v in report["max_rel_error"].values())
    report["ragged_exchange"] = gpu_ragged_exchange.run(args.small)
    report["ok"] = report["ok"] and report["ragged_exchange"]["ok"]
    report["attention"] = gpu_attention.run(args.small)
    report["ok"] = report["ok"] and report["attention"]["ok"]
    print(json.dumps(report), flush=True)
    raise SystemExit(0 if report["ok"] else 1)  # a failed check fails the command too


if __name__ == "__main__":
    main()
