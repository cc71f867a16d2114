"""Parallel layouts on 8 forced CPU devices: equal to one device, and the compiled
program holds the collectives the layout promises.

Every plan's training step is compiled once per session (`tests/layouts.py`): the
first step's metrics and gradients, the parameters after three AdamW steps and the
collective guards all come from that one program.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from moe_jax.config import MoEConfig, ParallelConfig, TrainConfig
from moe_jax.plan.resolve import check_plan, resolve
from moe_jax.tools import hlo_collectives
from tests import layouts
from tests.layouts import BASE, assert_trees_close, planned, reference, with_plan

MESHES = [(2, 4), (1, 8)]
ATTENTION = ("dp", "fsdp", "tp", "sp")
EXPERTS = ("ep_ag", "ep_a2a", "etp", "ep_etp")
# Every attention layout with every expert layout, each pair on one of the two meshes:
# each attention layout and each expert layout on both (two pairs each), the blocks'
# layouts being separate. These take (data, intra) = (2, 4); the other eight (1, 8).
ON_TWO_BY_FOUR = {
    ("dp", "ep_ag"), ("dp", "etp"), ("fsdp", "ep_a2a"), ("fsdp", "ep_etp"),
    ("tp", "ep_a2a"), ("tp", "ep_etp"), ("sp", "ep_ag"), ("sp", "etp"),
}  # fmt: skip
PLANS = [(a, e, *MESHES[(a, e) not in ON_TWO_BY_FOUR]) for a in ATTENTION for e in EXPERTS]


def _assert_first_step_matches(got: layouts.Run, want: layouts.Run, rtol=1e-5) -> None:
    for key in ("loss", "lm_loss", "aux_loss", "seq_aux_loss", "z_loss"):
        np.testing.assert_allclose(got.metrics[key], want.metrics[key], rtol=rtol, err_msg=key)
    np.testing.assert_array_equal(got.metrics["load"], want.metrics["load"])
    assert_trees_close(got.grads, want.grads, rtol)


@pytest.mark.parametrize("attention,experts,data,intra", PLANS)
def test_layout_matches_single_device(attention: str, experts: str, data: int, intra: int):
    config = with_plan(attention, data, intra, experts)
    _assert_first_step_matches(planned(config), reference(BASE))


def _program(attention: str, experts: str) -> str:
    return planned(with_plan(attention, 2, 4, experts)).hlo


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
    [("dp", "ep_ag", 0, 8), ("fsdp", "ep_etp", 2, 4)],
)
def test_trainer_runs_each_layout(tmp_path, attention: str, experts: str, data: int, intra: int):
    """A few real training steps on the 8 test devices, the plan logged: with the data
    groups derived (data=0), and with fsdp's state split over data. (Every layout's step
    is the trainer's `train_step`, checked against one device above; sp and tp train
    from the command line in tests/test_launch.py and tests/test_slurm.py.)"""
    from moe_jax import trainer
    from moe_jax.config import DataConfig
    from moe_jax.metrics import read_rows

    config = dataclasses.replace(
        with_plan(attention, data, intra, experts),
        train=TrainConfig(batch_size=8, seq_len=16, steps=3, log_every=1, eval_batches=1),
        data=DataConfig(source="synthetic"),
    )
    trainer.run(config, tmp_path)
    rows = [r for r in read_rows(tmp_path / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(np.isfinite(r["loss"]) for r in rows)
    assert rows[0]["plan_attention"] == attention  # the first row carries the plan
    assert rows[0]["plan_experts"] == experts
    assert (rows[0]["plan_data"], rows[0]["plan_intra"]) == (8 // intra, intra)
    assert not [k for k in rows[-1] if k.startswith("plan_")]  # not repeated on every line


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


STEP_PLANS = [(*plan, 0) for plan in PLANS]
STEP_PLANS += [("dp", "ep_ag", 2, 4, 1)]


@pytest.mark.parametrize("attention,experts,data,intra,zero", STEP_PLANS)
def test_three_optimizer_steps_match_single_device(attention, experts, data, intra, zero):
    """Params and router biases (sign-rule updates included) after three AdamW steps."""
    got = planned(with_plan(attention, data, intra, experts, zero=zero)).state
    want = reference(BASE).state
    assert_trees_close((got.params, got.biases), (want.params, want.biases))
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
    chosen = dataclasses.asdict(choose_plan(config, 8, "h800"))
    trainer.run(config, tmp_path)
    row = next(r for r in read_rows(tmp_path / "metrics.jsonl") if "loss" in r)
    assert {k: row[f"plan_{k}"] for k in chosen} == chosen
    assert row["plan_data"] * row["plan_intra"] == 8
    assert f"planner chose attention={chosen['attention']}" in capsys.readouterr().out
