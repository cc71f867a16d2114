"""Forward+backward speed of the MoE block per `moe.impl`, against a plain matmul baseline.

Fixed active compute (top-2, d=512, expert width 1024, 8192 tokens) while the
number of experts grows. Also times a GShard-style one-hot einsum dispatch
(capacity factor 1.25) and a dense SwiGLU over tokens*k rows, which has the
same useful FLOPs as the experts and no routing at all (`matmul_gflops`).
GFLOP/s count useful model FLOPs only: the experts' three matmuls for the k
chosen experts and the router, forward and backward (6 FLOPs per weight per
token), whatever the implementation really executes.

    python bench/moe_layer.py [--json] [--experts 8,32,64] [--tokens 8192] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import math

import jax
import jax.numpy as jnp
from flax import nnx
from timing import median_seconds

from moe_jax.config import MoEConfig
from moe_jax.moe.block import MoE, RouterBias
from moe_jax.moe.experts import resolve_impl
from moe_jax.moe.routing import route

DIM, WIDTH, TOP_K, CAPACITY = 512, 1024, 2, 1.25


def block_step(cfg: MoEConfig, tokens: int):
    """jitted grad of a scalar of the MoE block w.r.t. its input and parameters."""
    graphdef, params, biases = nnx.split(MoE(DIM, cfg, rngs=nnx.Rngs(0)), nnx.Param, RouterBias)
    x = jax.random.normal(jax.random.key(1), (tokens // 1024, 1024, DIM))

    def loss(params, x):
        y, _ = nnx.merge(graphdef, params, biases)(x)
        return jnp.mean(y * y)

    return jax.jit(jax.grad(loss, argnums=(0, 1))), (params, x)


def onehot_step(cfg: MoEConfig, tokens: int):
    """GShard-style dispatch: [T, E, C] one-hot masks contracted by einsum."""
    e = cfg.num_experts
    slots = math.ceil(CAPACITY * tokens * TOP_K / e)
    keys = jax.random.split(jax.random.key(0), 5)
    params = {
        "router": jax.random.normal(keys[0], (DIM, e)) / math.sqrt(DIM),
        "gate": jax.random.normal(keys[1], (e, DIM, WIDTH)) / math.sqrt(DIM),
        "up": jax.random.normal(keys[2], (e, DIM, WIDTH)) / math.sqrt(DIM),
        "down": jax.random.normal(keys[3], (e, WIDTH, DIM)) / math.sqrt(WIDTH),
    }
    x = jax.random.normal(keys[4], (tokens, DIM))

    def loss(params, x):
        r = route(x, params["router"], jnp.zeros(e), cfg)
        one_hot = jax.nn.one_hot(r.expert_index, e)  # [T, k, E]
        position = (jnp.cumsum(one_hot.reshape(-1, e), axis=0).reshape(one_hot.shape) - 1) * one_hot
        position = position.sum(-1).astype(jnp.int32)  # slot of each assignment in its expert
        keep = position < slots
        slot_hot = jax.nn.one_hot(jnp.where(keep, position, slots), slots)  # [T, k, C]
        dispatch = jnp.einsum("tke,tkc->tec", one_hot, slot_hot)
        combine = jnp.einsum("tk,tke,tkc->tec", r.weights * keep, one_hot, slot_hot)
        buckets = jnp.einsum("tec,td->ecd", dispatch, x)
        h = jax.nn.silu(jnp.einsum("ecd,edf->ecf", buckets, params["gate"]))
        h = h * jnp.einsum("ecd,edf->ecf", buckets, params["up"])
        y = jnp.einsum("tec,ecd->td", combine, jnp.einsum("ecf,efd->ecd", h, params["down"]))
        return jnp.mean(y * y)

    return jax.jit(jax.grad(loss, argnums=(0, 1))), (params, x)


def matmul_step(tokens: int):
    """Dense SwiGLU over tokens*k rows: the experts' useful FLOPs with no routing."""
    keys = jax.random.split(jax.random.key(0), 4)
    params = {
        "gate": jax.random.normal(keys[0], (DIM, WIDTH)) / math.sqrt(DIM),
        "up": jax.random.normal(keys[1], (DIM, WIDTH)) / math.sqrt(DIM),
        "down": jax.random.normal(keys[2], (WIDTH, DIM)) / math.sqrt(WIDTH),
    }
    x = jax.random.normal(keys[3], (tokens * TOP_K, DIM))

    def loss(params, x):
        h = jax.nn.silu(x @ params["gate"]) * (x @ params["up"])
        y = h @ params["down"]
        return jnp.mean(y * y)

    return jax.jit(jax.grad(loss, argnums=(0, 1))), (params, x)


def useful_flops(tokens: int, experts: int) -> float:
    return 6.0 * tokens * (TOP_K * 3 * DIM * WIDTH + DIM * experts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    parser.add_argument("--experts", default="8,32,64")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--impls", default="tiled,ragged_dot,capacity,dense,onehot")
    args = parser.parse_args()
    experts = [int(e) for e in args.experts.split(",")]
    impls = args.impls.split(",")
    base = MoEConfig(top_k=TOP_K, expert_mlp_dim=WIDTH, aux_loss_coef=0.0, z_loss_coef=0.0)

    matmul_fn, matmul_args = matmul_step(args.tokens)
    matmul_flops = 6.0 * args.tokens * TOP_K * 3 * DIM * WIDTH
    matmul_times = []

    results = {name: {"ms": [], "gflops": []} for name in impls}
    for e in experts:
        # The baseline is re-measured beside each expert count: this machine is noisy.
        matmul_times.append(median_seconds(matmul_fn, matmul_args, args.repeats))
        matmul_gflops = matmul_flops / matmul_times[-1] / 1e9
        print(f"E={e:3d} matmul     {matmul_times[-1] * 1e3:9.1f} ms {matmul_gflops:7.1f} GFLOP/s")
        for name in impls:
            if name == "onehot":
                fn, fn_args = onehot_step(
                    MoEConfig(**{**base.__dict__, "num_experts": e}), args.tokens
                )
            else:
                cf = CAPACITY if name == "capacity" else 0.0
                cfg = MoEConfig(
                    **{**base.__dict__, "num_experts": e, "impl": name, "capacity_factor": cf}
                )
                fn, fn_args = block_step(cfg, args.tokens)
            # These do many times the useful work (ragged_dot lowers densely on CPU).
            slow = name in ("dense", "onehot") or (name == "ragged_dot" and e > 8)
            seconds = median_seconds(fn, fn_args, 1 if slow else args.repeats)
            gflops = useful_flops(args.tokens, e) / seconds / 1e9
            results[name]["ms"].append(round(seconds * 1e3, 2))
            results[name]["gflops"].append(round(gflops, 2))
            ratio = gflops / matmul_gflops
            print(
                f"E={e:3d} {name:10s} {seconds * 1e3:9.1f} ms {gflops:7.1f} GFLOP/s "
                f"({ratio:.2f} of matmul)",
                flush=True,
            )

    matmul_gflops = matmul_flops / sorted(matmul_times)[len(matmul_times) // 2] / 1e9
    default = resolve_impl(base)
    summary = {
        "E": experts,
        "default": default,
        "impls": results,
        "matmul_gflops": round(matmul_gflops, 2),
    }
    if args.json:
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
