"""Host memory and step time of a 500M+ parameter MoE trained on 8 forced CPU devices,
with and without donating the train state to the jitted step.

Why: the trainer builds the state straight into the plan's shardings and donates it to
each step, so the state should exist once across the devices, never once per device,
and a step should not need a second copy of it. On CPU all 8 devices live in this one
process, so its peak resident memory shows both. The acceptance bound (issue 12) is
peak RSS < 1.5 x the bytes of the whole train state (parameters and AdamW moments);
the rest of the peak is the gradients (a third of the state), activations, XLA's other
temporaries, the compiler and the JAX runtime. XLA's own buffer sizes per device
(`memory_analysis`) are printed beside the measurement to say which is which.

The plan, tp attention + vocab-parallel embedding and head + ep_a2a experts on an
intra group of 8, splits every large array over the 8 devices. The state is built
as `moe_jax.trainer.run` builds it: `abstract_state`, `train_state_shardings`, then
`init_placed`, so no array is ever whole on one device. Both steps are compiled ahead
(timed apart) from abstract inputs before the state exists; the donated steps run
first (ru_maxrss only grows), then as many steps of the same step without donation,
which holds the old and the new state at once. Step times are medians over each
phase's steps after its first (which pays for first touching the buffers). The
defaults (8 layers of 16 experts, 695M parameters; model.remat='full' and
parallel.a2a_buffer_factor=2, batch 2 x 128) keep the activations small beside the
state, so the peak is the state, its gradients (a third of it) and little else:
what a memory-bound run would choose.

    python bench/scale.py [--layers 8] [--experts 16] [--steps 3] [--batch 2] [--seq 128]
        [--remat full] [--a2a-buffer-factor 2]
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import argparse
import math
import resource
import time
from functools import partial

import jax
import numpy as np
from jax.stages import Compiled

from moe_jax import memory_check
from moe_jax.config import (
    Config,
    DataConfig,
    ModelConfig,
    MoEConfig,
    ParallelConfig,
    TrainConfig,
    validate,
)
from moe_jax.optimizer import rates
from moe_jax.parallel import mesh as mesh_lib
from moe_jax.plan.resolve import check_plan
from moe_jax.train_state import TrainState
from moe_jax.train_step import (
    RATE,
    abstract_state,
    init_placed,
    step_shardings,
    train_step,
    with_shardings,
)

DEVICES = 8
GB = 1e9
BOUND = 1.5  # peak RSS / whole train state bytes


def make_config(
    layers: int, experts: int, batch: int, seq: int, remat: str, factor: float
) -> Config:
    """16 query heads over 8 kv heads of 64: both split 8 ways by tp (GQA kept)."""
    config = Config(
        model=ModelConfig(
            vocab_size=32000,
            num_layers=layers,
            embed_dim=1024,
            num_heads=16,
            num_kv_heads=8,
            head_dim=64,
            remat=remat,
        ),
        moe=MoEConfig(num_experts=experts, top_k=2, expert_mlp_dim=1536),
        train=TrainConfig(batch_size=batch, seq_len=seq, warmup_steps=0),
        data=DataConfig(source="synthetic"),
        parallel=ParallelConfig(
            attention="tp",
            experts="ep_a2a",
            intra=DEVICES,
            data=1,
            vocab_parallel=True,
            a2a_buffer_factor=factor,
        ),
    )
    validate(config)
    return check_plan(config, DEVICES)


def peak_rss() -> float:
    """Peak resident bytes of this process so far (ru_maxrss is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def available_ram() -> float:
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    return float(fields["MemAvailable"].split()[0]) * 1024


def held_bytes(tree) -> int:
    """Bytes the devices really hold for `tree`: every shard on every device."""
    return sum(s.data.nbytes for leaf in jax.tree.leaves(tree) for s in leaf.addressable_shards)


def compile_step(step, state: TrainState, batch: dict, label: str) -> tuple[Compiled, float]:
    """`step` compiled ahead of time, and the bytes its buffers need over all devices."""
    start = time.perf_counter()
    compiled = step.lower(state, batch, RATE).compile()
    seconds = time.perf_counter() - start
    m = compiled.memory_analysis()
    new_outputs = m.output_size_in_bytes - m.alias_size_in_bytes
    need = DEVICES * (m.argument_size_in_bytes + new_outputs + m.temp_size_in_bytes)
    print(
        f"{label}: compile {seconds:.1f} s; XLA buffers per device: state "
        f"{m.argument_size_in_bytes / GB:.2f} GB, new outputs {new_outputs / GB:.2f} GB, "
        f"temporaries {m.temp_size_in_bytes / GB:.2f} GB; {need / GB:.2f} GB on {DEVICES} "
        "devices",
        flush=True,
    )
    return compiled, need


def timed_step(
    compiled: Compiled, state: TrainState, batch: dict, lr: np.float32
) -> tuple[TrainState, float]:
    start = time.perf_counter()
    state, metrics = jax.block_until_ready(compiled(state, batch, lr))
    seconds = time.perf_counter() - start
    print(f"  step {int(state.step)}: {seconds:.2f} s, loss {float(metrics['loss']):.4f}")
    return state, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3, help="steps per phase")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--remat", default="full", help="model.remat")
    parser.add_argument("--a2a-buffer-factor", type=float, default=2.0)
    args = parser.parse_args()
    config = make_config(
        args.layers, args.experts, args.batch, args.seq, args.remat, args.a2a_buffer_factor
    )

    total, active = memory_check.parameter_counts(config)
    print(f"parameters: {total / 1e6:,.1f}M total, {active / 1e6:,.1f}M active per token")
    print(memory_check.summary(config)[2][-1])  # the planner's memory model, per device
    mesh = mesh_lib.make_mesh(config)
    layout = mesh_lib.make_layout(config, mesh)
    print(f"peak RSS before the state (imports, runtime): {peak_rss() / GB:.2f} GB")
    graphdef, abstract = abstract_state(config, layout)
    shardings = mesh_lib.train_state_shardings(abstract, layout, config.parallel.zero)
    state_bytes = sum(math.prod(a.shape) * a.dtype.itemsize for a in jax.tree.leaves(abstract))
    batch_sharding = mesh_lib.batch_sharding(layout)
    jit = partial(
        jax.jit,
        partial(train_step, graphdef, config),
        in_shardings=step_shardings(shardings, batch_sharding),
        out_shardings=(shardings, None),
    )
    # Compiled from abstract inputs before the state exists, as a real run can: the
    # compiler's working memory then never sits on top of the state (ru_maxrss only
    # grows, so order matters here).
    tokens = jax.ShapeDtypeStruct((args.batch, args.seq), np.int32, sharding=batch_sharding)
    steps, needs = {}, {}
    for label, donate in (("donated", (0,)), ("not donated", ())):
        abstract_batch = {"inputs": tokens, "targets": tokens}
        placed = with_shardings(abstract, shardings)
        steps[label], needs[label] = compile_step(
            jit(donate_argnums=donate), placed, abstract_batch, label
        )
    print(f"peak RSS after compiling: {peak_rss() / GB:.2f} GB")
    if max(needs.values()) - state_bytes > available_ram() - state_bytes:
        raise SystemExit(
            f"the steps need {max(needs.values()) / GB:.1f} GB but only "
            f"{available_ram() / GB:.1f} GB are available; lower --experts or --layers"
        )

    state = jax.block_until_ready(init_placed(config, layout, shardings))
    held = held_bytes(state)
    print(
        f"train state: {state_bytes / GB:.2f} GB (params + AdamW moments); the {DEVICES} "
        f"devices hold {held / GB:.2f} GB ({held / state_bytes:.3f}x the state)"
    )
    init_rss = peak_rss()
    print(f"peak RSS after init: {init_rss / GB:.2f} GB = {init_rss / state_bytes:.2f}x the state")

    shape = (args.batch, args.seq + 1)
    values = np.random.default_rng(0).integers(0, config.model.vocab_size, shape, np.int32)
    batch = jax.device_put({"inputs": values[:, :-1], "targets": values[:, 1:]}, batch_sharding)
    rss, seconds = {}, {}
    lrs = iter(rates(config.train, 0, 2 * args.steps))  # the steps of both phases
    for label in ("donated", "not donated"):
        print(f"{label}:")
        times = []
        for _ in range(args.steps):
            state, step_seconds = timed_step(steps[label], state, batch, next(lrs))
            times.append(step_seconds)
        rss[label], seconds[label] = peak_rss(), float(np.median(times[1:] or times))

    for label, need in needs.items():
        print(
            f"peak RSS after the {label} steps: {rss[label] / GB:.2f} GB = "
            f"{rss[label] / state_bytes:.2f}x the train state (XLA's buffers: "
            f"{need / state_bytes:.2f}x)"
        )
    ratio = rss["donated"] / state_bytes
    verdict = "PASS" if ratio < BOUND else "FAIL"
    print(f"{verdict}: peak RSS with donation is {ratio:.2f}x the train state (bound {BOUND}x)")
    print(
        f"median step: donated {seconds['donated']:.2f} s, not donated "
        f"{seconds['not donated']:.2f} s ({seconds['not donated'] / seconds['donated']:.2f}x "
        "the donated step)"
    )


if __name__ == "__main__":
    main()
