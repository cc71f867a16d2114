"""The distributed optimizer (`parallel.zero=2`) on 8 forced CPU devices: the same step
as ZeRO stage 0 (loss, every gradient, the parameters after three AdamW steps; also
under a pipeline), each device holding 1/g of every float32 master and moment it shares
with g devices and reduce-scattering its gradients, a stacked weight's inside the layer
scan's backward beside GEMMs it can overlap; in a bfloat16 model the weights gathered in
bf16 and the bytes of the acceptance; the trainer and its checkpoints."""

from __future__ import annotations

import dataclasses
import runpy
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

from moe_jax import config as config_lib
from moe_jax import trainer
from moe_jax.checkpoint import Checkpointer
from moe_jax.config import DataConfig, ParallelConfig, TrainConfig
from moe_jax.metrics import read_rows
from moe_jax.parallel import mesh as mesh_lib
from moe_jax.parallel.grad_exchange import summed_axes
from moe_jax.parallel.scopes import GRAD_EXCHANGE, WEIGHT_GATHER
from moe_jax.plan import cost_model
from moe_jax.plan.hardware import get
from moe_jax.tools import comm_report, hlo_collectives, lowered_dtypes
from moe_jax.train_state import init_state
from tests.layouts import (
    BASE,
    FAST_COMPILE,
    assert_trees_close,
    on_ragged_dot,
    planned,
    with_plan,
)
from tests.test_pipeline import pipelined

ROOT = Path(__file__).resolve().parents[1]
# The optimizer is the subject, not the expert kernel (tests.layouts.on_ragged_dot).
BASE = on_ragged_dot(BASE)
PLANS = {"sp+ep_a2a": ("sp", "ep_a2a"), "tp+etp": ("tp", "etp")}


def _plan(name: str, zero: int, grad_accum: int = 1, **model):
    attention, experts = PLANS[name]
    train = dataclasses.replace(BASE.train, grad_accum=grad_accum)
    base = dataclasses.replace(BASE, train=train, model=dataclasses.replace(BASE.model, **model))
    return with_plan(attention, 2, 4, experts, base=base, zero=zero)


@pytest.mark.parametrize("grad_accum", [1, 4])
@pytest.mark.parametrize("name", PLANS)
def test_steps_equal_zero_stage_0(name: str, grad_accum: int):
    got, want = planned(_plan(name, 2, grad_accum)), planned(_plan(name, 0, grad_accum))
    for key in ("loss", "lm_loss", "aux_loss", "seq_aux_loss", "z_loss"):
        np.testing.assert_allclose(got.metrics[key], want.metrics[key], rtol=1e-5, err_msg=key)
    np.testing.assert_array_equal(got.metrics["load"], want.metrics["load"])
    assert_trees_close(got.grads, want.grads, rtol=1e-5)
    after = jax.device_get(got.state.params), jax.device_get(want.state.params)
    assert_trees_close(*after, rtol=1e-5)
    # each master and its moments: 1/g on a device, g the devices sharing the parameter
    stored, split = 0, 0
    sizes = jax.tree.leaves(got.state.params)[0].sharding.mesh.shape
    moments = jax.tree.leaves(optax.tree.get(got.state.opt_state, "mu"))
    params = jax.tree.leaves(got.state.params), jax.tree.leaves(want.state.params)
    leaves = zip(*params, moments, strict=True)
    for master, param, mu in leaves:
        spec = param.sharding.spec
        group = int(np.prod([sizes[a] for a in summed_axes(spec)]))
        local = master.addressable_shards[0].data.size
        assert mu.sharding == master.sharding
        stored += local
        split += local * group == param.addressable_shards[0].data.size
    assert split >= 0.8 * len(moments) and stored < 0.5 * sum(np.size(p) for p in moments)
    sums = [c for c in hlo_collectives.parse(got.hlo) if GRAD_EXCHANGE in c.op_name]
    assert "reduce-scatter" in {c.kind for c in sums}  # float32 sums to the masters
    assert {c.kind for c in sums} <= {"reduce-scatter", "all-reduce"}
    looped, after = _sums_beside_the_backward(got.hlo)
    if grad_accum == 1:  # the stacked weights' inside the layer scan's backward
        assert looped >= 4 and after < looped, (looped, after)
    else:  # all once, after the last micro-batch's backward
        assert looped == 0 and after > 0, (looped, after)


# Layouts the planner picks under the distributed optimizer (Mixtral-8x7B on 64 GPUs:
# tp + ep_etp; under Muon, experts split over 'data' too), with accumulation.
PICKED = {
    "tp+ep_etp": dict(attention="tp", experts="ep_etp"),
    "sp+ep_a2a,expert_fsdp": dict(attention="sp", experts="ep_a2a", expert_fsdp=True),
}


@pytest.mark.parametrize("name", PICKED)
def test_the_planners_layouts_equal_zero_stage_0(name: str):
    train = dataclasses.replace(BASE.train, grad_accum=4)
    base = dataclasses.replace(BASE, train=train)
    parallel = lambda zero: ParallelConfig(**PICKED[name], intra=4, data=2, zero=zero)
    got, want = (planned(dataclasses.replace(base, parallel=parallel(z))) for z in (2, 0))
    np.testing.assert_allclose(got.metrics["loss"], want.metrics["loss"], rtol=1e-5)
    assert_trees_close(got.grads, want.grads, rtol=1e-5)
    after = jax.device_get(got.state.params), jax.device_get(want.state.params)
    assert_trees_close(*after, rtol=1e-5)


def _sums_beside_the_backward(
    hlo: str, kinds: tuple[str, ...] = ("reduce-scatter", "all-reduce")
) -> tuple[int, int]:
    """Def-use walk over the compiled program: (gradient sums of `kinds` inside a loop
    body, those outside any). Every sum in a loop body (the layer scan's backward) has a
    GEMM of the same body (a dot, or a fusion or conditional holding one) that neither
    feeds it nor waits for it: the backward it can overlap."""
    program = hlo_collectives.instructions(hlo)
    with_dot = {ins.computation for ins in program if ins.opcode == "dot"}
    while True:  # and those calling them (fusions, a conditional's branches)
        more = {ins.computation for ins in program if ins.called & with_dot} - with_dot
        if not more:
            break
        with_dot |= more
    entry = {ins.computation for ins in program if ins.opcode == "parameter"} - {
        name for ins in program for name in ins.called
    }
    bodies: dict[str, dict[str, hlo_collectives.Instruction]] = {}
    for ins in program:
        bodies.setdefault(ins.computation, {})[ins.name] = ins
    looped = after = 0
    for name, body in bodies.items():
        users: dict[str, set[str]] = {}
        for ins in body.values():
            for operand in ins.operands:
                users.setdefault(operand, set()).add(ins.name)
        gemms = {
            ins.name
            for ins in body.values()
            if ins.opcode == "dot" or (ins.opcode != "while" and ins.called & with_dot)
        }
        for ins in body.values():
            kind = ins.opcode.removesuffix("-start")
            if kind not in kinds or GRAD_EXCHANGE not in ins.op_name:
                continue
            if name in entry:
                after += 1
                continue
            feeds = _reached(body, ins.name, lambda n, body=body: body[n].operands)
            waits = _reached(body, ins.name, lambda n, users=users: users.get(n, ()))
            assert gemms - feeds - waits, f"{ins.name}: every GEMM of its loop is tied to it"
            looped += 1
    return looped, after


def _reached(body: dict, start: str, edges) -> set[str]:
    """Instructions of `body` reached from `start` along `edges` (operands or users)."""
    seen, todo = set(), list(edges(start))
    while todo:
        other = todo.pop()
        if other in body and other not in seen:
            seen.add(other)
            todo.extend(edges(other))
    return seen


def _mixtral_tiny(**settings):
    """configs/mixtral_tiny.py under dp + ep_a2a, intra 4, data 2, with `settings`."""
    raw = runpy.run_path(str(ROOT / "configs" / "mixtral_tiny.py"))["get_config"]()
    plan = dict(attention="dp", experts="ep_a2a", intra=4, data=2)
    for key, value in {**plan, **settings}.items():
        section = "model" if key == "dtype" else "parallel"
        raw[section][key] = value
    return comm_report.validated(config_lib.load(raw), jax.device_count())


def test_bf16_weights_and_bf16_sums_move_half_the_float32_all_reduces_bytes():
    """ACCEPTANCE: a bfloat16 model, `grad_exchange='bf16_a2a'` and the distributed
    optimizer send at most 0.55x the parameter and gradient bytes of the float32
    all-reduce (comm_report on the compiled steps), as `param_traffic` predicts (1%).
    Read from the lowered program (XLA:CPU widens bf16 collectives when it compiles):
    every weight gather sends bf16, every gradient sum is a bf16 all-to-all, and no other
    all-gather of parameters is left (ZeRO-1 gathers the updated float32 weights there)."""
    fp32 = comm_report.report(_mixtral_tiny(zero=0), FAST_COMPILE)
    config = _mixtral_tiny(dtype="bfloat16", grad_exchange="bf16_a2a", zero=2)
    hlo, lowered = comm_report.compile_step(config, FAST_COMPILE)
    sent = lowered_dtypes.as_sent(hlo_collectives.parse(hlo), lowered)
    ours = comm_report.summarize(config, sent)
    measured = ours["param_grad_bytes_per_step"]
    assert measured <= 0.55 * fp32["param_grad_bytes_per_step"]
    assert measured == pytest.approx(ours["predicted_param_grad_bytes_per_step"], rel=0.01)
    assert fp32["param_grad_bytes_per_step"] == pytest.approx(
        fp32["predicted_param_grad_bytes_per_step"], rel=0.01
    )
    print(f"param+grad bytes: {measured:,} vs float32 {fp32['param_grad_bytes_per_step']:,}")
    gathers = [c for c in sent if WEIGHT_GATHER in c.op_name]
    sums = [c for c in sent if GRAD_EXCHANGE in c.op_name and c.kind == "all-to-all"]
    assert gathers and {(c.kind, c.dtype) for c in gathers} == {("all-gather", "bf16")}
    assert sums and {c.dtype for c in sums} == {"bf16"}
    big = lambda c: c.kind == "all-gather" and c.role == "param_grad" and c.size > 1024
    assert not any(big(c) for c in sent if WEIGHT_GATHER not in c.op_name)


def test_trainer_saves_canonical_checkpoints_that_restore_under_stage_0(tmp_path):
    """`trainer.run` with the distributed optimizer (evaluation included), then its last
    checkpoint restored under tp + etp without it: the same parameters and moments,
    placed as that plan places them."""
    config = dataclasses.replace(
        _plan("sp+ep_a2a", 2),
        train=TrainConfig(
            batch_size=8, seq_len=16, steps=2, log_every=1, eval_every=2, eval_batches=1
        ),
        data=DataConfig(source="synthetic"),
    )
    trainer.run(config, tmp_path)
    rows = read_rows(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]
    assert np.isfinite([r["val_loss"] for r in rows if "val_loss" in r]).all()

    def restored(plan):
        layout = mesh_lib.make_layout(plan, mesh_lib.make_mesh(plan))
        _, state = init_state(plan, layout)
        shardings = mesh_lib.train_state_shardings(state, layout, plan.parallel.zero)
        checkpoints = Checkpointer(tmp_path / "checkpoints", 3)
        state, _ = checkpoints.restore(2, jax.device_put(state, shardings))
        checkpoints.close()
        return state, shardings

    other = dataclasses.replace(config, parallel=_plan("tp+etp", 0).parallel)
    (saved, _), (moved, placed) = restored(config), restored(other)
    assert jax.tree.leaves(moved.params)[0].sharding == jax.tree.leaves(placed.params)[0]
    for a, b in zip(
        jax.tree.leaves((saved.params, saved.opt_state)),
        jax.tree.leaves((moved.params, moved.opt_state)),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_two_stage_pipeline_equals_zero_stage_0(schedule: str):
    """2 stages x 4 micro-batches: the masters of the stage-split stack are split over the
    stage's data and intra devices, those of the embedding and head over 'stage' too; the
    compiled step's float32 sums and gathers are the bytes the planner times for it
    (`GradSync.pipeline_sync_traffic`) within 1%. Under 1F1B with 2 repeats (the planner
    offers both schedules with `zero=2`): its sums after the loop against ZeRO 0's in the
    loop's drain."""
    plan = pipelined(2, 1, 4, 4, repeats=1 if schedule == "gpipe" else 2)
    plan = dataclasses.replace(plan, parallel=dataclasses.replace(plan.parallel, schedule=schedule))
    zero = dataclasses.replace(plan, parallel=dataclasses.replace(plan.parallel, zero=2))
    got, want = planned(zero), planned(plan)
    np.testing.assert_allclose(got.metrics["loss"], want.metrics["loss"], rtol=1e-5)
    assert_trees_close(got.grads, want.grads, rtol=1e-5)
    after = jax.device_get(got.state.params), jax.device_get(want.state.params)
    assert_trees_close(*after, rtol=1e-5)
    # its gradient sums and weight gathers, float32 here, are the bytes the planner times
    timed, sent, counted = _timed_and_sent(got.config, got.hlo, got.lowered)
    assert timed == pytest.approx(sent, rel=0.01) and counted == pytest.approx(sent, rel=0.01)


def _timed_and_sent(config, hlo: str, lowered: str) -> tuple[float, int, int]:
    """(the bytes the planner times for `config`'s pipelined gradient sums and weight
    gathers, `GradSync.pipeline_sync_traffic`; those the compiled step sends, comm_report
    reading the dtypes from the lowered program; those `param_traffic` counts)."""
    report = comm_report.summarize(
        config, lowered_dtypes.as_sent(hlo_collectives.parse(hlo), lowered)
    )
    plan = cost_model.Plan(config.parallel, grad_sync="per_micro_batch")
    batch = config.train.batch_size
    model = cost_model.CostModel(config, plan, get("h800"), batch, cost_model.Efficiency())
    timed = sum(sent for sent, _, _ in model.pipeline_sync_traffic())
    return timed, report["param_grad_bytes_per_step"], report["predicted_param_grad_bytes_per_step"]


def test_a_pipelines_bf16_sums_and_gathers_are_what_the_planner_times():
    """sp + ep_a2a in bf16 with `grad_exchange='bf16_a2a'`, 2 stages x 4 micro-batches on
    intra 2 x data 2: the distributed optimizer's bf16 all-to-all sums and bf16 weight
    gathers in the compiled step are the bytes the planner times for the pipelined step
    and `param_traffic` counts, within 1% (float32: the test above)."""
    settings = dict(attention="sp", intra=2, data=2, stages=2, microbatches=4, zero=2)
    config = _mixtral_tiny(**settings, dtype="bfloat16", grad_exchange="bf16_a2a")
    timed, sent, counted = _timed_and_sent(config, *comm_report.compile_step(config, FAST_COMPILE))
    assert timed == pytest.approx(sent, rel=0.01)
    assert counted == pytest.approx(sent, rel=0.01)
