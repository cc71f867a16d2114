"""One script for a GPU session: checks the GPU paths against the CPU-tested ones
and times them, in a single run (device time is scarce).

    python bench/gpu_check.py            # on the GPU machine
    python bench/gpu_check.py --small    # a quick dry run anywhere

1. Correctness on the device, with fresh random inputs:
   a. the MoE block's output and gradients for `ragged_dot` (the GPU default),
      `tiled`, `pallas` and `tokamax` (when installed) against the `dense`
      reference, float32, several routings, capacity mode included;
   b. kernel level (`bench/gpu_kernels.py`): each implementation's grouped matmul
      (forward, input and weight gradient) against a float64 loop over groups,
      for awkward group sizes, and the fused-permutation Pallas ops against
      float64 dispatch -> GEMM -> combine.
2. Speed:
   a. TFLOP/s of one grouped matmul's three GEMMs per implementation at the
      Mixtral-8x7B, DeepSeek-MoE and 352B shapes (about 32k rows, balanced and
      Zipf routing, bfloat16) against a dense matmul of the same FLOPs; the
      dispatch/combine bandwidth against a copy's, and the overhead of fusing
      them into the Pallas kernels (`bench/gpu_kernels.py`);
   b. forward+backward of the MoE block per impl at the benchmark shape
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
import time
import traceback

import gpu_attention
import gpu_kernels
import gpu_ragged_exchange
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
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


def check_correctness(tokens: int, dim: int, cases: tuple[str, ...]) -> tuple[dict, list]:
    """Worst relative error of loss and gradients against the dense reference, and the
    impls that raised (the others still run)."""
    x = jax.random.normal(jax.random.key(1), (tokens // 64, 64, dim))
    worst, raised = {}, []
    for name in cases:
        base = CASES[name]
        ref_fn, params = _grad_fn(dataclasses.replace(base, impl="dense"), dim, jnp.float32)
        ref = ref_fn(params, x)
        for impl in dropless_impls():
            fn, _ = _grad_fn(dataclasses.replace(base, impl=impl), dim, jnp.float32)
            try:
                got = fn(params, x)
            except Exception as error:
                raised.append(f"block {name}/{impl} {gpu_kernels.raised(error)}")
                continue
            errors = [
                float(jnp.abs(a - b).max() / (jnp.abs(b).max() + 1e-30))
                for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True)
            ]
            worst[f"{name}/{impl}"] = max(errors)
    return worst, raised


def time_block(tokens: int, dim: int, width: int, repeats: int, small: bool = False):
    """Forward+backward per impl against a dense SwiGLU (`small`: bfloat16, E=8 only),
    and the impls that raised."""
    results, raised = {}, []
    for dtype in (jnp.bfloat16,) if small else (jnp.float32, jnp.bfloat16):
        w = jax.random.normal(jax.random.key(0), (3, dim, width), dtype) / np.sqrt(dim)
        rows = jax.random.normal(jax.random.key(1), (tokens * 2, dim), dtype)

        def dense(w, rows):
            h = jax.nn.silu(rows @ w[0]) * (rows @ w[1])
            return jnp.mean(jnp.square((h @ w[2].T).astype(jnp.float32)))

        base = median_seconds(jax.jit(jax.grad(dense, argnums=(0, 1))), (w, rows), repeats)
        name = jnp.dtype(dtype).name
        results[f"{name}/matmul_ms"] = round(base * 1e3, 3)
        seq = min(tokens, 1024)
        x = jax.random.normal(jax.random.key(2), (tokens // seq, seq, dim))
        impls = [(impl, 0.0) for impl in dropless_impls()] + [("capacity", 1.25)]
        for experts in (8,) if small else (8, 64):
            for impl, cf in impls:
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
                try:
                    seconds = median_seconds(fn, (params, x), repeats)
                except Exception as error:
                    raised.append(
                        f"block timing {name}/E{experts}/{impl} {gpu_kernels.raised(error)}"
                    )
                    continue
                results[f"{name}/E{experts}/{impl}_ms"] = round(seconds * 1e3, 3)
                results[f"{name}/E{experts}/{impl}_vs_matmul"] = round(base / seconds, 3)
    return results, raised


def block_checks(small: bool) -> dict:
    """Sections 1a and 2b: the MoE block per impl, correctness then time (`small`: a
    dry run, two routing cases)."""
    tokens, dim, width, repeats = (512, 64, 128, 1) if small else (8192, 512, 1024, 10)
    cases = ("softmax_top2", "capacity") if small else tuple(CASES)
    with jax.default_matmul_precision("highest"):
        errors, raised = check_correctness(256 if small else 4096, 64, cases)
    for key, value in errors.items():
        print(f"correctness {key}: {value:.2e}", flush=True)
    failures = raised + [
        f"block {key}: {value:.2e}"
        for key, value in errors.items()
        if not value < TOLERANCE.get(key.split("/")[1], DEFAULT_TOLERANCE)
    ]
    timing, raised = time_block(tokens, dim, width, repeats, small)
    failures += raised
    for key, value in timing.items():
        print(f"timing {key}: {value}", flush=True)
    return {"max_rel_error": errors, "timing": timing, "failures": failures}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny sizes, for a dry run")
    args = parser.parse_args()
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    report = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "seconds": {}}
    sections = {
        "block": block_checks,
        "kernels": gpu_kernels.run,
        "ragged_exchange": gpu_ragged_exchange.run,
        "attention": gpu_attention.run,
    }
    failures = []
    for name, run in sections.items():
        start = time.perf_counter()
        try:
            result = run(args.small)
        except Exception as error:  # the other sections still run
            traceback.print_exc()
            result = {"ok": False, "error": gpu_kernels.raised(error), "failures": []}
        report["seconds"][name] = round(time.perf_counter() - start, 1)
        print(f"section {name}: {report['seconds'][name]} s", flush=True)
        if name == "block" and "error" not in result:
            failures += result.pop("failures")
            report.update(result)
        else:
            report[name] = result
            failures += [] if result["ok"] else [f"{name}: {result.get('error', 'see above')}"]
    for failure in failures:
        print(f"FAILED {failure}", flush=True)
    report["failures"], report["ok"] = failures, not failures
    print(json.dumps(report), flush=True)
    raise SystemExit(0 if report["ok"] else 1)  # a failed check fails the command too


if __name__ == "__main__":
    main()
