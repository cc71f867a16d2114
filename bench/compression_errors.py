"""Error of each compressed exchange on a trained model's own tensors, beside the naive
alternatives, against float32.

    python bench/compression_errors.py [--steps 300]   # trains the default config first
    python bench/compression_errors.py --small         # a quick dry run (20 steps)

(Not `compression.py`: a module of that name in `bench/` would stand in for the one
orbax's dependencies import, for every script here.)

1. Trains `configs/default.py` on the embedded corpus for --steps (one CPU device) and
   restores its last checkpoint: the distributions come from a trained model, not
   Gaussian noise.
2. Captures, on one training batch, every MoE block's input tokens (what a dispatch
   moves) and the cotangent arriving there in the backward (what the dispatch's
   backward moves), through a layout that records them.
3. Takes the gradients of DEVICES different batches, as DEVICES data-parallel devices
   would hold them before their gradient exchange.

Errors are ||approx - exact|| / ||exact|| over all captured values:
  forward payload   FP8 with per-token 1x128 scales (`parallel.token_dtype='fp8'`), FP8
                    without scales (a plain cast), bf16;
  backward          bf16 (what the FP8 exchange's backward sends), FP8 without scales;
  summed gradient   bf16 shards summed in float32 after an all-to-all (one rounding),
                    against a bf16 ring reduce-scatter emulated with a rounding to bf16
                    at every hop (what a bf16 reduce-scatter does).
Prints one JSON object last. Ratios, not times: nothing here is timed.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np

from moe_jax import config as config_lib
from moe_jax import trainer
from moe_jax.checkpoint import Checkpointer
from moe_jax.data import pipeline
from moe_jax.parallel.fp8_exchange import E4M3, dequantize, quantize
from moe_jax.parallel.layout import SINGLE_DEVICE, Layout
from moe_jax.train_state import init_state
from moe_jax.train_step import gradients

ROOT = Path(__file__).resolve().parents[1]
DEVICES = 8  # data-parallel devices whose gradients are summed


class Recording(Layout):
    """The single-device layout, recording each MoE block's input and its cotangent."""

    def moe(self, forward, x, params, cfg):
        return super().moe(forward, _recorded(x), params, cfg)


TOKENS: list[np.ndarray] = []
COTANGENTS: list[np.ndarray] = []


@jax.custom_vjp
def _recorded(x):
    jax.debug.callback(lambda v: TOKENS.append(np.asarray(v, np.float32)), x)
    return x


def _forward(x):
    return _recorded(x), None


def _backward(_, g):
    jax.debug.callback(lambda v: COTANGENTS.append(np.asarray(v, np.float32)), g)
    return (g,)


_recorded.defvjp(_forward, _backward)


def relative(approx: np.ndarray, exact: np.ndarray) -> float:
    return float(np.linalg.norm(approx - exact) / np.linalg.norm(exact))


def fp8_scaled(x: np.ndarray) -> np.ndarray:
    payload, scales = quantize(jnp.asarray(x))
    return np.asarray(dequantize(payload, scales, jnp.float32))


def fp8_plain(x: np.ndarray) -> np.ndarray:
    """A plain cast: values beyond 448 saturate to NaN in E4M3FN, so clip as a kind cast would."""
    clipped = np.clip(x, -448.0, 448.0)
    return np.asarray(jnp.asarray(clipped).astype(E4M3).astype(jnp.float32))


def bf16(x: np.ndarray) -> np.ndarray:
    return np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32))


def ring_sum(shards: list[np.ndarray]) -> np.ndarray:
    """A bf16 ring reduce-scatter's sum: the running sum rounded to bf16 at every hop."""
    total = bf16(shards[0])
    for shard in shards[1:]:
        total = bf16(total + bf16(shard))
    return total


def a2a_sum(shards: list[np.ndarray]) -> np.ndarray:
    """The all-to-all form: each shard rounded to bf16 once, summed in float32."""
    return np.sum([bf16(s) for s in shards], axis=0, dtype=np.float32)


def trained(steps: int, workdir: Path):
    raw = runpy.run_path(str(ROOT / "configs" / "default.py"))["get_config"]()
    raw.train.steps = steps
    raw.train.checkpoint_every = steps
    raw.train.eval_every = 0
    config = config_lib.load(raw)
    trainer.run(config, workdir)
    _, state = init_state(config, SINGLE_DEVICE)
    checkpoints = Checkpointer(workdir / "checkpoints", 1)
    state, _ = checkpoints.restore(checkpoints.steps()[0], state)
    return config, state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="training steps first")
    parser.add_argument("--small", action="store_true", help="20 steps: a dry run")
    args = parser.parse_args()
    steps = 20 if args.small else args.steps
    with tempfile.TemporaryDirectory() as tmp:
        config, state = trained(steps, Path(tmp) / "run")
    batches = pipeline.make_iterator(config, "train", np.arange(config.train.batch_size))
    recording, _ = init_state(config, Recording())
    plain, _ = init_state(config, SINGLE_DEVICE)
    # One program per graph (run op by op, each batch's step took seconds on a CPU).
    step = jax.jit(gradients, static_argnums=(1, 3))
    shards = []
    for d in range(DEVICES):  # device d's batch: the d-th next one
        batch = {k: jnp.asarray(v) for k, v in next(batches).items()}
        graphdef = recording if d == 0 else plain
        _, grads = step(state, graphdef, batch, config)
        shards.append(np.concatenate([np.ravel(g) for g in jax.tree.leaves(grads)]))
    jax.effects_barrier()
    tokens_2d = np.concatenate([t.reshape(-1, t.shape[-1]) for t in TOKENS])
    cot_2d = np.concatenate([c.reshape(-1, c.shape[-1]) for c in COTANGENTS])
    exact = np.sum(shards, axis=0, dtype=np.float64).astype(np.float32)
    report = {
        "steps": steps,
        "tokens": int(tokens_2d.shape[0]),
        "forward_payload": {
            "fp8_1x128_scaled": relative(fp8_scaled(tokens_2d), tokens_2d),
            "fp8_unscaled": relative(fp8_plain(tokens_2d), tokens_2d),
            "bf16": relative(bf16(tokens_2d), tokens_2d),
        },
        "backward_cotangent": {
            "bf16": relative(bf16(cot_2d), cot_2d),
            "fp8_unscaled": relative(fp8_plain(cot_2d), cot_2d),
            "fp8_1x128_scaled": relative(fp8_scaled(cot_2d), cot_2d),
        },
        "summed_gradient": {
            "bf16_a2a_fp32_sum": relative(a2a_sum(shards), exact),
            "bf16_ring_per_hop": relative(ring_sum(shards), exact),
        },
        "cotangent_abs_median": float(np.median(np.abs(cot_2d))),
    }
    g = report["summed_gradient"]
    report["a2a_over_ring"] = g["bf16_a2a_fp32_sum"] / g["bf16_ring_per_hop"]
    for part in ("forward_payload", "backward_cotangent", "summed_gradient"):
        print(part, {k: f"{v:.2e}" for k, v in report[part].items()}, flush=True)
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    sys.exit(main())
