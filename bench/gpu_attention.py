"""GPU checks of the attention cores and of remat='offload' (sections
`attention_correctness` and `attention_timing` of `gpu_check.py`).

XLA:CPU runs neither cuDNN's flash attention nor pinned-host offloading, so these run
only where a GPU is: each core's output and gradients against float32 `xla` attention,
one model step with `offload` against `selective` (the same numbers, kept tensors on
host), and the cores' time at a Mixtral-like shape as a ratio to `xla` measured in
the same run.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import repo_root  # noqa: F401  (before moe_jax: this checkout on the path)
from gpu_session import Section, raised, timed

from moe_jax.config import Config, ModelConfig, MoEConfig, TrainConfig
from moe_jax.kernels.attention import FUNCTIONS
from moe_jax.train_state import init_state
from moe_jax.train_step import loss_fn

GPU = jax.default_backend() == "gpu"
TOLERANCE = {"bf16": 5e-2, "f32": 1e-4, "offload": 1e-3}  # worst |error| / max |reference|
ITEM_SECONDS = {"small": 2.0, "full": 10.0}  # one core's timing


def _grads(core):
    loss = lambda q, k, v: jnp.mean(jnp.square(core(q, k, v).astype(jnp.float32)))
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def _inputs(small: bool) -> tuple[jax.Array, ...]:
    b, s, heads, kv, d = (1, 256, 8, 2, 64) if small else (2, 4096, 32, 8, 128)
    keys = jax.random.split(jax.random.key(0), 3)
    return tuple(
        jax.random.normal(key, (b, s, h, d)) for key, h in zip(keys, (heads, kv, kv), strict=True)
    )


def _error(got, reference) -> float:
    return max(
        float(jnp.abs(a.astype(jnp.float32) - r).max() / (jnp.abs(r).max() + 1e-30))
        for a, r in zip(jax.tree.leaves(got), jax.tree.leaves(reference), strict=True)
    )


def core_names() -> tuple[str, ...]:
    return ("xla", "blockwise", "cudnn") if GPU else ("xla", "blockwise")


def check_cores(ctx: Section) -> None:
    """Each core in bfloat16 (and blockwise in float32) against float32 `xla`. The
    float32 products run at full float32 precision: by default XLA multiplies float32
    in TF32 on a GPU (10-bit mantissas), which the first H200 run measured as 7.3e-4,
    the rounding of TF32 rather than of the blockwise algorithm."""
    q, k, v = _inputs(ctx.small)
    with jax.default_matmul_precision("highest"):
        reference = _grads(FUNCTIONS["xla"])(q, k, v)
    bf16 = tuple(t.astype(jnp.bfloat16) for t in (q, k, v))
    runs = [(name, "bf16", bf16) for name in core_names()] + [("blockwise", "f32", (q, k, v))]
    for name, dtype, args in runs:
        precision = "highest" if dtype == "f32" else None
        try:
            with jax.default_matmul_precision(precision):
                error = _error(_grads(FUNCTIONS[name])(*args), reference)
        except Exception as caught:  # the other cores still run
            ctx.fail(f"{name}/{dtype} {raised(caught)}")
            continue
        ctx.record(f"{name}/{dtype}_max_rel_error", error, "cores")
        if not error < TOLERANCE[dtype]:
            ctx.fail(f"{name}/{dtype}: {error:.2e} > {TOLERANCE[dtype]:.0e}")


def check_offload(ctx: Section) -> None:
    """One loss and gradient with remat='offload' against 'selective' (bfloat16)."""
    model = ModelConfig(
        num_layers=2,
        embed_dim=256 if ctx.small else 1024,
        num_heads=8,
        num_kv_heads=2,
        head_dim=32 if ctx.small else 128,
        dtype="bfloat16",
    )
    base = Config(
        model=model,
        moe=MoEConfig(num_experts=8, top_k=2, expert_mlp_dim=512),
        train=TrainConfig(batch_size=2, seq_len=256 if ctx.small else 2048),
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
        ctx.record(f"loss_{remat}", float(loss), "offload")
    error = _error(results["offload"][1], results["selective"][1])
    ctx.record("grad_max_rel_error", error, "offload")
    if not error < TOLERANCE["offload"]:
        ctx.fail(f"offload gradients: {error:.2e} > {TOLERANCE['offload']:.0e}")


def correctness(ctx: Section) -> None:
    """Section `attention_correctness`; where no GPU is (a dry run), cuDNN and
    offloading are left out."""
    check_cores(ctx)
    if GPU:
        try:
            check_offload(ctx)
        except Exception as error:
            ctx.fail(f"offload {raised(error)}")
    else:
        ctx.note("cudnn and offload not run: no GPU")


def timing(ctx: Section) -> None:
    """Section `attention_timing`: forward+backward of each core in bfloat16, and its
    speed as a ratio to `xla`'s."""
    args = tuple(t.astype(jnp.bfloat16) for t in _inputs(ctx.small))
    ms = {}
    for name in core_names():
        if not ctx.time_for(ITEM_SECONDS["small" if ctx.small else "full"], name):
            continue
        seconds = timed(ctx, name, _grads(FUNCTIONS[name]), args, 3 if ctx.small else 10)
        if seconds is None:
            continue
        ms[name] = seconds * 1e3
        ctx.record(f"{name}/bf16_ms", round(ms[name], 3))
        if name != "xla" and "xla" in ms:
            ctx.record(f"{name}/vs_xla", round(ms["xla"] / ms[name], 3))
