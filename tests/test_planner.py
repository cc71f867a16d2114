"""Planner and cost model: formulas by hand, the paper's Table 3 and layout choices, the
CLI. Nothing is compiled; the memory model only traces shapes."""

from __future__ import annotations

import dataclasses
import json
import re
import runpy
import subprocess
from functools import cache
from pathlib import Path

import pytest

from moe_jax import config as config_lib
from moe_jax.config import Config, ParallelConfig
from moe_jax.parallel import registry
from moe_jax.plan import (
    cost_model,
    grad_sync,
    hardware,
    op_costs,
    paper_modes,
    paper_table,
    planner,
    schedule,
)
from moe_jax.plan.cost_model import make_plan
from moe_jax.plan.op_costs import Link
from tests import warm as warm_commands
from tests.commands import subprocess_env

ROOT = Path(__file__).resolve().parents[1]
H800 = hardware.get("h800")


@cache
def load(name: str) -> Config:
    return config_lib.load(runpy.run_path(str(ROOT / "configs" / f"{name}.py"))["get_config"]())


@cache
def table3() -> tuple[paper_table.Row, ...]:
    return tuple(paper_table.rows(load("megascale_352b"), H800))


def test_bubble_is_one_f_one_b():
    assert schedule.bubble_fraction(15, 60) == pytest.approx(14 / 74)
    assert schedule.bubble_fraction(1, 8) == 0
    config = load("megascale_352b")
    plan = make_plan(config, 720, "sp", "ep_ag", 8, 12, 15)
    cost = cost_model.step_cost(config, plan, H800, 720)
    assert cost.micro_batches == 60
    assert cost.breakdown["bubble"] == pytest.approx(14 * cost.micro_batch_s)
    assert sum(cost.breakdown.values()) == pytest.approx(cost.step_s)


def _pipeline(name: str, batch: int, *layout, **settings) -> cost_model.CostModel:
    """The cost model of a plan of a config, checked to be one the trainer runs."""
    config = load(name)
    plan = make_plan(config, batch, *layout, **settings)
    assert planner.problem(config, plan, batch, H800) is None
    return cost_model.CostModel(config, plan, H800, batch, op_costs.Efficiency())


def test_pipeline_step_is_gpipe_ticks_and_the_parts_outside():
    """The trainer's pipeline, DeepSeekMoE-16B (1 dense layer, then 27 MoE units) over
    S = 3 stages and M = 96 / (4 x 2) = 12 micro-batches: M + S - 1 = 14 ticks of one
    9-unit group each, S - 1 = 2 of them bubble, 2/14 of the pipelined part. Each tick
    runs its forward once more (rematerialised) and sends 1024 tokens of 2048 bf16 on
    and back over the network; the dense layer and head run for K = 4 micro-batches per
    stage outside the ticks, after 4 (S - 1) sends of those to stage 0 and back."""
    model = _pipeline("deepseek_moe_16b", 96, "sp", "ep_a2a", 8, 4, 3, micro_batch=2)
    cost = model.step()
    send = 10e-6 + 1024 * 2048 * 2 / (H800.network_bandwidth * 0.88)
    assert model.send_s(model.t) == pytest.approx(send)
    tick = model.tick().seconds
    group = 9 * (model.unit().seconds + model.unit(forward_only=True).seconds)
    assert tick == pytest.approx(group + model.accumulation_s(model.group_params()) + 2 * send)
    assert cost.micro_batches == 12 and cost.micro_batch_s == pytest.approx(tick)
    pipelined = 14 * tick
    assert cost.breakdown["bubble"] == pytest.approx(2 / 14 * pipelined)
    assert cost.bubble == pytest.approx(2 / 14) == schedule.bubble_fraction(3, 12)
    outside = model.outside_params()
    rest = (
        4 * model.outside().seconds
        + model.accumulation_s(outside, passes=1)
        + 4 * 2 * model.send_s(4 * model.t)
        + grad_sync.sync_time(model.pipeline_sync_traffic())
        + model.optimizer_s(model.group_params() + outside)
    )
    assert cost.step_s == pytest.approx(pipelined + rest)
    assert sum(cost.breakdown.values()) == pytest.approx(cost.step_s)
    assert cost.hidden["grad_sync"] == 0  # summed once, after the backward


def test_one_f_one_b_sums_the_last_repeats_in_its_drain():
    """Mixtral-8x7B over S = 4 stages, M = 8 micro-batches, R = 2 repeats: GPipe sums
    every gradient after its loop, exposed. 1F1B's loop ends in 4 drain ticks after its
    last backward of repeat 1 (`pipeline_schedule.loop_sums`), each summing a quarter of
    repeat 1's stack gradients behind the tick's backward; repeat 0's half of the stack,
    and what every stage holds, after the loop. Same bytes, by hand."""
    plans = {
        s: _pipeline("mixtral_8x7b", 16, "sp", "ep_a2a", 8, 2, 4, repeats=2, schedule=s)
        for s in ("gpipe", "1f1b")
    }
    gpipe, one = (plans[s].step() for s in ("gpipe", "1f1b"))
    model = plans["1f1b"]
    loop, rest = model.pipeline_sync_parts()
    assert sum(b for b, _, _ in loop + rest) == sum(b for b, _, _ in model.pipeline_sync_traffic())
    assert gpipe.breakdown["grad_sync"] == pytest.approx(grad_sync.sync_time(loop + rest))
    assert gpipe.hidden["grad_sync"] == 0
    half = [(b / 2, g, link) for b, g, link in loop]
    quarter = grad_sync.sync_time([(b / 4, g, link) for b, g, link in half])
    backward = model.tick().backward
    shown = 4 * max(0.0, quarter - backward)
    assert one.breakdown["grad_sync"] == pytest.approx(grad_sync.sync_time(rest + half) + shown)
    assert one.hidden["grad_sync"] == pytest.approx(4 * quarter - shown)
    assert one.hidden["grad_sync"] > 0
    assert one.breakdown["grad_sync"] < gpipe.breakdown["grad_sync"]


def test_circular_repeats_shrink_the_bubble():
    """Mixtral-8x7B over S = 4 stages, M = 16 / (2 x 1) = 8 micro-batches: R = 2 repeats
    cut the bubble from 3/11 to 3/19 of the ticks, and halve each tick's group (16 units
    to 8), so the bubble's seconds fall to half but for the sends, which do not shrink."""
    models = {r: _pipeline("mixtral_8x7b", 16, "sp", "ep_a2a", 8, 2, 4, repeats=r) for r in (1, 2)}
    costs = {r: m.step() for r, m in models.items()}
    assert costs[1].bubble == pytest.approx(3 / 11)
    assert costs[2].bubble == pytest.approx(3 / 19) == schedule.bubble_fraction(4, 8, 2)
    sends = 2 * models[1].send_s(models[1].t)
    tick = models[1].tick().seconds
    assert costs[2].breakdown["bubble"] == pytest.approx(3 * ((tick - sends) / 2 + sends))
    assert costs[2].breakdown["bubble"] < 0.51 * costs[1].breakdown["bubble"]
    assert costs[2].step_s < costs[1].step_s


@pytest.mark.parametrize(
    "name,gpus,batch", [("mixtral_8x7b", 64, 64), ("deepseek_moe_16b", 72, 1152)]
)
def test_every_pipeline_planned_is_one_the_trainer_runs(name: str, gpus: int, batch: int):
    """Whatever pipeline the planner offers passes the trainer's own checks for its
    devices: the MoE stack cut into S R whole groups, M a multiple of S, grad_accum 1."""
    config = load(name)
    planned = [
        p for p in planner.plans(config, gpus, H800, batch, micro_batch=1) if p.parallel.stages > 1
    ]
    assert {p.parallel.repeats for p in planned} >= ({1, 2, 4} if name == "mixtral_8x7b" else {1})
    for plan in planned:
        run = plan.config(config, batch)
        assert plan.devices == gpus and run.train.grad_accum == 1
        assert run.parallel == plan.parallel and run.micro_batches == batch // plan.parallel.data
        assert not registry.pipeline_problems(run), plan
        assert not registry.problems(run, gpus, "gpu"), plan


def test_choose_plan_pipelines_only_without_grad_accum():
    """Mixtral-8x7B's first 16 layers on 16 GPUs (two nodes), 128 sequences a step (too
    many for one pass of a data group): the trainer is given a pipeline it runs on
    these devices, its micro-batches as its
    accumulation; a configured train.grad_accum rules pipelines out. (With 8 layers
    the distributed optimizer's smaller state lets one flat pass of 64 sequences fit.)"""
    from moe_jax.plan.resolve import check_plan

    mixtral = load("mixtral_8x7b")
    config = dataclasses.replace(
        mixtral,
        model=dataclasses.replace(mixtral.model, num_layers=16),
        train=dataclasses.replace(mixtral.train, batch_size=128),
    )
    chosen = planner.choose_plan(config, 16, "h800")
    assert chosen.stages > 1 and chosen.microbatches % chosen.stages == 0
    resolved = dataclasses.replace(config, parallel=chosen)
    assert check_plan(resolved, 16).parallel == resolved.parallel
    accumulated = dataclasses.replace(config, train=dataclasses.replace(config.train, grad_accum=2))
    flat = planner.choose_plan(accumulated, 16, "h800")
    assert (flat.stages, flat.microbatches, flat.repeats) == (1, 1, 1)


def test_megascale_352b_on_1440_gpus_is_a_pipeline_the_trainer_runs():
    """The 352B model on 1440 H800 (global batch 720): the best plan that fits is a
    pipeline the trainer runs, zero-bubble with the deepest stash that fits (ZeRO-1's
    padded moments leave room for it: `moe_jax.parallel.zero_padding`), its bubble 1F1B's
    less one W per tick of depth."""
    config = load("megascale_352b")
    best = planner.rank(config, 1440, H800, 720, limit=1).best
    plan, cost = best.plan, best.cost
    p = plan.parallel
    assert plan.pipelined and planner.fits(best.memory, H800)
    assert not registry.problems(plan.config(config, 720), 1440, "gpu")
    assert (p.schedule, p.zero) == ("zero_bubble", 1) and 0 < p.stash_depth < p.stages - 1
    at = lambda **kw: dataclasses.replace(plan, parallel=dataclasses.replace(p, **kw))
    deeper = at(stash_depth=p.stash_depth + 1)
    assert not planner.fits(planner._memory(config, deeper, 720), H800)
    sibling = at(schedule="1f1b", stash_depth=0)
    one_f_one_b = cost_model.step_cost(config, sibling, H800, 720)
    full = (p.stages - 1) * cost.micro_batch_s
    assert one_f_one_b.breakdown["bubble"] == pytest.approx(full)
    assert one_f_one_b.micro_batch_s == pytest.approx(cost.micro_batch_s)
    w = cost_model.CostModel(config, plan, H800, 720, op_costs.Efficiency()).deferred_s()
    w /= p.stash_depth
    assert cost.breakdown["bubble"] == pytest.approx(full - p.stash_depth * w)
    assert cost.step_s == pytest.approx(one_f_one_b.step_s - p.stash_depth * w)


def test_ring_all_gather_is_alpha_beta():
    link = Link(bandwidth=156e9, latency=3e-6)
    result = 64e6  # bytes per device after the gather
    by_hand = 7 * 3e-6 + result * 7 / 8 / 156e9
    assert op_costs.all_gather_time(result, 8, link) == pytest.approx(by_hand)
    assert op_costs.all_gather_time(result, 1, link) == 0


def test_overlap_hides_what_compute_covers():
    assert op_costs.exposed(1.0, 3.0, 1) == 1.0
    assert op_costs.exposed(1.0, 3.0, 4) == pytest.approx(0.25)
    assert op_costs.exposed(3.0, 1.0, 4) == pytest.approx(2.25)


def _exchange(kind: str, attention: str, chunks: int, eff: op_costs.Efficiency):
    config = load("mixtral_8x7b")
    plan = make_plan(config, 64, attention, "ep_a2a", 8, 8, 1, micro_batch=4, overlap_chunks=chunks)
    cost = cost_model.step_cost(config, plan, H800, 64, eff)
    shown = cost.breakdown[kind]
    return shown, shown + cost.hidden.get(kind, 0.0)


@pytest.mark.parametrize("chunks", [2, 4])
@pytest.mark.parametrize(
    "kind,attention,slow",
    [
        ("expert_exchange", "sp", {"grouped_gemm": 0.01}),  # the expert block's GEMMs
        ("attention_exchange", "sp", {"gemm": 0.01, "attention": 0.01}),  # sp's block
    ],
)
def test_chunks_hide_what_the_structure_says(kind, attention, slow, chunks: int):
    """C chunks of a block (`parallel.overlap_chunks`: every expert block, and sp's
    attention over its batch) expose 1/C of its exchange when its compute is longer
    (slow GEMMs make sure of it), and pay C times the latency terms."""
    slow = op_costs.Efficiency(**slow)
    one_shown, one_total = _exchange(kind, attention, 1, slow)
    shown, total = _exchange(kind, attention, chunks, slow)
    assert one_shown == pytest.approx(one_total)  # one chunk: nothing hidden
    assert shown == pytest.approx(total / chunks)
    assert total > one_total  # C times the collectives' latency terms
    shown, total = _exchange(kind, attention, chunks, op_costs.Efficiency())
    assert total / chunks * (1 - 1e-9) <= shown < total  # at most (C-1)/C ever hides


def test_tensor_parallel_exchanges_stay_exposed_when_chunked():
    """tp's all-gathers and reduce-scatters are not chunked: all of them stay exposed."""
    shown, total = _exchange("attention_exchange", "tp", 4, op_costs.Efficiency())
    assert shown == pytest.approx(total) and shown > 0


def test_the_trainer_is_never_planned_an_overlap_it_cannot_run():
    """`layout=auto` picks overlap_chunks among those the trainer runs: with 6 positions
    per sequence on each device, 4 chunks do not split them."""
    config = dataclasses.replace(
        load("default"), train=dataclasses.replace(load("default").train, seq_len=6)
    )
    settings = planner.choose_plan(config, 1)
    assert settings.overlap_chunks in (1, 2)
    assert not settings.collective_matmul  # one device: no ring
    # no mode the trainer lacks
    assert set(cost_model.OVERLAPS) == {"none", "chunked", "collective_matmul", "both"}


def _ring_exchange(kind, attention, experts, ring, eff, chunks=1):
    config = load("mixtral_8x7b")
    plan = make_plan(
        config, 64, attention, experts, 8, 8, 1, 4, overlap_chunks=chunks, collective_matmul=ring
    )
    cost = cost_model.step_cost(config, plan, H800, 64, eff)
    return cost.breakdown[kind], cost.breakdown[kind] + cost.hidden.get(kind, 0.0)


@pytest.mark.parametrize(
    "kind,attention,experts",
    [
        ("attention_exchange", "tp", "ep_a2a"),  # tp's all-gather + GEMM, GEMM + reduce-scatter
        ("attention_exchange", "sp", "ep_a2a"),  # sp's all-to-all + GEMM pairs
        ("expert_exchange", "dp", "ep_ag"),  # the all-gather expert ring
    ],
)
def test_a_ring_hides_all_but_one_step(kind, attention, experts):
    """With GEMMs longer than the exchange, a collective matmul over n=8 exposes one of
    its n-1 = 7 steps (per direction), with the latency terms of the ring collectives it
    replaces; inside C=2 chunks, one of 2·7."""
    slow = op_costs.Efficiency(gemm=0.01, grouped_gemm=0.01)
    plain_shown, plain_total = _ring_exchange(kind, attention, experts, False, slow)
    shown, total = _ring_exchange(kind, attention, experts, True, slow)
    assert total == pytest.approx(plain_total)
    if attention == "tp":
        assert plain_shown == pytest.approx(plain_total)  # tp is otherwise never hidden
    assert shown == pytest.approx(total / 7)
    shown, total = _ring_exchange(kind, attention, experts, True, slow, chunks=2)
    if kind == "expert_exchange" or attention == "sp":  # blocks that run chunked
        assert shown == pytest.approx(total / 14)


def test_a_ring_hides_behind_its_gemms_only():
    """tp's rings are cut into the projections' GEMMs: with an exchange longer than them
    (a slow link), a slower attention core hides nothing more of it, while the chunked
    sp exchange hides behind the whole block, its core included."""
    fast = op_costs.Efficiency(nvlink=0.01)
    slow_core = op_costs.Efficiency(nvlink=0.01, attention=0.001)
    ring = [
        _ring_exchange("attention_exchange", "tp", "ep_a2a", True, e)[0] for e in (fast, slow_core)
    ]
    assert ring[0] == pytest.approx(ring[1]) and ring[0] > 0
    chunked = [
        _ring_exchange("attention_exchange", "sp", "ep_a2a", False, e, chunks=4)[0]
        for e in (fast, slow_core)
    ]
    assert chunked[1] < chunked[0]


def test_fp8_tokens_halve_what_they_move_and_pay_their_casts():
    """`parallel.token_dtype='fp8'`: the planning models count 1 byte plus 4/128 of scales
    where bf16 sends 2 (sp's all-to-alls: 0.516x; ep_a2a: the dispatch halved, the
    combine not, 0.758x with the expert ids), and the quantise and dequantise passes as
    memory-bound compute."""
    from moe_jax.plan import comm_volume

    config = load("mixtral_8x7b")
    fp8 = dataclasses.replace(
        config, parallel=dataclasses.replace(config.parallel, token_dtype="fp8")
    )
    plans = [make_plan(c, 64, "sp", "ep_a2a", 8, 8, 1, micro_batch=4) for c in (config, fp8)]
    native, compressed = (
        comm_volume.activation_bytes(p.config(c, 64))
        for c, p in zip((config, fp8), plans, strict=True)
    )
    assert compressed.attention / native.attention == pytest.approx((1 + 4 / 128) / 2)
    assert compressed.experts / native.experts == pytest.approx((3 + 4 / 128) / 4, rel=0.01)
    costs = [
        cost_model.step_cost(c, p, H800, 64) for c, p in zip((config, fp8), plans, strict=True)
    ]
    assert "fp8_casts" not in costs[0].breakdown and costs[1].breakdown["fp8_casts"] > 0


def test_plans_ring_only_what_the_trainer_can_ring():
    """Every plan searched with collective matmul has a layout with a ring form, never
    over one device, and never the all-gather expert ring with capacity drops."""
    config = load("mixtral_8x7b")
    capacity = dataclasses.replace(config, moe=dataclasses.replace(config.moe, capacity_factor=1.0))
    for cfg in (config, capacity):
        ringed = [
            p
            for p in planner.plans(cfg, 64, H800, 64, pp=1, micro_batch=1)
            if p.parallel.collective_matmul
        ]
        assert ringed
        for plan in ringed:
            p = plan.parallel
            assert p.intra > 1
            has_ring = registry.ATTENTION[p.attention].ring
            expert_ring = registry.EXPERTS[p.experts].ring_dispatcher is not None
            assert has_ring or expert_ring, p
            if cfg is capacity:
                assert not expert_ring, p
            assert plan.overlap == cost_model.overlap_name(p.overlap_chunks, True)


def test_compute_comm_ratio():
    """R = 3/2 h_ffn B/P n/(n-1): Mixtral's wide experts hide their exchange on H800
    NVLink, DeepSeekMoE's 1408-wide ones cannot."""
    mixtral = planner.compute_comm_ratio(load("mixtral_8x7b"), H800)
    deepseek = planner.compute_comm_ratio(load("deepseek_moe_16b"), H800)
    assert mixtral == pytest.approx(1.5 * 14336 * 400e9 / 989e12 * 8 / 7)
    assert mixtral > 1 > deepseek
    assert deepseek == pytest.approx(0.976, abs=1e-3)


def test_plans_that_do_not_fit_are_dropped():
    ranking = planner.rank(load("megascale_352b"), 8, H800, 32)
    assert not ranking.candidates and ranking.dropped_for_memory == ranking.plans > 0
    with pytest.raises(ValueError, match="no plan fits 8 x H800"):
        _ = ranking.best


def test_table3_megascale_within_25_percent():
    for row in table3():
        plan = row.megascale.plan
        assert (plan.parallel.attention, plan.parallel.experts, plan.parallel.intra) == (
            "sp",
            "ep_a2a",
            8,
        )
        assert (plan.remat, plan.grad_dtype) == ("selective", "bfloat16")
        assert abs(row.errors["megascale"]) <= 0.25, (row.paper.gpus, row.errors)


def test_table3_megatron_within_25_and_speedup_within_20_percent():
    """Megatron-LM is still predicted faster than measured, the speed-up lower (see the
    planner's report), both inside the targets at every size."""
    for row in table3():
        assert 0 < row.errors["megatron"] <= 0.25, (row.paper.gpus, row.errors)
        assert -0.20 <= row.errors["speedup"] < 0, (row.paper.gpus, row.errors)
    for row in table3():  # no token-exchange overlap in the baseline, most of it in SP+EP
        hidden = row.megatron.cost.hidden
        assert not hidden.get("attention_exchange") and not hidden.get("expert_exchange")
        shown, hid = row.megascale.cost.breakdown, row.megascale.cost.hidden
        assert hid["expert_exchange"] > shown["expert_exchange"]
    assert all(r.speedup > 1.45 for r in table3())


def test_tile_factor_slows_short_reductions_only():
    eff = op_costs.Efficiency()
    assert op_costs.tile_factor(4096, eff) == pytest.approx(1.0)
    assert op_costs.tile_factor(14336, eff) == 1.0
    assert op_costs.tile_factor(512, eff) == pytest.approx(0.5 * 4608 / 4096)
    # backward: data gradient over the columns, weight gradient over the rows
    shapes = ((768.0, 4096.0, 1792.0),)
    backward = 2 / (1 / op_costs.tile_factor(4096, eff) + 1 / op_costs.tile_factor(768, eff))
    assert op_costs.gemm_factor(shapes, True, eff) == pytest.approx(backward)
    assert op_costs.gemm_factor((), False, eff) == 1.0


def test_selective_remat_and_bf16_gradients_cost_less():
    config = load("megascale_352b")
    base = make_plan(config, 720, "sp", "ep_a2a", 8, 12, 15)
    full = cost_model.step_cost(config, base, H800, 720)
    selective = cost_model.step_cost(
        config, dataclasses.replace(base, remat="selective"), H800, 720
    )
    none = cost_model.step_cost(config, dataclasses.replace(base, remat="none"), H800, 720)
    assert none.step_s < selective.step_s < full.step_s
    assert selective.breakdown["expert_gemm"] == pytest.approx(none.breakdown["expert_gemm"])
    bf16 = cost_model.step_cost(config, dataclasses.replace(base, grad_dtype="bfloat16"), H800, 720)
    total = lambda c: c.breakdown["grad_sync"] + c.hidden["grad_sync"]
    # intra node, across the 12 data groups, and (embedding and head, held by every stage)
    # across the 12 x 15 devices of 'data' and 'stage'
    latency = 7 * 2 * 3e-6 + 11 * 2 * 10e-6 + (12 * 15 - 1) * 2 * 10e-6
    assert total(bf16) - latency == pytest.approx((total(full) - latency) / 2)


def test_table3_mfu_falls_with_scale():
    mfu = [row.megascale.cost.mfu for row in table3()]
    assert mfu == sorted(mfu, reverse=True)
    assert paper_table.format_table(list(table3())).count("\n") == 3 + len(table3())


def test_mixtral_on_one_node_chooses_expert_parallelism():
    """Mixtral-8x7B's layers on 8 H800 (8 of its 32 layers: the full model's float32
    weights, gradients and Adam moments need 16 x 46.7B bytes, more than 8 x 80 GB)."""
    mixtral = load("mixtral_8x7b")
    config = dataclasses.replace(mixtral, model=dataclasses.replace(mixtral.model, num_layers=8))
    ranking = planner.rank(config, 8, H800, 32, limit=20)
    best = ranking.best
    p = best.plan.parallel
    assert p.experts in ("ep_a2a_ragged", "ep_ag") and p.attention in ("sp", "dp")
    sp_ep = next(c for c in ranking.candidates if c.plan.parallel.attention == "sp")
    assert sp_ep.plan.parallel.experts.startswith("ep_")
    # dp wins only by sp's attention exchange (its all-to-alls are not overlapped)
    shown = sp_ep.cost.breakdown["attention_exchange"]
    assert best.cost.step_s < sp_ep.cost.step_s <= best.cost.step_s + 1.1 * shown
    # The paper's single-node SP+EP over TP+TP, both with the paper's own overlap.
    paper = paper_modes.PAPER_OVERLAP
    ours = planner.rank(config, 8, H800, 32, None, paper, limit=1, attention=("sp",)).best
    baseline = planner.rank(
        config, 8, H800, 32, None, paper, limit=1, attention=("tp",), experts=("etp",), intra=(8,)
    ).best
    gain = ours.cost.mfu / baseline.cost.mfu - 1
    assert 0.149 <= gain <= 0.329
    reason = "\n".join(planner.explain(best, H800, planner.runner_up(ranking)))
    # the runner-up loses by an exchange: sp's attention all-to-alls or fsdp's weight gathers
    assert re.search(r"vs the best other layout.*(attention_exchange|weight_gather) \+", reason)


def test_choose_plan_returns_trainer_settings():
    """The planner's choice is a `ParallelConfig` the trainer runs as it is: the config's
    own settings kept, the searched ones filled in, the devices used."""
    config = load("mixtral_tiny")
    choice = planner.choose_plan(config, 8, "h800")
    assert isinstance(choice, ParallelConfig) and choice.layout == "manual"
    assert choice.intra * choice.data * choice.stages == 8
    kept = ("token_dtype", "grad_exchange", "vocab_parallel", "a2a_buffer_factor")
    assert all(getattr(choice, k) == getattr(config.parallel, k) for k in kept)
    config_lib.validate(dataclasses.replace(config, parallel=choice))


def _cli(*args: str) -> subprocess.CompletedProcess:
    """`python -m moe_jax.plan ARGS`, forked from the warm interpreter (`tests.warm`; the
    real command line is proven by tests/test_bad_inputs.py)."""
    env = subprocess_env(JAX_PLATFORMS="cpu")
    return warm_commands.run(ROOT, ["-m", "moe_jax.plan", *args], env, timeout=300)


@pytest.mark.parametrize(
    "config,gpus,batch,pp,verdict",
    [
        ("megascale_352b", 1440, 720, 15, "ratio > 1"),
        ("deepseek_moe_16b", 64, 1024, 1, "ratio < 1"),
    ],
)
def test_cli_json_last_line(config: str, gpus: int, batch: int, pp: int, verdict: str):
    """The issue's command for the 352B model (its plans fit in 80 GB only when a
    recomputed layer's working set is counted once, not per micro-batch in flight)."""
    run = _cli(
        f"--config=configs/{config}.py",
        f"--gpus={gpus}",
        "--gpu=h800",
        f"--global-batch={batch}",
        f"--pp={pp}",
        "--compare=megatron",
        "--json",
    )
    assert run.returncode == 0, run.stderr
    assert run.stderr == ""  # nothing but the table and the JSON line (no jax or absl noise)
    assert verdict in run.stdout  # Mixtral-like wide experts hide; DeepSeekMoE's narrow do not
    result = json.loads(run.stdout.strip().splitlines()[-1])
    for key in ("best", "baseline"):
        assert {"attention", "experts", "tokens_per_sec", "mfu", "step_s"} <= set(result[key])
    assert (result["baseline"]["attention"], result["baseline"]["experts"]) == ("tp", "etp")
    ratio = result["best"]["tokens_per_sec"] / result["baseline"]["tokens_per_sec"]
    assert result["speedup"] == pytest.approx(ratio) and ratio >= 1
    # the flags that run the winner, printed under the table; --pp restricted the search
    # and --compare=megatron ranked with the paper's gradient sync, so layout=auto (every
    # depth, the trainer's sync) is not promised to pick the same plan
    assert f"\n  {result['flags']}\n" in run.stdout and f"--config.parallel.stages={pp}" in (
        result["flags"] if pp > 1 else f"--config.parallel.stages={pp}"
    )
    assert "gradient sync hierarchical and overlapped (the paper's)" in run.stdout
    caveat = "with --pp and --compare=megatron (the paper's gradient sync) this ranking is another"
    assert result["auto_flags"] is None and caveat in run.stdout


@pytest.mark.parametrize("flag", ["--bogus=1", "--gpu=v100", "--compare=deepspeed"])
def test_cli_bad_flag_is_one_line(flag):
    run = _cli("--gpus=8", flag)
    assert run.returncode == 1
    assert run.stderr.startswith("error:") and len(run.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("impl,extra", [("blockwise", 0), ("xla", 1)])
def test_qk_clip_costs_a_peak_pass_where_the_kernel_keeps_no_maximum(impl: str, extra: int):
    """`train.qk_clip`: blockwise attention's running maxima are its peaks (no cost); on
    `xla` (and cuDNN) a forward-only pass of the scores finds them: half the core's
    forward FLOPs again, once per layer and micro-batch, never in the backward or the
    recompute (Mixtral-8x7B, sp + ep_a2a, remat 'full')."""
    config = load("mixtral_8x7b")
    plan = make_plan(config, 64, "sp", "ep_a2a", 8, 8, 1, micro_batch=4)
    steps, models = [], []
    for clip in (False, True):
        model = dataclasses.replace(config.model, attention_impl=impl)
        train = dataclasses.replace(config.train, qk_clip=clip)
        clipped = dataclasses.replace(config, model=model, train=train)
        steps.append(cost_model.step_cost(clipped, plan, H800, 64))
        models.append(cost_model.CostModel(clipped, plan, H800, 64, op_costs.Efficiency()))
    core = [op for op in models[1].attention_ops() if op.name == "attention_core"]
    assert len(core) == 1 + extra
    peak = 0.0
    if extra:
        assert core[1].flops == core[0].flops / 2 and core[1].backward == 0.0
        peak = models[1]._time(core[1], backward=False)
    forwards = config.model.num_layers * steps[1].micro_batches
    got = steps[1].breakdown["attention_core"] - steps[0].breakdown["attention_core"]
    assert got == pytest.approx(peak * forwards, rel=1e-6, abs=1e-12)
