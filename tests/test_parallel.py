"""Parallel layouts on 8 forced CPU devices: equal to one device, and the compiled
program holds the collectives the layout promises."""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import numpy as np
import pytest
from flax import nnx

from moe_jax.config import Config, ModelConfig, MoEConfig, ParallelConfig, TrainConfig
from moe_jax.model.transformer import Transformer
from moe_jax.moe.block import RouterBias
from moe_jax.parallel import mesh as mesh_lib
from moe_jax.plan.resolve import check_plan, resolve
from moe_jax.tools import hlo_collectives
from moe_jax.train_step import loss_fn

BASE = Config(
    model=ModelConfig(
        num_layers=2, first_k_dense=0, embed_dim=32, num_heads=8, num_kv_heads=2, head_dim=8
    ),
    moe=MoEConfig(num_experts=8, top_k=2, expert_mlp_dim=16, aux_loss_coef=0.1, z_loss_coef=0.01),
    train=TrainConfig(batch_size=8, seq_len=16),
)


# Halves XLA:CPU compile time; these tests check numbers and collectives, not speed.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def _with_plan(attention: str, data: int, intra: int, experts: str = "ep_ag") -> Config:
    plan = ParallelConfig(attention=attention, experts=experts, intra=intra, data=data)
    return dataclasses.replace(BASE, parallel=plan)


def _batch() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, BASE.model.vocab_size, (8, 17)).astype(np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def _loss_and_grads(config: Config, layout=None):
    kwargs = {} if layout is None else {"layout": layout}
    model = Transformer(config.model, config.moe, rngs=nnx.Rngs(0), **kwargs)
    graphdef, params, biases = nnx.split(model, nnx.Param, RouterBias)
    batch = _batch()
    grad_fn = jax.value_and_grad(partial(loss_fn, graphdef=graphdef, config=config), has_aux=True)
    fn = jax.jit(lambda params, biases, batch: grad_fn(params, biases, batch=batch))
    if layout is not None:
        params = jax.device_put(params, mesh_lib.state_shardings(params, layout))
        biases = jax.device_put(biases, mesh_lib.state_shardings(biases, layout))
        sharding = mesh_lib.batch_sharding(layout)
        batch = {k: jax.device_put(v, sharding) for k, v in batch.items()}
    compiled = fn.lower(params, biases, batch).compile(compiler_options=FAST_COMPILE)
    (loss, metrics), grads = compiled(params, biases, batch)
    return loss, metrics, grads, compiled.as_text()


@pytest.fixture(scope="module")
def single_device():
    return _loss_and_grads(BASE)


MESHES = [(2, 4), (1, 8)]
ATTENTION = ("dp", "fsdp", "tp", "sp")
EXPERTS = ("ep_ag", "ep_a2a", "etp", "ep_etp")
PLANS = [(a, e, d, n) for a in ATTENTION for e in EXPERTS for d, n in MESHES]


@pytest.mark.parametrize("attention,experts,data,intra", PLANS)
def test_layout_matches_single_device(
    single_device, attention: str, experts: str, data: int, intra: int
):
    config = _with_plan(attention, data, intra, experts)
    config = check_plan(config, jax.device_count())
    mesh = mesh_lib.make_mesh(config)
    loss, metrics, grads, _ = _loss_and_grads(config, mesh_lib.make_layout(config, mesh))
    ref_loss, ref_metrics, ref_grads, _ = single_device
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for key in ("lm_loss", "aux_loss", "seq_aux_loss", "z_loss"):
        np.testing.assert_allclose(metrics[key], ref_metrics[key], rtol=1e-5, err_msg=key)
    np.testing.assert_array_equal(metrics["load"], ref_metrics["load"])
    flat, ref_flat = jax.tree.leaves_with_path(grads), jax.tree.leaves_with_path(ref_grads)
    for (path, got), (_, want) in zip(flat, ref_flat, strict=True):
        scale = float(np.abs(want).max())
        np.testing.assert_allclose(
            got, want, rtol=1e-5, atol=1e-5 * scale, err_msg=jax.tree_util.keystr(path)
        )


def _program(attention: str, experts: str) -> str:
    config = _with_plan(attention, 2, 4, experts)
    layout = mesh_lib.make_layout(config, mesh_lib.make_mesh(config))
    return _loss_and_grads(config, layout)[3]


def _exchanges(hlo: str, block: str) -> dict[str, list]:
    """Token-exchange collectives of one block kind ('attention' or 'moe') by kind."""
    found: dict[str, list] = {}
    for c in hlo_collectives.parse(hlo):
        if c.role == "activation" and f"/{block}/" in c.op_name and c.tag == "token_exchange":
            found.setdefault(c.kind, []).append(c)
    return found


def test_compiled_collectives_follow_the_plan():
    """Each layout compiles to the collectives it promises, in the block it promises."""
    programs = {
        plan: _program(*plan)
        for plan in [("sp", "ep_ag"), ("tp", "ep_a2a"), ("dp", "etp"), ("fsdp", "ep_etp")]
    }
    sp_attention = _exchanges(programs["sp", "ep_ag"], "attention")
    assert set(sp_attention) == {"all-to-all"}  # no activation all-gather inside attention
    # Ulysses, per layer: q, k, v to head shards and the output back, forward and
    # backward; per device [b, s/n, heads, head_dim] float32 with b=4 (of 8, data=2),
    # s/n=4 (n=4), 8 query heads and 2 kv heads repeated up to n; 3/4 of it leaves.
    sizes = sorted({c.bytes * 4 // 3 for c in sp_attention["all-to-all"]})
    assert sizes == [4 * 4 * 4 * 8 * 4, 4 * 4 * 8 * 8 * 4]
    assert sum(c.count for c in sp_attention["all-to-all"]) == 2 * 4 * BASE.model.num_layers
    ep_ag = _exchanges(programs["sp", "ep_ag"], "moe")
    assert set(ep_ag) == {"all-gather", "reduce-scatter"}
    assert set(_exchanges(programs["dp", "etp"], "moe")) == {"all-gather", "reduce-scatter"}
    assert set(_exchanges(programs["fsdp", "ep_etp"], "moe")) == {"all-gather", "reduce-scatter"}
    tp_a2a = programs["tp", "ep_a2a"]
    assert set(_exchanges(tp_a2a, "moe")) == {"all-to-all"}
    assert set(_exchanges(tp_a2a, "attention")) == {"all-gather", "reduce-scatter"}
    assert set(_exchanges(programs["dp", "etp"], "attention")) == set()
    # fsdp gathers weights (parameter traffic) inside attention, never tokens.
    fsdp_attention = [
        c for c in hlo_collectives.parse(programs["fsdp", "ep_etp"]) if "/attention/" in c.op_name
    ]
    assert {c.kind for c in fsdp_attention if c.pass_ == "forward"} == {"all-gather"}
    assert all(c.role == "param_grad" for c in fsdp_attention)


@pytest.mark.parametrize(
    "changes,setting",
    [
        ({"parallel": ParallelConfig(intra=4, data=1)}, "8 devices"),
        ({"parallel": ParallelConfig(intra=8), "moe": MoEConfig(num_experts=4)}, "moe.num_experts"),
        (
            {"parallel": ParallelConfig(attention="sp", intra=8), "train": TrainConfig(seq_len=12)},
            "train.seq_len",
        ),
        (
            {
                "parallel": ParallelConfig(attention="sp", intra=8),
                "model": dataclasses.replace(BASE.model, num_heads=4, num_kv_heads=2),
            },
            "model.num_heads",
        ),
        (
            {"parallel": ParallelConfig(intra=8), "train": TrainConfig(batch_size=4)},
            "train.batch_size",
        ),
        (
            {
                "parallel": ParallelConfig(attention="tp", intra=8),
                "model": dataclasses.replace(BASE.model, num_heads=4, num_kv_heads=2),
            },
            "model.num_heads",
        ),
        (
            {
                "parallel": ParallelConfig(attention="fsdp", intra=2, data=4),
                "model": dataclasses.replace(BASE.model, num_kv_heads=2),
            },
            "model.num_kv_heads",
        ),
        (
            {
                "parallel": ParallelConfig(experts="etp", intra=8),
                "moe": dataclasses.replace(BASE.moe, expert_mlp_dim=12),
            },
            "moe.expert_mlp_dim",
        ),
        ({"parallel": ParallelConfig(experts="ep_etp", intra=8, etp=3)}, "parallel.etp"),
        ({"parallel": ParallelConfig(experts="ep_a2a_ragged", intra=8)}, "needs a GPU"),
    ],
)
def test_plans_that_do_not_fit_are_rejected(changes: dict, setting: str):
    config = dataclasses.replace(BASE, **changes)
    with pytest.raises(ValueError, match=setting) as error:
        check_plan(config, 8)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    "attention,experts,data,intra",
    [("dp", "ep_ag", 0, 8), ("sp", "ep_a2a", 2, 4), ("tp", "etp", 2, 4), ("fsdp", "ep_etp", 2, 4)],
)
def test_trainer_runs_each_layout(tmp_path, attention: str, experts: str, data: int, intra: int):
    """A few real training steps per layout on the 8 test devices; the plan is logged."""
    from moe_jax import trainer
    from moe_jax.config import DataConfig
    from moe_jax.metrics import read_rows

    config = dataclasses.replace(
        _with_plan(attention, data, intra, experts),
        train=TrainConfig(batch_size=8, seq_len=16, steps=3, log_every=1, eval_batches=1),
        data=DataConfig(source="synthetic"),
    )
    trainer.run(config, tmp_path)
    rows = [r for r in read_rows(tmp_path / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(np.isfinite(r["loss"]) for r in rows)
    assert rows[-1]["plan_attention"] == attention
    assert rows[-1]["plan_experts"] == experts
    assert (rows[-1]["plan_data"], rows[-1]["plan_intra"]) == (8 // intra, intra)


@pytest.mark.parametrize(
    "top_k,intra,expected", [(2, 8, "ep_a2a"), (7, 8, "ep_ag"), (4, 4, "ep_ag")]
)
def test_auto_expert_layout_follows_the_papers_rule(top_k: int, intra: int, expected: str):
    """All-gather once top_k / n exceeds 0.75 (Mixtral-8x7B, n=8: faster for top-k > 6)."""
    config = dataclasses.replace(
        BASE,
        moe=dataclasses.replace(BASE.moe, top_k=top_k),
        parallel=ParallelConfig(experts="auto", intra=intra),
    )
    resolved = resolve(config, 8)
    assert resolved.parallel.experts == expected
    assert resolved.parallel.data == 8 // intra


def _three_steps(config: Config, layout=None):
    from moe_jax.train_step import init_state, train_step

    kwargs = {} if layout is None else {"layout": layout}
    graphdef, state = init_state(config, **kwargs)
    batch = _batch()
    shardings = {}
    if layout is not None:
        state_sharding = mesh_lib.train_state_shardings(state, layout, config.parallel.zero)
        state = jax.device_put(state, state_sharding)
        sharding = mesh_lib.batch_sharding(layout)
        batch = {k: jax.device_put(v, sharding) for k, v in batch.items()}
        shardings = {
            "in_shardings": (state_sharding, sharding),
            "out_shardings": (state_sharding, None),
        }
    step = jax.jit(partial(train_step, graphdef, config), donate_argnums=0, **shardings)
    step = step.lower(state, batch).compile(compiler_options=FAST_COMPILE)
    for _ in range(3):
        state, _ = step(state, batch)
    return state


SINGLE = dataclasses.replace(BASE, moe=dataclasses.replace(BASE.moe, bias_update_rate=1e-3))


@pytest.fixture(scope="module")
def three_single_device_steps():
    return _three_steps(SINGLE)


STEP_PLANS = [(a, e, 2, 4, 0) for a in ATTENTION for e in EXPERTS]
STEP_PLANS += [("sp", "ep_a2a", 1, 8, 0), ("tp", "etp", 1, 8, 0), ("dp", "ep_ag", 2, 4, 1)]


@pytest.mark.parametrize("attention,experts,data,intra,zero", STEP_PLANS)
def test_three_optimizer_steps_match_single_device(
    three_single_device_steps, attention, experts, data, intra, zero
):
    """Params and router biases (sign-rule updates included) after three AdamW steps."""
    plan = dataclasses.replace(_with_plan(attention, data, intra, experts).parallel, zero=zero)
    config = dataclasses.replace(SINGLE, parallel=plan)
    layout = mesh_lib.make_layout(config, mesh_lib.make_mesh(config))
    got, want = _three_steps(config, layout), three_single_device_steps
    pairs = zip(
        jax.tree.leaves_with_path((want.params, want.biases)),
        jax.tree.leaves((got.params, got.biases)),
        strict=True,
    )
    for (path, expected), actual in pairs:
        scale = float(np.abs(expected).max())
        np.testing.assert_allclose(
            actual, expected, rtol=1e-5, atol=1e-5 * scale, err_msg=jax.tree_util.keystr(path)
        )
    if zero:  # each data group keeps half of every optimizer moment
        for moment in jax.tree.leaves(got.opt_state):
            if moment.ndim and moment.size > 1:
                shard = moment.addressable_shards[0].data
                assert shard.size * data <= moment.size, moment.sharding


def test_trainer_takes_the_planners_layout(tmp_path, capsys):
    """`parallel.layout='auto'`: the planner's choice for these 8 devices is applied,
    printed, logged, and runs."""
    from moe_jax import trainer
    from moe_jax.config import DataConfig
    from moe_jax.metrics import read_rows
    from moe_jax.plan.planner import choose_plan

    config = dataclasses.replace(
        BASE,
        parallel=ParallelConfig(layout="auto"),
        train=TrainConfig(batch_size=8, seq_len=16, steps=2, log_every=1, eval_batches=1),
        data=DataConfig(source="synthetic"),
    )
    chosen = choose_plan(config, 8, "h800")
    trainer.run(config, tmp_path)
    row = [r for r in read_rows(tmp_path / "metrics.jsonl") if "loss" in r][-1]
    assert {k: row[f"plan_{k}"] for k in chosen} == chosen
    assert row["plan_data"] * row["plan_intra"] == 8
    assert f"planner chose attention={chosen['attention']}" in capsys.readouterr().out
