"""Speed of the whole training step per parallel layout, against a plain matmul baseline.

The trainer's jitted step (`moe_jax.train_step.train_step`: loss, gradients, clipped
AdamW, router-bias update), built as `moe_jax.trainer` builds it (resolved plan, mesh,
layout, state and batch shardings, donated state), on 8 forced CPU devices, for a small
Mixtral-shaped model: hidden 256, 4 heads of 64 (4 kv heads), 8 experts top-2 of width
512, 2 layers, vocabulary 1024, seq 256, global batch 8, float32. Rows are layouts by
the planner's names (`dp`: data=8; `dp+ep_a2a`, `fsdp+ep_ag`: one intra group of n=8),
each dropless (`/drop0`, moe.capacity_factor=0) and with capacity factor 2.0 (`/cap2`).

Time per row: median of steps 6..--steps after compilation, each step waited for.
Model FLOP/s use `moe_jax.flops.flops_per_token` (active weights, causal attention).
The baseline is a jitted float32 matmul [8*2048, 1024] x [1024, 1024] with its rows
split over the 8 devices (each device multiplies [2048, 1024] x [1024, 1024]), chained
10 times per call, re-measured before each row in the same process; `of_matmul` is the
row's model FLOP/s over the matmul's FLOP/s.

    python bench/train_step.py [--json] [--rows dp/drop0,dp+ep_a2a/cap2,...] [--steps 30]
"""

from __future__ import annotations

import os

if "XLA_FLAGS" not in os.environ:  # 8 CPU devices, unless the user chose otherwise
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import argparse
import dataclasses
import json
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moe_jax import flops
from moe_jax.config import Config, ModelConfig, MoEConfig, ParallelConfig, TrainConfig
from moe_jax.optimizer import rates
from moe_jax.parallel import mesh as mesh_lib
from moe_jax.plan.resolve import check_plan
from moe_jax.train_step import RATE, abstract_state, init_placed, step_shardings, train_step

MODEL = ModelConfig(
    vocab_size=1024,
    num_layers=2,
    first_k_dense=0,
    embed_dim=256,
    num_heads=4,
    num_kv_heads=4,
    head_dim=64,
    dtype="float32",
)
MOE = MoEConfig(num_experts=8, top_k=2, expert_mlp_dim=512)
TRAIN = TrainConfig(batch_size=8, seq_len=256, steps=1000, warmup_steps=10)
# layout name -> (attention, experts, data, intra)
LAYOUTS = {
    "dp": ("dp", "auto", 8, 1),
    "dp+ep_a2a": ("dp", "ep_a2a", 1, 8),
    "fsdp+ep_ag": ("fsdp", "ep_ag", 1, 8),
}
CAPACITIES = {"drop0": 0.0, "cap2": 2.0}
ROWS = [f"{layout}/{cap}" for layout in LAYOUTS for cap in CAPACITIES]
FIRST_TIMED = 6  # steps 1..5 (compilation included) are not timed
MATMUL = (2048, 1024, 1024)  # per device
MATMUL_CHAIN = 10


def row_config(row: str) -> Config:
    layout, cap = row.split("/")
    attention, experts, data, intra = LAYOUTS[layout]
    plan = ParallelConfig(attention=attention, experts=experts, data=data, intra=intra)
    moe = dataclasses.replace(MOE, capacity_factor=CAPACITIES[cap])
    config = Config(model=MODEL, moe=moe, train=TRAIN, parallel=plan)
    return check_plan(config, jax.device_count())


def step_times(config: Config, steps: int) -> list[float]:
    """Seconds of each step 1..steps of the trainer's step under `config`'s plan."""
    mesh = mesh_lib.make_mesh(config)
    layout = mesh_lib.make_layout(config, mesh)
    sharding = mesh_lib.batch_sharding(layout)
    graphdef, abstract = abstract_state(config, layout)
    state_sharding = mesh_lib.train_state_shardings(abstract, layout, config.parallel.zero)
    state = init_placed(config, layout, state_sharding)
    step_fn = jax.jit(
        partial(train_step, graphdef, config),
        in_shardings=step_shardings(state_sharding, sharding),
        out_shardings=(state_sharding, None),
        donate_argnums=0,
    )
    rng = np.random.default_rng(0)
    b, s = config.train.batch_size, config.train.seq_len
    tokens = rng.integers(0, config.model.vocab_size, (b, s + 1)).astype(np.int32)
    batch = {
        "inputs": jax.device_put(tokens[:, :-1], sharding),
        "targets": jax.device_put(tokens[:, 1:], sharding),
    }
    compiled = step_fn.lower(state, batch, RATE).compile()
    times = []
    for lr in rates(config.train, 0, steps):
        start = time.perf_counter()
        state, metrics = compiled(state, batch, lr)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - start)
    return times


def matmul_seconds(repeats: int = 5) -> float:
    """Median seconds of one [2048,1024]x[1024,1024] float32 matmul on every device."""
    m, k, n = MATMUL
    mesh = jax.make_mesh((jax.device_count(),), ("d",))
    rows = NamedSharding(mesh, P("d"))
    x = jax.device_put(jnp.ones((m * jax.device_count(), k), jnp.float32), rows)
    w = jax.device_put(jnp.full((k, n), 1.0 / k, jnp.float32), NamedSharding(mesh, P()))

    @jax.jit
    def chain(x, w):
        for _ in range(MATMUL_CHAIN):
            x = x @ w
        return x

    compiled = chain.lower(x, w).compile()
    jax.block_until_ready(compiled(x, w))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(x, w))
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] / MATMUL_CHAIN


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"any of {','.join(ROWS)}")
    parser.add_argument("--steps", type=int, default=30, help="steps run per row")
    args = parser.parse_args()
    rows = args.rows.split(",")
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        parser.error(f"unknown rows {unknown}; choose from {ROWS}")
    if args.steps < FIRST_TIMED:
        parser.error(f"--steps must be at least {FIRST_TIMED}")

    m, k, n = MATMUL
    matmul_flop = 2.0 * m * k * n * jax.device_count()
    tokens = TRAIN.batch_size * TRAIN.seq_len
    model_flop = flops.flops_per_token(MODEL, MOE, TRAIN.seq_len) * tokens
    print(
        f"{jax.device_count()} {jax.default_backend()} devices; {tokens} tokens/step, "
        f"{model_flop / 1e9:.2f} model GFLOP/step; median of steps {FIRST_TIMED}-{args.steps}",
        flush=True,
    )
    results = []
    for row in rows:
        config = row_config(row)
        matmul = matmul_flop / matmul_seconds()
        times = step_times(config, args.steps)[FIRST_TIMED - 1 :]
        seconds = sorted(times)[len(times) // 2]
        model = model_flop / seconds
        result = {
            "row": row,
            "experts": config.parallel.experts,
            "ms": round(seconds * 1e3, 2),
            "tokens_per_s": round(tokens / seconds, 1),
            "model_gflops": round(model / 1e9, 2),
            "matmul_gflops": round(matmul / 1e9, 2),
            "of_matmul": round(model / matmul, 3),
        }
        results.append(result)
        print(
            f"{row:18s} ({result['experts']:6s}) {result['ms']:9.1f} ms/step "
            f"{result['tokens_per_s']:9.1f} tok/s {result['model_gflops']:7.2f} GFLOP/s "
            f"matmul {result['matmul_gflops']:7.2f} GFLOP/s  {result['of_matmul']:.3f} of matmul",
            flush=True,
        )
    if args.json:
        print(json.dumps({"rows": results, "first_timed_step": FIRST_TIMED, "steps": args.steps}))


if __name__ == "__main__":
    main()
