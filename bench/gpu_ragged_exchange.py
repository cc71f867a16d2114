"""GPU check of the ragged all-to-all expert layout against the padded one, in one run.

    python bench/gpu_ragged_exchange.py            # on the GPU machine
    python bench/gpu_ragged_exchange.py --small    # a quick dry run anywhere
    python bench/gpu_ragged_exchange.py --json     # also one JSON object as the last line

Mesh: data=1, intra = all local devices (one GPU: intra=1, which still runs
the op). XLA:CPU does not implement `ragged_all_to_all`: on CPU the ragged
path is only lowered (so its program is known to build) and everything else
runs.

1. Correctness: loss and gradients of the ragged dispatcher against
   the padded `ep_a2a` one for a 2-layer MoE transformer (embed 256, 8 experts
   top-2, batch 8, seq 512) in float32 and bfloat16 (`--small`: float32, tiny
   sizes), and for the MoE block
   alone with balanced routing, every token sent to experts 0 and 1 (the
   receive bound reached), and capacity drops. The padded layout is also
   checked against the single-device model.
2. Speed: forward+backward of the model and of the block, ragged and padded,
   and padded_ms / ragged_ms (above 1: the ragged exchange is faster).
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import repo_root  # noqa: F401  (before moe_jax: this checkout on the path)
from flax import nnx
from gpu_session import Section, raised, unbounded
from timing import DoesNotFit, median_seconds

from moe_jax.config import Config, ModelConfig, MoEConfig, ParallelConfig, TrainConfig
from moe_jax.model.transformer import Transformer
from moe_jax.moe.block import MoEParams, RouterBias, moe_forward
from moe_jax.moe.experts import ExpertWeights
from moe_jax.parallel import mesh as mesh_lib
from moe_jax.parallel.layout import SINGLE_DEVICE
from moe_jax.parallel.ragged_exchange import EP_A2A_RAGGED
from moe_jax.train_step import loss_fn

DTYPES = ("float32", "bfloat16")
TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2}  # worst |error| / max |reference|, per leaf
BLOCK_CASES = {
    # name: (capacity_factor, bias on experts 0 and 1: 100 sends every token there)
    "balanced": (0.0, 0.0),
    "all_to_two_experts": (0.0, 100.0),
    "capacity": (0.75, 0.0),
}
CPU_SKIP = "ragged path lowered only: XLA:CPU does not implement ragged_all_to_all"
RUN_SECONDS = {"small": 4.0, "full": 15.0}  # one comparison: compile both, run, time


def make_config(small: bool, dtype: str, devices: int) -> Config:
    if 8 % devices:
        raise SystemExit(f"needs a device count dividing 8 (experts, batch); got {devices}")
    dim, heads, head_dim, width, seq = (64, 4, 16, 64, 64) if small else (256, 8, 32, 512, 512)
    return Config(
        model=ModelConfig(
            num_layers=2,
            embed_dim=dim,
            num_heads=heads,
            num_kv_heads=2,
            head_dim=head_dim,
            mlp_dim=2 * width,
            dtype=dtype,
        ),
        # the GPU path's kernel, named so that a CPU dry run compiles it too
        moe=MoEConfig(num_experts=8, top_k=2, expert_mlp_dim=width, impl="ragged_dot"),
        train=TrainConfig(batch_size=8, seq_len=seq),
        parallel=ParallelConfig(attention="dp", experts="ep_a2a", intra=devices, data=1),
    )


def model_step(config: Config, layout):
    """Jitted forward+backward of the model and its arguments, placed for `layout`."""
    model = Transformer(config.model, config.moe, rngs=nnx.Rngs(0), layout=layout)
    graphdef, params, biases = nnx.split(model, nnx.Param, RouterBias)
    grad = jax.value_and_grad(lambda p, b, batch: loss_fn(p, b, graphdef, batch, config)[0])
    tokens = np.random.default_rng(0).integers(
        0, config.model.vocab_size, (config.train.batch_size, config.train.seq_len + 1)
    )
    batch = {"inputs": tokens[:, :-1].astype(np.int32), "targets": tokens[:, 1:].astype(np.int32)}
    if layout.mesh is not None:
        params = jax.device_put(params, mesh_lib.state_shardings(params, layout))
        biases = jax.device_put(biases, mesh_lib.state_shardings(biases, layout))
        batch = jax.device_put(batch, mesh_lib.batch_sharding(layout))
    return jax.jit(grad), (params, biases, batch)


def block_step(config: Config, layout, case: str, dtype: str):
    """Jitted forward+backward of the MoE block alone (params and input gradients)."""
    capacity_factor, skew = BLOCK_CASES[case]
    cfg = dataclasses.replace(config.moe, capacity_factor=capacity_factor)
    dim, experts, width = config.model.embed_dim, cfg.num_experts, cfg.expert_mlp_dim
    keys = jax.random.split(jax.random.key(0), 5)
    scale = lambda fan_in: 1.0 / np.sqrt(fan_in)
    params = MoEParams(
        router=jax.random.normal(keys[0], (dim, experts)) * scale(dim),
        bias=jnp.zeros(experts).at[:2].set(skew),
        experts=ExpertWeights(
            gate=(jax.random.normal(keys[1], (experts, dim, width)) * scale(dim)).astype(dtype),
            up=(jax.random.normal(keys[2], (experts, dim, width)) * scale(dim)).astype(dtype),
            down=(jax.random.normal(keys[3], (experts, width, dim)) * scale(width)).astype(dtype),
        ),
    )
    shape = (config.train.batch_size, config.train.seq_len, dim)
    x = jax.random.normal(keys[4], shape).astype(dtype)

    def loss(params, x):
        y, stats = layout.moe(moe_forward, x, params, cfg)
        return jnp.mean(jnp.square(y.astype(jnp.float32))) + 0.01 * stats.aux_loss()

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1))), (params, x)


def outputs(fn, args):
    """One call of the compiled program (the compilation `median_seconds` reuses)."""
    return fn.lower(*args).compile()(*args)


def max_rel_error(got, want) -> float:
    errors = [
        float(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)).max())
        / (float(jnp.abs(b.astype(jnp.float32)).max()) + 1e-30)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
    ]
    return max(errors)


def layouts(config: Config) -> dict:
    """The padded layout and the same layout with the ragged exchange."""
    padded = mesh_lib.make_layout(config, mesh_lib.make_mesh(config))
    return {"padded": padded, "ragged": dataclasses.replace(padded, expert_spec=EP_A2A_RAGGED)}


def tolerance(key: str) -> float:
    """Keys read '<what>/<dtype>/<comparison>'."""
    return TOLERANCE[key.split("/")[-2]]


def compare_and_time(ctx: Section, name: str, steps: dict, ragged_runs: bool, repeats: int):
    """Errors against the padded exchange and timings of every step in `steps`, recorded
    as they come; a ragged step that raises is a failure and keeps the padded numbers."""
    padded = outputs(*steps["padded"])
    if "single" in steps:
        error = max_rel_error(padded, outputs(*steps["single"]))
        _check(ctx, f"{name}/padded_vs_single", error)
    padded_s = median_seconds(*steps["padded"], repeats)
    ctx.record(f"{name}/padded_ms", round(padded_s * 1e3, 3), "timing")
    if not ragged_runs:
        steps["ragged"][0].lower(*steps["ragged"][1])
        return
    try:
        ragged = outputs(*steps["ragged"])
    except Exception as error:  # report it and carry on with the other cases
        ctx.fail(f"ragged {name} {raised(error)}")
        return
    _check(ctx, f"{name}/ragged_vs_padded", max_rel_error(ragged, padded))
    ragged_s = median_seconds(*steps["ragged"], repeats)
    ctx.record(f"{name}/ragged_ms", round(ragged_s * 1e3, 3), "timing")
    ctx.record(f"{name}/padded_over_ragged", round(padded_s / ragged_s, 3), "timing")


def _check(ctx: Section, key: str, error: float) -> None:
    ctx.record(key, error, "max_rel_error")
    if not error < tolerance(key):
        ctx.fail(f"{key}: {error:.2e} > {tolerance(key):.0e}")


def section(ctx: Section) -> None:
    """Section `ragged_exchange`: checks and times the ragged layout against the padded
    one, model first then the block cases, each as the budget allows."""
    devices = jax.device_count()
    ragged_runs = jax.default_backend() != "cpu"
    ctx.record("devices", devices)
    ctx.record("ragged", "ran" if ragged_runs else CPU_SKIP)
    repeats = 2 if ctx.small else 10
    need = RUN_SECONDS["small" if ctx.small else "full"]
    for dtype in DTYPES[:1] if ctx.small else DTYPES:  # a dry run: float32's code paths
        config = make_config(ctx.small, dtype, devices)
        kinds = layouts(config)
        runs = [(f"model/{dtype}", None)]
        runs += [(f"block/{case}/{dtype}", case) for case in BLOCK_CASES]
        for name, case in runs if dtype == "float32" else runs[:2]:
            if not ctx.time_for(need, name):
                continue
            if case is None:
                steps = {kind: model_step(config, layout) for kind, layout in kinds.items()}
                steps["single"] = model_step(config, SINGLE_DEVICE)
            else:
                steps = {
                    kind: block_step(config, layout, case, dtype) for kind, layout in kinds.items()
                }
            try:
                compare_and_time(ctx, name, steps, ragged_runs, repeats)
            except DoesNotFit as why:
                ctx.note(f"{name} not run: {why}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny sizes, for a dry run")
    parser.add_argument("--json", action="store_true", help="end with one JSON object")
    args = parser.parse_args()
    ctx = unbounded("ragged_exchange", args.small)
    section(ctx)
    report = {**ctx.results, "failures": ctx.failures, "ok": not ctx.failures}
    print(f"ok: {report['ok']}", flush=True)
    if args.json:
        print(json.dumps(report))


if __name__ == "__main__":
    main()
