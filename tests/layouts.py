"""Each plan's training step, compiled once per test session and run three times.

Layout tests draw every assertion from one `Run` per (config, plan): the metrics
and gradients of the first step, the parameters after three AdamW steps, and the
compiled and lowered programs. The single-device references are cached the same
way, so every test module that compares against one shares it.
"""

from __future__ import annotations

import dataclasses
import functools
from functools import partial
from typing import Any

import jax
import numpy as np
from flax import nnx

from moe_jax.config import Config, ModelConfig, MoEConfig, ParallelConfig, TrainConfig
from moe_jax.model.transformer import Transformer
from moe_jax.moe.block import RouterBias
from moe_jax.optimizer import rates
from moe_jax.parallel import mesh as mesh_lib
from moe_jax.parallel.layout import SINGLE_DEVICE
from moe_jax.plan.resolve import check_plan
from moe_jax.train_state import init_state
from moe_jax.train_step import RATE, apply_gradients, gradients, loss_fn, step_shardings

BASE = Config(
    model=ModelConfig(
        num_layers=2, first_k_dense=0, embed_dim=32, num_heads=8, num_kv_heads=2, head_dim=8
    ),
    moe=MoEConfig(
        num_experts=8,
        top_k=2,
        expert_mlp_dim=16,
        aux_loss_coef=0.1,
        z_loss_coef=0.01,
        bias_update_rate=1e-3,
    ),
    train=TrainConfig(batch_size=8, seq_len=16),
)
# BASE with a dense first layer (model.mlp_dim) and a shared expert in every MoE layer,
# so that every kind of weight is placed and tp's MLP ring runs too.
DENSE = dataclasses.replace(
    BASE,
    model=dataclasses.replace(BASE.model, num_layers=3, first_k_dense=1, mlp_dim=32),
    moe=dataclasses.replace(BASE.moe, num_shared_experts=1, shared_mlp_dim=16),
)


def on_ragged_dot(config: Config) -> Config:
    """`config` with its experts multiplied by `ragged_dot`, the GPU path's kernel. The
    tests whose subject is not the expert kernel use it: what moves between devices
    (rings, FP8 tokens, bf16 gradients), the pipeline's schedules, MLA, MTP, sharded
    embeddings and experts, the imported families' features. The kernel changes none
    of those, and XLA:CPU compiles it a third faster than `tiled`'s loop per run of
    tiles (slower to run, at these sizes nothing). The layout matrix, the memory tests
    of a layer's own activations and the trainer keep `tiled`, the CPU path."""
    return dataclasses.replace(config, moe=dataclasses.replace(config.moe, impl="ragged_dot"))


# The model whose traffic `tests/test_comm_report.py` and test_plan_memory.py's parameter
# traffic read (one config: the session's compilation cache shares their programs): BASE
# without its auxiliary losses, the experts on `ragged_dot` (what crosses devices is no
# kernel's).
TRAFFIC = on_ragged_dot(
    dataclasses.replace(BASE, moe=MoEConfig(num_experts=8, top_k=2, expert_mlp_dim=16))
)


# Multi-head latent attention (model.attention='mla'): a query latent, values narrower
# than queries and keys (5 vs 6 + 4), every head its own key and value.
MLA_MODEL = dict(
    attention="mla",
    num_kv_heads=8,
    q_lora_rank=12,
    kv_lora_rank=10,
    qk_nope_head_dim=6,
    qk_rope_head_dim=4,
    v_head_dim=5,
)
# BASE with MLA; its experts run ragged_dot (`on_ragged_dot`): attention is what its
# tests are about.
MLA = on_ragged_dot(dataclasses.replace(BASE, model=dataclasses.replace(BASE.model, **MLA_MODEL)))


# Halves XLA:CPU compile time; these tests check numbers and collectives, not speed.
FAST_COMPILE = {"xla_backend_optimization_level": 0}
STEPS = 3


def with_plan(
    attention: str, data: int, intra: int, experts: str = "ep_ag", base: Config = BASE, zero=0
) -> Config:
    plan = ParallelConfig(attention=attention, experts=experts, intra=intra, data=data, zero=zero)
    return dataclasses.replace(base, parallel=plan)


def batch(config: Config = BASE) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    b, s = config.train.batch_size, config.train.seq_len
    tokens = rng.integers(0, config.model.vocab_size, (b, s + 1)).astype(np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def step_and_grads(graphdef, config: Config, state, batch, lr):
    """The trainer's step (`gradients` then `apply_gradients`), also returning the
    gradients it applied."""
    metrics, grads = gradients(state, graphdef, batch, config)
    layout = nnx.merge(graphdef, state.params, state.biases).layout
    state, metrics = apply_gradients(config, state, metrics, grads, lr, layout)
    return state, metrics, grads


@dataclasses.dataclass(frozen=True)
class Run:
    config: Config
    metrics: dict[str, Any]  # of the first step, on the host
    grads: Any  # of the first step, on the host
    state: Any  # after STEPS steps, as placed on the devices
    hlo: str  # the compiled step
    lowered: str  # the step before XLA's optimisations (StableHLO, original dtypes)


def compile_under(config: Config, layout):
    """`config`'s step compiled under `layout`, its lowered form, and the placed state
    and batch it runs on."""
    graphdef, state = init_state(config, layout)
    inputs = batch(config)
    shardings = {}
    if layout.mesh is not None:
        state_sharding = mesh_lib.train_state_shardings(state, layout, config.parallel.zero)
        state = jax.device_put(state, state_sharding)
        sharding = mesh_lib.batch_sharding(layout)
        inputs = {k: jax.device_put(v, sharding) for k, v in inputs.items()}
        shardings = {
            "in_shardings": step_shardings(state_sharding, sharding),
            "out_shardings": (state_sharding, None, None),
        }
    step = jax.jit(partial(step_and_grads, graphdef, config), donate_argnums=0, **shardings)
    lowered = step.lower(state, inputs, RATE)
    return lowered.compile(compiler_options=FAST_COMPILE), lowered, state, inputs


def run_under(config: Config, layout) -> Run:
    """`config`'s step under `layout` (built by `planned`, or by hand)."""
    compiled, lowered, state, inputs = compile_under(config, layout)
    lr, *more = rates(config.train, 0, STEPS)
    state, metrics, grads = compiled(state, inputs, lr)
    first = jax.device_get((metrics, grads))
    for lr in more:
        state, _, _ = compiled(state, inputs, lr)
    return Run(config, *first, state, compiled.as_text(), lowered.as_text(debug_info=True))


@functools.cache
def reference(config: Config) -> Run:
    """`config` on one device (its parallel settings ignored)."""
    return run_under(config, SINGLE_DEVICE)


def planned_layout(config: Config):
    """`config` resolved for the 8 test devices, and its layout."""
    config = check_plan(config, jax.device_count())
    return config, mesh_lib.make_layout(config, mesh_lib.make_mesh(config))


def planned_program(config: Config) -> str:
    """The compiled step of `planned(config)`, not run."""
    return compile_under(*planned_layout(config))[0].as_text()


@functools.cache
def planned(config: Config) -> Run:
    """`config` under its plan on the 8 test devices."""
    return run_under(*planned_layout(config))


def assert_trees_close(got, want, rtol: float = 1e-5, atol_scale: float | None = None) -> None:
    """Leaf by leaf, within `rtol` and an absolute `atol_scale` (default `rtol`) times the
    leaf's largest value."""
    pairs = zip(jax.tree.leaves_with_path(want), jax.tree.leaves(got), strict=True)
    for (path, expected), actual in pairs:
        expected, actual = np.asarray(expected, np.float64), np.asarray(actual, np.float64)
        scale = float(np.abs(expected).max())
        atol = (rtol if atol_scale is None else atol_scale) * scale
        np.testing.assert_allclose(
            actual, expected, rtol=rtol, atol=atol, err_msg=jax.tree_util.keystr(path)
        )


def assert_leaves_close_in_norm(got, want, rtol: float) -> None:
    """Each leaf within `rtol` of its reference in norm (||got - want|| <= rtol ||want||),
    for forms that sum in another order (or round) where terms cancel elementwise."""
    pairs = zip(jax.tree.leaves_with_path(want), jax.tree.leaves(got), strict=True)
    for (path, expected), actual in pairs:
        expected, actual = np.asarray(expected, np.float64), np.asarray(actual, np.float64)
        error = np.linalg.norm(actual - expected) / np.linalg.norm(expected)
        assert error <= rtol, f"{jax.tree_util.keystr(path)}: relative error {error:.2e}"


def loss_and_grads(config: Config, layout):
    """Loss, metrics and gradients of one forward + backward under `layout` (for layouts
    built by hand, e.g. with an emulated collective)."""
    model = Transformer(config.model, config.moe, rngs=nnx.Rngs(config.train.seed), layout=layout)
    graphdef, params, biases = nnx.split(model, nnx.Param, RouterBias)
    inputs = batch(config)
    grad_fn = jax.value_and_grad(partial(loss_fn, graphdef=graphdef, config=config), has_aux=True)
    params = jax.device_put(params, mesh_lib.state_shardings(params, layout))
    biases = jax.device_put(biases, mesh_lib.state_shardings(biases, layout))
    inputs = {k: jax.device_put(v, mesh_lib.batch_sharding(layout)) for k, v in inputs.items()}
    fn = jax.jit(lambda params, biases, batch: grad_fn(params, biases, batch=batch))
    (loss, metrics), grads = fn.lower(params, biases, inputs).compile(
        compiler_options=FAST_COMPILE
    )(params, biases, inputs)
    return loss, metrics, grads
