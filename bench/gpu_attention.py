"""GPU checks of the attention cores and of remat='offload' (part 4 of `gpu_check.py`).

XLA:CPU runs neither cuDNN's flash attention nor pinned-host offloading, so these run
only where a GPU is: each core's output and gradients against float32 `xla` attention,
their time at a Mixtral-like shape as a ratio to `xla` measured in the same run, and one
model step with `offload` against `selective` (the same numbers, kept tensors on host).
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
from timing import median_seconds

from moe_jax.config import Config, ModelConfig, MoEConfig, TrainConfig
from moe_jax.kernels.attention import FUNCTIONS
from moe_jax.train_state import init_state
from moe_jax.train_step import loss_fn

GPU = jax.default_backend() == "gpu"


def _grads(core, q, k, v):
    loss = lambda q, k, v: jnp.mean(jnp.square(core(q, k, v).astype(jnp.float32)))
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def check_cores(small: bool) -> dict:
    b, s, heads, kv, d = (1, 256, 8, 2, 64) if small else (2, 4096, 32, 8, 128)
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (
        jax.random.normal(key, (b, s, h, d)) for key, h in zip(keys, (heads, kv, kv), strict=True)
    )
    reference = _grads(FUNCTIONS["xla"], q, k, v)(q, k, v)
    out = {}
    names = ("xla", "blockwise", "cudnn") if GPU else ("xla", "blockwise")
    for name in names:
        args = tuple(t.astype(jnp.bfloat16) for t in (q, k, v))
        fn = _grads(FUNCTIONS[name], *args)
        got = fn(*args)
        errors = [
            float(jnp.abs(a.astype(jnp.float32) - r).max() / (jnp.abs(r).max() + 1e-30))
            for a, r in zip(jax.tree.leaves(got), jax.tree.leaves(reference), strict=True)
        ]
        out[f"{name}/bf16_max_rel_error"] = max(errors)
        out[f"{name}/bf16_ms"] = round(median_seconds(fn, args, 3 if small else 10) * 1e3, 3)
    for name in names[1:]:
        out[f"{name}/vs_xla"] = round(out["xla/bf16_ms"] / out[f"{name}/bf16_ms"], 3)
    fn = _grads(FUNCTIONS["blockwise"], q, k, v)
    errors = [
        float(jnp.abs(a - r).max() / (jnp.abs(r).max() + 1e-30))
        for a, r in zip(jax.tree.leaves(fn(q, k, v)), jax.tree.leaves(reference), strict=True)
    ]
    out["blockwise/f32_max_rel_error"] = max(errors)
    return out


def check_offload(small: bool) -> dict:
    """One loss and gradient with remat='offload' against 'selective' (bfloat16)."""
    model = ModelConfig(
        num_layers=2,
        embed_dim=256 if small else 1024,
        num_heads=8,
        num_kv_heads=2,
        head_dim=32 if small else 128,
        dtype="bfloat16",
    )
    base = Config(
        model=model,
        moe=MoEConfig(num_experts=8, top_k=2, expert_mlp_dim=512),
        train=TrainConfig(batch_size=2, seq_len=256 if small else 2048),
    )
    tokens = jax.random.randint(jax.random.key(0), (2, base.train.seq_len), 0, model.vocab_size)
    batch = {"inputs": tokens, "targets": tokens}
    results = {}
    for remat in ("selective", "offload"):
        config = dataclasses.replace(base, model=dataclasses.replace(model, remat=remat))
        graphdef, state = init_state(config)
        fn = jax.jit(
            jax.value_and_grad(partial(loss_fn, graphdef=graphdef, config=config), has_aux=True)
        )
        (loss, _), grads = fn(state.params, state.biases, batch=batch)
        results[remat] = (float(loss), jax.tree.leaves(grads))
    loss_s, grads_s = results["selective"]
    loss_o, grads_o = results["offload"]
    worst = max(
        float(jnp.abs(a - b).max() / (jnp.abs(b).max() + 1e-30))
        for a, b in zip(grads_o, grads_s, strict=True)
    )
    return {"loss_selective": loss_s, "loss_offload": loss_o, "grad_max_rel_error": worst}


def run(small: bool) -> dict:
    """Where no GPU is (a dry run), cuDNN and offloading are left out."""
    report = {"cores": check_cores(small), "offload": check_offload(small) if GPU else {}}
    for key, value in {**report["cores"], **report["offload"]}.items():
        print(f"attention {key}: {value}", flush=True)
    cores = report["cores"]
    report["ok"] = cores["blockwise/f32_max_rel_error"] < 1e-4 and (
        not GPU
        or (
            cores["cudnn/bf16_max_rel_error"] < 5e-2
            and report["offload"]["grad_max_rel_error"] < 1e-3
        )
    )
    return report
