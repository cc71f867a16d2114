"""The 1F1B pipeline schedule (`parallel.schedule=1f1b`, `moe_jax.parallel.pipeline_1f1b`):
its tables checked item by item against the schedule's rules, the step against a
single-device run over the same micro-batches (`train.grad_accum=M`), its one tick loop
read from the compiled program, and poisoned buffers. Memory: `tests/test_pipeline_state.py`;
the trainer end to end: `tests/test_pipeline_training.py`."""

from __future__ import annotations

import dataclasses
import math
from functools import partial

import jax
import numpy as np
import pytest

from moe_jax.config import ParallelConfig
from moe_jax.parallel import backward_halves, pipeline, pipeline_1f1b
from moe_jax.parallel import mesh as mesh_lib
from moe_jax.parallel.pipeline_schedule import NONE, loop_sums, one_f_one_b, zero_bubble
from moe_jax.plan.resolve import check_plan
from tests import pipelined as piped
from tests.layouts import (
    assert_leaves_close_in_norm,
    assert_trees_close,
    on_ragged_dot,
    planned,
    reference,
    run_under,
)
from tests.pipelined import MODEL, pipeline_trip_counts
from tests.test_backward_halves import primitives
from tests.test_distributed_optimizer import _sums_beside_the_backward
from tests.test_pipeline import _assert_equal_one_device

# --- the tables ---------------------------------------------------------------------


def _items(table, kind: str) -> dict[tuple[int, int], tuple[int, int]]:
    """(micro-batch, virtual stage) -> (tick, stage) of every forward or backward item."""
    done = {}
    s_ = table.stages
    for t in range(table.ticks):
        for s in range(s_):
            i = getattr(table, kind)[t, s]
            if i != NONE:
                v = getattr(table, f"{kind}_repeat")[t, s] * s_ + s
                assert (i, v) not in done, (kind, i, v)
                done[(i, v)] = (t, s)
    return done


@pytest.mark.parametrize(
    "stages,micro,repeats", [(2, 4, 1), (2, 4, 2), (4, 8, 1), (4, 8, 2), (4, 16, 2), (15, 30, 4)]
)
def test_table_runs_each_item_once_after_what_it_needs(stages, micro, repeats):
    table = one_f_one_b(stages, micro, repeats)
    last = stages * repeats - 1
    forward, backward = _items(table, "forward"), _items(table, "backward")
    every = {(i, v) for i in range(micro) for v in range(last + 1)}
    assert set(forward) == set(backward) == every
    for (i, v), (t, s) in forward.items():
        assert s == v % stages
        if v > 0:  # its input was sent by the previous virtual stage's forward, ticks ago
            assert forward[(i, v - 1)][0] < t
        assert (table.loss[t, s] == 1) == (v == last)
    for (i, v), (t, _) in backward.items():
        if v == last:  # the loss's gradient: this tick's forward or an earlier one
            assert forward[(i, v)][0] <= t
        else:
            assert backward[(i, v + 1)][0] < t
    # forward work in M R + S - 1 ticks and backward work in as many: GPipe's bubble
    assert table.forward_ticks() == table.backward_ticks() == micro * repeats + stages - 1


@pytest.mark.parametrize(
    "stages,micro,repeats", [(2, 4, 1), (2, 4, 2), (4, 8, 1), (4, 8, 2), (4, 16, 2), (15, 30, 4)]
)
def test_zero_bubble_runs_each_weight_item_once_after_its_input_gradient(stages, micro, repeats):
    """1F1B's items, each backward's W on its stage at or after its B, reading the stash
    slot its B wrote (no other B overwrites it in between); the k-th W of every stage in
    one tick, so W work fills M R ticks, not M R + S - 1; the stash bounded by S."""
    table, base = zero_bubble(stages, micro, repeats), one_f_one_b(stages, micro, repeats)
    for name in ("forward", "forward_repeat", "backward", "backward_repeat", "loss"):
        np.testing.assert_array_equal(getattr(table, name), getattr(base, name))
    for s in range(stages):
        b_ticks = [t for t in range(table.ticks) if table.backward[t, s] != NONE]
        w_ticks = [t for t in range(table.ticks) if table.weight[t, s] != NONE]
        assert len(b_ticks) == len(w_ticks) == micro * repeats
        owner = {}  # stash slot -> the item whose B wrote it
        for t in range(table.ticks):
            if t in b_ticks:
                item = (table.backward[t, s], table.backward_repeat[t, s])
                owner[table.stash_slot[t, s]] = item
            if t in w_ticks:
                item = (table.weight[t, s], table.weight_repeat[t, s])
                assert owner.pop(table.weight_slot[t, s]) == item, (s, t)
        assert not owner
        for b, w in zip(b_ticks, w_ticks, strict=True):  # the k-th W after the k-th B
            assert w >= b
    assert all(((table.weight[t] != NONE).all() or (table.weight[t] == NONE).all())
               for t in range(table.ticks))  # fmt: skip
    assert table.weight_ticks() == micro * repeats
    assert table.backward_ticks() == table.forward_ticks() == micro * repeats + stages - 1
    assert table.stash_slots <= stages
    assert zero_bubble(stages, 2 * micro, repeats).stash_slots == table.stash_slots


@pytest.mark.parametrize("stages,micro,repeats", [(4, 8, 1), (4, 8, 2), (15, 30, 4)])
def test_a_shallower_stash_defers_each_weight_item_at_most_its_depth(stages, micro, repeats):
    """`parallel.stash_depth` D: each W on its stage D ticks after its B at most (as late
    as the aligned table's otherwise), so the stash holds D + 1 items and W work fills
    M R + S - 1 - D ticks: each tick of depth takes one W tick out of the bubble."""
    full = zero_bubble(stages, micro, repeats)
    for depth in range(1, stages - 1):
        table = zero_bubble(stages, micro, repeats, depth)
        for s in range(stages):
            b_ticks = np.nonzero(table.backward[:, s] != NONE)[0]
            w_ticks = np.nonzero(table.weight[:, s] != NONE)[0]
            aligned = np.nonzero(full.weight[:, s] != NONE)[0]
            np.testing.assert_array_equal(w_ticks, np.minimum(aligned, b_ticks + depth))
            np.testing.assert_array_equal(table.weight[w_ticks, s], table.backward[b_ticks, s])
            np.testing.assert_array_equal(
                table.weight_slot[w_ticks, s], table.stash_slot[b_ticks, s]
            )
        assert table.stash_slots == depth + 1
        assert table.weight_ticks() == micro * repeats + stages - 1 - depth


def test_inputs_in_flight_are_bounded_by_stages_and_repeats_not_micro_batches():
    for stages, repeats in ((2, 1), (4, 1), (4, 2), (15, 4)):
        slots = {
            one_f_one_b(stages, m, repeats).slots for m in (2 * stages, 4 * stages, 8 * stages)
        }
        assert len(slots) == 1, slots  # the same for every M from 2 S on
        assert slots.pop() <= 2 * stages * repeats
        assert one_f_one_b(stages, 8 * stages, repeats).gradient_slots <= 2


# --- the step -----------------------------------------------------------------------


def _scheduled(config, schedule: str = "1f1b"):
    return dataclasses.replace(
        config, parallel=dataclasses.replace(config.parallel, schedule=schedule)
    )


# (stages, data, intra, repeats, micro-batches, attention, experts): (S, M, R) =
# (2, 4, 1) in both layouts, (2, 4, 2), (4, 8, 1) and (4, 8, 2) (eight MoE layers)
CASES = [
    (2, 1, 4, 1, 4, "sp", "ep_a2a"),
    (2, 2, 2, 1, 4, "tp", "etp"),
    (2, 1, 4, 2, 4, "sp", "ep_a2a"),
    (4, 2, 1, 1, 8, "tp", "etp"),
    (4, 2, 1, 2, 8, "sp", "ep_a2a"),
]
EIGHT_MOE = dataclasses.replace(MODEL.model, num_layers=9)
# zero-bubble with a shallower stash (`parallel.stash_depth`) at (4, 8, 1): each W at
# most a tick after its B; the other cases defer as long as aligning the stages needs
DEPTH = {CASES[3]: 1}


def _configs(case, schedule: str = "1f1b"):
    s, d, n, r, m, attention, experts = case
    run = on_ragged_dot(piped.pipelined(s, d, n, m, r, attention, experts))
    ref = on_ragged_dot(piped.one_device(m))
    if s * r > 4:
        run = dataclasses.replace(run, model=EIGHT_MOE)
        ref = dataclasses.replace(ref, model=EIGHT_MOE)
    run = _scheduled(run, schedule)
    if schedule == "zero_bubble" and case in DEPTH:
        plan = dataclasses.replace(run.parallel, stash_depth=DEPTH[case])
        run = dataclasses.replace(run, parallel=plan)
    return run, ref


def _label(case) -> str:
    s, d, n, r, m, attention, experts = case
    return f"S{s}xD{d}xN{n},M{m},R{r},{attention}+{experts}"


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble"])
@pytest.mark.parametrize("case", CASES, ids=_label)
def test_loss_gradients_and_three_steps_equal_one_device(case, schedule, monkeypatch):
    config, ref = _configs(case, schedule)
    cut = _recorded_halves(monkeypatch)
    run = planned(config)
    _assert_equal_one_device(run, reference(ref))
    # the table's ticks in one loop (the backward runs inside it), not GPipe's two; with
    # repeats, the drain's ticks in a second, each summing a part of the last repeats'
    # gradients beside backward GEMMs it can overlap, repeat 0's after the loop
    s, m, r = config.parallel.stages, config.parallel.microbatches, config.parallel.repeats
    table = one_f_one_b(s, m, r)
    depth = config.parallel.stash_depth
    sums = loop_sums(zero_bubble(s, m, r, depth) if schedule == "zero_bubble" else table)
    if schedule == "zero_bubble":  # W: one GEMM per weight matrix of the stage's layers,
        if not cut:  # and nothing it exchanges (traced again if the step was cached)
            planned.__wrapped__(config)
        matrices, weight_gemms, collectives = cut[-1]
        assert weight_gemms == matrices and collectives == 0, cut[-1]
    ticks = [table.ticks] if sums is None else [sums.start, table.ticks - sums.start]
    trips = pipeline_trip_counts(run.hlo)
    assert all(trips.count(t) == ticks.count(t) for t in {*ticks, m * r + s - 1}), trips
    looped, after = _sums_beside_the_backward(run.hlo)
    assert after > 0 and (looped > 0) == (sums is not None), (looped, after)


def _recorded_halves(monkeypatch) -> list:
    """Wraps `backward_halves.split` (the pipeline's own) to record, for each cut it
    makes, (the weight matrices of the stage's layers: stacked leaves of rank 3 or
    more, the weight half's GEMMs, its collectives), each scan body counted once."""
    cut, split = [], backward_halves.split

    def recording(fn, weights, *rest):
        input_half, weight_half = split(fn, weights, *rest)
        _, stash = jax.eval_shape(input_half, weights, *rest)
        found = primitives(weight_half, weights, stash)
        gemms = found["dot_general"] + found["ragged_dot_general"]
        exchanged = sum(found[k] for k in ("all_to_all", "psum", "all_gather", "ppermute"))
        matrices = sum(leaf.ndim >= 3 for leaf in jax.tree.leaves(weights))
        cut.append((matrices, gemms, exchanged))
        return input_half, weight_half

    monkeypatch.setattr(backward_halves, "split", recording)
    return cut


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble"])
def test_poisoned_buffers_change_nothing(schedule):
    """Every buffer (zero-bubble's stash too) filled with NaN before anything is written
    into it: what an idle part of a tick would compute on if it read them (against the
    clean run)."""
    config, _ = _configs(CASES[2], schedule)
    config = check_plan(config, jax.device_count())
    layout = mesh_lib.make_layout(config, mesh_lib.make_mesh(config))
    assert layout.pipeline_loss is pipeline_1f1b.run_loss  # whose bubble is 0.0
    poisoned = partial(pipeline_1f1b.run_loss, bubble=math.nan)
    got = run_under(config, dataclasses.replace(layout, pipeline_loss=poisoned))
    want = planned(config)
    for leaf in jax.tree.leaves((got.metrics, got.grads)):
        assert np.isfinite(np.asarray(leaf)).all()
    np.testing.assert_allclose(got.metrics["loss"], want.metrics["loss"], rtol=1e-6)
    canonical = lambda run: pipeline.canonical(run.grads)
    for a, b in zip(jax.tree.leaves(canonical(got)), jax.tree.leaves(canonical(want)), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9)


def test_document_masks_and_loss_weights_as_gpipe():
    """Packed documents (positions restarting per document, loss weights counting only
    targets within one), which the loop gathers per micro-batch: the same loss and
    gradients as GPipe's."""
    from moe_jax.train_step import abstract_state, gradients, init_placed
    from tests.layouts import BASE
    from tests.test_documents import _packed_batch

    def run(schedule: str):
        plan = ParallelConfig(
            attention="sp", experts="ep_a2a", intra=2, data=2, stages=2, microbatches=4,
            schedule=schedule,
        )  # fmt: skip
        model = dataclasses.replace(BASE.model, num_layers=4)
        config = check_plan(dataclasses.replace(BASE, model=model, parallel=plan), 8)
        layout = mesh_lib.make_layout(config, mesh_lib.make_mesh(config))
        layout = dataclasses.replace(layout, documents=True)
        graphdef, abstract = abstract_state(config, layout)
        state = init_placed(config, layout, mesh_lib.train_state_shardings(abstract, layout, 0))
        place = lambda v: jax.device_put(v, mesh_lib.batch_sharding(layout))
        batch = {k: place(v) for k, v in _packed_batch().items()}
        step = jax.jit(lambda state, batch: gradients(state, graphdef, batch, config))
        return jax.device_get(step(state, batch))

    (got, got_grads), (want, want_grads) = run("1f1b"), run("gpipe")
    assert "positions" in _packed_batch()
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-6)
    assert_trees_close(pipeline.canonical(got_grads), pipeline.canonical(want_grads), rtol=1e-5)


def test_bf16_sums_in_the_drain_equal_gpipes_after_its_backward():
    """`grad_exchange='bf16_a2a'` (each device's gradient rounded to bf16 once, summed in
    float32) on 2 stages x 2 data x 2 intra, 4 micro-batches, 2 repeats: the 1F1B drain's
    part-by-part sums (`grad_exchange.summed_whole`) give GPipe's, which exchanges each
    whole gradient after its backward; the drain loop's bf16 all-to-alls run beside
    backward GEMMs they do not touch, each part's float32 shards gathered back."""
    from moe_jax.parallel.scopes import GRAD_EXCHANGE
    from moe_jax.tools import hlo_collectives

    def config(schedule: str):
        plan = piped.pipelined(2, 2, 2, 4, 2)
        parallel = dataclasses.replace(plan.parallel, schedule=schedule, grad_exchange="bf16_a2a")
        return on_ragged_dot(dataclasses.replace(plan, parallel=parallel))

    got, want = planned(config("1f1b")), planned(config("gpipe"))
    np.testing.assert_allclose(got.metrics["loss"], want.metrics["loss"], rtol=1e-6)
    # the stack's partial sums are the same on each device in both schedules (a rare
    # bf16 rounding flips where float32 added the micro-batches in another order); the
    # prefix's and head's are not (1F1B runs every micro-batch's on one stage, GPipe
    # each stage its own), so their single bf16 roundings differ (0.4% here)
    grads = lambda run: pipeline.canonical(run.grads)
    assert_leaves_close_in_norm(grads(got)["moe"], grads(want)["moe"], rtol=1e-3)
    assert_leaves_close_in_norm(grads(got), grads(want), rtol=1e-2)
    exchanged = [c for c in hlo_collectives.parse(got.hlo) if GRAD_EXCHANGE in c.op_name]
    assert {"all-to-all", "all-gather"} <= {c.kind for c in exchanged}
    assert "all-reduce" not in {c.kind for c in exchanged if c.count > 1}  # in the loop: bf16
    looped, _ = _sums_beside_the_backward(got.hlo, kinds=("all-to-all",))
    assert looped > 0
