"""Pipeline parallelism (`moe_jax.parallel.pipeline`): the pipelined step against a
single-device run over the same micro-batches (`train.grad_accum=M`), the schedule
read from the compiled program, poisoned bubbles, the intra-node settings inside the
stages, and the refusals (checkpoints and memory: `tests/test_pipeline_state.py`).

The model has a dense first layer (run outside the pipeline, 'stage' folded into the
batch) and four MoE layers, so four stages, or two stages with two repeats, cut it.
"""

from __future__ import annotations

import dataclasses
import math
import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from moe_jax.config import ParallelConfig
from moe_jax.parallel import mesh as mesh_lib
from moe_jax.parallel import pipeline
from moe_jax.parallel.layout import MESH_AXES, STAGE, Layout
from moe_jax.parallel.scopes import PIPELINE
from moe_jax.plan.resolve import check_plan
from moe_jax.tools import hlo_collectives
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


# The schedule is the subject here, not the expert kernel: the GPU path's `ragged_dot`
# (tests.layouts.on_ragged_dot; the pipeline state, training and memory tests run tiled).
def pipelined(*args, **kwargs):
    return on_ragged_dot(piped.pipelined(*args, **kwargs))


def one_device(micro: int):
    return on_ragged_dot(piped.one_device(micro))


# (stage, data, intra, repeats) meshes with M = f S micro-batches: M = S and M = 2 S on 2
# and on 4 stages, R = 2 on the last; the tp+etp cases take the other meshes' M.
MESHES = [((2, 1, 4, 1), (2,)), ((2, 2, 2, 1), (1,)), ((4, 2, 1, 1), (2,))]
MESHES += [((2, 1, 4, 2), (1,))]
CASES = [(*mesh, mesh[0] * f, "sp", "ep_a2a") for mesh, factors in MESHES for f in factors]
CASES += [(2, 2, 2, 1, 4, "tp", "etp"), (2, 1, 4, 2, 2, "tp", "etp"), (4, 2, 1, 1, 4, "tp", "etp")]


def _label(case) -> str:
    s, d, n, r, m, attention, experts = case
    return f"S{s}xD{d}xN{n},M{m},R{r},{attention}+{experts}"


def _run(case):
    s, d, n, r, m, attention, experts = case
    return planned(pipelined(s, d, n, m, r, attention, experts)), reference(one_device(m))


@pytest.mark.parametrize("case", CASES, ids=_label)
def test_loss_gradients_and_three_steps_equal_one_device(case):
    _assert_equal_one_device(*_run(case))


def test_capacity_drops_are_decided_per_micro_batch():
    """With capacity factor 0.75, tokens over an expert's capacity are dropped within each
    micro-batch, as the one-device run over the same micro-batches drops them (`tp+etp`
    in one data group, whose capacity is the whole micro-batch's: the single-device
    definition, `tests/test_capacity_layouts.py`)."""
    moe = dataclasses.replace(MODEL.moe, capacity_factor=0.75)
    config = dataclasses.replace(pipelined(2, 1, 4, 4, 1, "tp", "etp"), moe=moe)
    ref = reference(dataclasses.replace(one_device(4), moe=moe))
    run = planned(config)
    assert float(ref.metrics["dropped_fraction"]) > 0
    np.testing.assert_allclose(
        run.metrics["dropped_fraction"], ref.metrics["dropped_fraction"], rtol=1e-6
    )
    _assert_equal_one_device(run, ref)


def _assert_equal_one_device(run, ref) -> None:
    # the same experts chosen for every token: per-layer loads agree exactly
    np.testing.assert_array_equal(run.metrics["load"], ref.metrics["load"])
    for name in ("loss", "lm_loss", "aux_loss", "seq_aux_loss", "z_loss"):
        np.testing.assert_allclose(run.metrics[name], ref.metrics[name], rtol=1e-5, err_msg=name)
    assert_trees_close(pipeline.canonical(run.grads), ref.grads, rtol=1e-5)
    after = jax.device_get(pipeline.canonical(run.state.params))
    assert_trees_close(after, jax.device_get(ref.state.params), rtol=1e-5)
    assert_trees_close(jax.device_get(run.state.biases), jax.device_get(ref.state.biases), 1e-5)


def test_poisoned_bubbles_change_nothing():
    """Buffers filled with NaN before anything is written into them: what a bubble tick
    would compute on if it read them. Against the clean run of the same plan (zeros, the
    default), a program of `CASES`."""
    config = check_plan(pipelined(2, 1, 4, 2, 2), jax.device_count())
    layout = mesh_lib.make_layout(config, mesh_lib.make_mesh(config))
    assert layout.pipeline_run is pipeline.run  # whose bubble is 0.0
    poisoned = dataclasses.replace(layout, pipeline_run=partial(pipeline.run, bubble=math.nan))
    got, want = run_under(config, poisoned), planned(pipelined(2, 1, 4, 2, 2))
    for leaf in jax.tree.leaves((got.metrics, got.grads)):
        assert np.isfinite(np.asarray(leaf)).all()
    assert_trees_close((got.metrics, got.grads), (want.metrics, want.grads), rtol=1e-6)


# --- the schedule, on a stage-only mesh with layers whose order shows ----------------


def _toy_layout(stages: int, micro: int, repeats: int) -> Layout:
    devices = np.asarray(jax.devices()[:stages]).reshape(stages, 1, 1, 1)
    mesh = Mesh(devices, MESH_AXES)
    return Layout(mesh=mesh, pipeline_run=pipeline.run, microbatches=micro, repeats=repeats)


def _affine_group(params, rest, x, positions):
    """Each layer x -> x * a + b + shift: composing them in the wrong order (or twice)
    changes the result. Stats: one call per layer and micro-batch."""

    def layer(x, p):
        a, b, shift = p
        y = jnp.tanh(x * a + b + shift)
        return y, {"calls": jnp.ones((), jnp.float32), "mean": y.mean()}

    return jax.lax.scan(layer, x, (params["a"], params["b"], rest["shift"]))


def _toy(stages: int, micro: int, repeats: int, units: int):
    layout = _toy_layout(stages, micro, repeats)
    rng = np.random.default_rng(stages * 100 + micro * 10 + repeats)
    a = rng.uniform(0.5, 1.5, (units, 3)).astype(np.float32)
    b = rng.normal(size=(units, 3)).astype(np.float32)
    shift = rng.normal(size=(units, 3)).astype(np.float32)
    x = rng.normal(size=(micro * 2, 1, 3)).astype(np.float32)  # M micro-batches of 2 rows
    positions = np.zeros((micro * 2 // stages, 1), np.int32)

    def staged(p):  # [U, ...] -> [R, U / R, ...], as the model holds it (R = 1: as is)
        return p if repeats == 1 else p.reshape(repeats, units // repeats, *p.shape[1:])

    spec = P(STAGE) if repeats == 1 else P(None, STAGE)

    def loss(a, b, shift, x):
        def body(a, b, shift, x):
            y, stats = pipeline.run(
                layout, _affine_group, {"a": a, "b": b}, {"shift": shift}, x, positions
            )
            total = jax.lax.psum((y**2).sum(), STAGE)
            return total, stats

        return jax.shard_map(
            body,
            mesh=layout.mesh,
            in_specs=(spec, spec, P(), P(STAGE)),
            out_specs=(P(), P()),
        )(a, b, shift, x)

    def sequential(a, b, shift, x):
        def layer(x, p):
            return jnp.tanh(x * p[0] + p[1] + p[2]), None

        y = jax.vmap(lambda row: jax.lax.scan(layer, row, (a, b, shift))[0])(x.reshape(-1, 3))
        return (y**2).sum()

    args = (staged(jnp.asarray(a)), staged(jnp.asarray(b)), jnp.asarray(shift), jnp.asarray(x))
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    compiled = step.lower(*args).compile()
    (total, stats), grads = compiled(*args)
    want, want_grads = jax.value_and_grad(sequential, argnums=(0, 1))(a, b, shift, x)
    return layout, compiled.as_text(), total, stats, grads, want, want_grads, staged


SCHEDULES = [(2, 2, 1), (2, 4, 1), (4, 4, 1), (8, 8, 1), (2, 2, 2), (2, 4, 3), (4, 8, 2)]


@pytest.mark.parametrize("stages,micro,repeats", SCHEDULES)
def test_schedule_runs_every_layer_in_order_on_every_micro_batch(stages, micro, repeats):
    units = stages * repeats * 2
    _, hlo, total, stats, grads, want, want_grads, staged = _toy(stages, micro, repeats, units)
    np.testing.assert_allclose(total, want, rtol=1e-5)
    for got, expected in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(got, staged(expected), rtol=1e-5, atol=1e-6)
    # The loop: M R + S - 1 ticks, forward and backward, read from the compiled program.
    trips = pipeline_trip_counts(hlo)
    assert trips.count(micro * repeats + stages - 1) >= 2, trips
    # Every layer saw each micro-batch once: bubble ticks left no statistics.
    np.testing.assert_allclose(stats["calls"], np.ones(units))
    # Valid (stage, tick) pairs: each valid one ran a group of units / (R S) layers.
    valid = stats["calls"].sum() * micro / (units // (repeats * stages))
    ticks = micro * repeats + stages - 1
    assert valid / (stages * ticks) == pytest.approx(
        pipeline.valid_fraction(stages, micro, repeats)
    )
    assert pipeline.valid_fraction(stages, micro, repeats) == micro * repeats / ticks


def _pairs(attrs: str) -> list[tuple[int, int]]:
    found = re.search(r"source_target_pairs=\{(.*?)\}\}", attrs)
    return [tuple(map(int, p)) for p in re.findall(r"\{(\d+),(\d+)", found.group(0))]


def test_compiled_step_passes_stage_to_stage_and_never_gathers_over_stages():
    stages, data, intra, micro = 2, 2, 2, 4
    run, _ = _run((stages, data, intra, 1, micro, "sp", "ep_a2a"))
    per_stage = data * intra
    stage_of = lambda device: device // per_stage
    instructions = hlo_collectives.instructions(run.hlo)
    permutes = [i for i in instructions if i.opcode.startswith("collective-permute")]
    piped = [i for i in permutes if PIPELINE in i.op_name]
    assert piped
    for ins in piped:  # between stages, each device to its own place in the other stage
        for source, target in _pairs(ins.attrs):
            assert stage_of(source) != stage_of(target)
            assert source % per_stage == target % per_stage
    # the ring inside the loops: the forward sends s -> s + 1, the backward s + 1 -> s
    trips = pipeline_trip_counts(run.hlo)
    assert trips.count(micro + stages - 1) >= 2, trips
    for ins in instructions:
        if ins.opcode.startswith("all-gather"):
            groups = re.search(r"replica_groups=(\S+)", ins.attrs).group(1)
            members = [list(map(int, g.split(","))) for g in re.findall(r"\{([\d,]+)\}", groups)]
            for group in members:
                assert len({stage_of(d) for d in group}) == 1, ins.op_name


def test_overlap_and_compression_run_inside_the_stages():
    """Expert blocks in 2 chunks, collective-matmul rings, FP8 token exchange, bf16
    gradient all-to-alls summed in float32 and ZeRO-1, all inside a 2-stage pipeline:
    the same settings without a pipeline (the same intra group, `grad_accum=M`) within
    the bf16 sums' rounding, and the token and gradient exchanges sent as FP8 and bf16
    (read from the lowered program)."""
    from moe_jax.parallel.scopes import GRAD_EXCHANGE, TOKEN_EXCHANGE
    from moe_jax.tools import lowered_dtypes

    settings = dict(
        zero=1,
        overlap_chunks=2,
        collective_matmul=True,
        token_dtype="fp8",
        grad_exchange="bf16_a2a",
    )
    train = dataclasses.replace(MODEL.train, batch_size=32)  # 2 sequences per chunked device
    piped = pipelined(2, 2, 2, 4)
    piped = dataclasses.replace(
        piped, train=train, parallel=dataclasses.replace(piped.parallel, **settings)
    )
    flat = dataclasses.replace(one_device(4), train=dataclasses.replace(train, grad_accum=4))
    plan = ParallelConfig(attention="sp", experts="ep_a2a", intra=2, data=4, **settings)
    run, want = planned(piped), planned(dataclasses.replace(flat, parallel=plan))
    np.testing.assert_allclose(run.metrics["loss"], want.metrics["loss"], rtol=1e-5)
    np.testing.assert_array_equal(run.metrics["load"], want.metrics["load"])
    assert_leaves_close_in_norm(pipeline.canonical(run.grads), want.grads, rtol=1e-2)
    sent = lowered_dtypes.as_sent(hlo_collectives.parse(run.hlo), run.lowered)
    sums = [c for c in sent if GRAD_EXCHANGE in c.op_name and c.kind == "all-to-all"]
    assert sums and all(c.dtype == "bf16" for c in sums)
    tokens = [c for c in sent if TOKEN_EXCHANGE in c.op_name and c.kind == "all-to-all"]
    assert any(c.dtype in ("u8", "f8e4m3fn") for c in tokens)  # the one-byte payload


def test_pipelines_the_trainer_cannot_run_are_refused_in_one_line():
    from moe_jax.parallel import registry

    def problems(stages, micro, repeats=1, accum=1):
        config = pipelined(stages, 1, 8 // stages, micro, repeats)
        train = dataclasses.replace(config.train, grad_accum=accum)
        return registry.pipeline_problems(dataclasses.replace(config, train=train))

    assert problems(2, 4, 2) == [] and problems(4, 8) == []
    (layers,) = problems(2, 4, 4)
    assert "parallel.stages * parallel.repeats = 8 must divide the 4 pipelined units" in layers
    (micro,) = problems(2, 3)
    assert "parallel.microbatches=3 must be a multiple of parallel.stages=2" in micro
    (accum,) = problems(2, 4, accum=2)
    assert "train.grad_accum=2 must be 1 under a pipeline" in accum
