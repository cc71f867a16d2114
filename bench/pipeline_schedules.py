"""GPipe against 1F1B and zero-bubble (`parallel.schedule`): step time and XLA's
temporaries per micro-batch count, each against the GPipe row of the same shape in
this run.

The trainer's jitted step (`moe_jax.train_step.train_step`), built as `moe_jax.trainer`
builds it, on 8 forced CPU devices: S = 2 stages of `sp+ep_a2a` over n = 4, a small
Mixtral-shaped model (hidden 256, 4 heads of 64, 8 experts top-2 of width 512, 4 MoE
layers, vocabulary 1024, seq 256, float32, `model.remat=full`), M micro-batches of one
sequence (the batch grows with M), R repeats. `temp_MB` is `memory_analysis()`'s
temporaries, `model_MB` the memory model's activations (`moe_jax.plan.memory`); time:
median of steps 3..--steps after compilation, each step waited for.

    python bench/pipeline_schedules.py [--json] [--steps 8] [--micro 4,8,16] [--repeats 1,2]
"""

from __future__ import annotations

import os

if "XLA_FLAGS" not in os.environ:  # 8 CPU devices, unless the user chose otherwise
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import argparse
import json
import time
from functools import partial

import jax
import numpy as np

from moe_jax.config import Config, ModelConfig, MoEConfig, ParallelConfig, TrainConfig
from moe_jax.parallel import mesh as mesh_lib
from moe_jax.plan import memory
from moe_jax.plan.resolve import check_plan
from moe_jax.train_step import RATE, abstract_state, init_placed, train_step

MODEL = ModelConfig(
    vocab_size=1024,
    num_layers=4,
    first_k_dense=0,
    embed_dim=256,
    num_heads=4,
    num_kv_heads=4,
    head_dim=64,
    dtype="float32",
    remat="full",
)
MOE = MoEConfig(num_experts=8, top_k=2, expert_mlp_dim=512)
SEQ = 256


def config_of(schedule: str, micro: int, repeats: int) -> Config:
    plan = ParallelConfig(
        attention="sp",
        experts="ep_a2a",
        intra=4,
        data=1,
        stages=2,
        microbatches=micro,
        repeats=repeats,
        schedule=schedule,
    )
    train = TrainConfig(batch_size=micro, seq_len=SEQ, steps=1000, warmup_steps=10)
    return check_plan(Config(model=MODEL, moe=MOE, train=train, parallel=plan), 8)


def measure(config: Config, steps: int) -> dict:
    layout = mesh_lib.make_layout(config, mesh_lib.make_mesh(config))
    graphdef, abstract = abstract_state(config, layout)
    shardings = mesh_lib.train_state_shardings(abstract, layout, config.parallel.zero)
    state = init_placed(config, layout, shardings)
    tokens = np.random.default_rng(0).integers(0, MODEL.vocab_size, (config.train.batch_size, SEQ))
    tokens = jax.device_put(tokens.astype(np.int32), mesh_lib.batch_sharding(layout))
    batch = {"inputs": tokens, "targets": tokens}
    step = jax.jit(
        partial(train_step, graphdef, config), out_shardings=(shardings, None), donate_argnums=0
    )
    compiled = step.lower(state, batch, RATE).compile()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        state, metrics = compiled(state, batch, np.float32(1e-3))
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    return {
        "step_s": float(np.median(times[2:])),
        "temp_MB": compiled.memory_analysis().temp_size_in_bytes / 1e6,
        "model_MB": memory.memory_per_device(config).activations / 1e6,
        "loss": float(metrics["loss"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--micro", default="4,8,16")
    parser.add_argument("--repeats", default="1,2")
    args = parser.parse_args()
    rows = []
    for repeats in map(int, args.repeats.split(",")):
        for micro in map(int, args.micro.split(",")):
            gpipe = measure(config_of("gpipe", micro, repeats), args.steps)
            row = {"M": micro, "R": repeats, "gpipe": gpipe}
            line = (
                f"M={micro:3d} R={repeats}  gpipe {gpipe['step_s'] * 1e3:7.1f} ms "
                f"{gpipe['temp_MB']:7.2f} MB (model {gpipe['model_MB']:6.2f})"
            )
            for schedule in ("1f1b", "zero_bubble"):
                got = measure(config_of(schedule, micro, repeats), args.steps)
                ratios = (got["step_s"] / gpipe["step_s"], got["temp_MB"] / gpipe["temp_MB"])
                row[schedule] = {**got, "time_ratio": ratios[0], "temp_ratio": ratios[1]}
                line += (
                    f"  {schedule} {got['step_s'] * 1e3:7.1f} ms {got['temp_MB']:7.2f} MB "
                    f"(model {got['model_MB']:6.2f}) time x{ratios[0]:.2f} temp x{ratios[1]:.3f}"
                    f" loss {got['loss'] - gpipe['loss']:+.1e}"
                )
            rows.append(row)
            if not args.json:
                print(line, flush=True)
    if args.json:
        print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
