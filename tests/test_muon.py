"""Muon (`train.optimizer=muon`, `moe_jax.optimizer.muon`): one matrix's update against a
written-out float64 reference, an expert weight [E, d, f] as E separate matrices, every
parameter of the model families deliberately Muon's or AdamW's, and the train step under
sharded layouts equal to one device."""

from __future__ import annotations

import collections
import dataclasses
import math
import runpy

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from optax.contrib import MuonDimensionNumbers

from moe_jax import config as config_lib
from moe_jax import optimizer
from moe_jax.optimizer import MUON_RMS, muon, muon_dimensions
from moe_jax.parallel import mesh as mesh_lib
from moe_jax.parallel import muon_placement, pipeline
from moe_jax.parallel.layout import axes_of
from moe_jax.plan import muon_cost, planner
from moe_jax.tools import comm_report, hlo_collectives
from moe_jax.train_state import build_model
from moe_jax.train_step import RATE, abstract_state, apply_gradients, with_shardings
from tests.layouts import (
    assert_trees_close,
    on_ragged_dot,
    planned,
    planned_layout,
    planned_program,
    reference,
    with_plan,
)
from tests.pipelined import one_device, pipelined

A, B, C = 3.4445, -4.775, 2.0315  # the quintic Newton-Schulz coefficients
BETA, LR, DECAY = 0.95, 0.5, 0.1
# Logical axes that stack matrices: layers, experts, a pipeline's repeats and layers.
BATCH_AXES = {"layers", "experts", "repeats", "stage_layers"}
# Every other parameter name, each AdamW's on purpose.
ADAMW_NAMES = {"table", "head", "router", "scale"}


def _train_config(**train) -> config_lib.TrainConfig:
    base = config_lib.TrainConfig()
    settings = dict(optimizer="muon", muon_momentum=BETA, weight_decay=DECAY, **train)
    return dataclasses.replace(base, **settings)


def _newton_schulz(g: np.ndarray) -> np.ndarray:
    """Five quintic steps on the Frobenius-normalised matrix (wide side last), float64."""
    x = g.T if g.shape[0] > g.shape[1] else g
    x = x / (np.linalg.norm(x) + 1e-8)
    for _ in range(5):
        a = x @ x.T
        x = A * x + (B * a + C * a @ a) @ x
    return x.T if g.shape[0] > g.shape[1] else x


def _reference_updates(w: np.ndarray, grads: list[np.ndarray]) -> list[np.ndarray]:
    """Muon's updates for weight `w` under successive gradients, float64: Nesterov
    momentum as optax writes it (an exponential average, bias-corrected), Newton-Schulz,
    Moonlight's 0.2 sqrt(max(fan_in, fan_out)), decoupled weight decay, the rate."""
    mu, out = np.zeros_like(w), []
    for t, g in enumerate(grads, start=1):
        mu = BETA * mu + (1 - BETA) * g
        nesterov = BETA * mu / (1 - BETA ** (t + 1)) + (1 - BETA) * g / (1 - BETA**t)
        step = _newton_schulz(nesterov) * MUON_RMS * np.sqrt(max(w.shape))
        update = -LR * (step + DECAY * w)
        out.append(update)
        w = w + update
    return out


def _run(params: dict, grads: list[dict]) -> list[dict]:
    """The updates `muon` makes for `params` under successive `grads`, at rate LR."""
    rule = muon(_train_config(), lambda count: LR)
    state, out = rule.init(params), []
    for g in grads:
        update, state = rule.update(g, state, params)
        params = optax.apply_updates(params, update)
        out.append(update)
    return out


def test_one_matrix_update_equals_a_float64_reference():
    """A [24, 40] matrix (neither square nor symmetric in shape) over three steps, within
    1e-5 of the float64 reference; a norm scale beside it goes to AdamW, untouched by
    Newton-Schulz."""
    rng = np.random.default_rng(0)
    w = rng.normal(size=(24, 40)) / 5
    grads = [rng.normal(size=w.shape) for _ in range(3)]
    scale = np.ones(40)
    params = {"gate": jnp.asarray(w, jnp.float32), "scale": jnp.asarray(scale, jnp.float32)}
    got = _run(
        params, [{"gate": jnp.asarray(g, jnp.float32), "scale": jnp.ones(40)} for g in grads]
    )
    for mine, want in zip(got, _reference_updates(w, grads), strict=True):
        np.testing.assert_allclose(np.asarray(mine["gate"], np.float64), want, rtol=1e-5, atol=1e-6)
    adam = optax.adamw(
        LR, 0.9, 0.95, weight_decay=DECAY, mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)
    )
    first, _ = adam.update(
        {"scale": jnp.ones(40)}, adam.init({"scale": params["scale"]}), {"scale": params["scale"]}
    )
    np.testing.assert_allclose(got[0]["scale"], first["scale"], rtol=1e-6)


def test_an_expert_weight_is_its_experts_matrices():
    """[layers, E, d, f] is layers x E matrices, each orthogonalised on its own: the
    update of the stacked weight equals the stacked updates of the separate matrices."""
    rng = np.random.default_rng(1)
    w = jnp.asarray(rng.normal(size=(2, 3, 16, 24)) / 4, jnp.float32)
    grads = [jnp.asarray(rng.normal(size=w.shape), jnp.float32) for _ in range(2)]
    stacked = _run({"up": w}, [{"up": g} for g in grads])
    for layer in range(2):
        for expert in range(3):
            one = _run({"up": w[layer, expert]}, [{"up": g[layer, expert]} for g in grads])
            for mine, alone in zip(stacked, one, strict=True):
                np.testing.assert_allclose(mine["up"][layer, expert], alone["up"], 1e-5, 1e-6)


def _parameters(path: str, **model):
    cfg = config_lib.load(runpy.run_path(path)["get_config"]())
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **model))
    moe = dataclasses.replace(cfg.moe, num_shared_experts=1, shared_mlp_dim=16)
    abstract = nnx.eval_shape(lambda: build_model(dataclasses.replace(cfg, moe=moe)))
    return nnx.state(abstract, nnx.Param)


@pytest.mark.parametrize(
    "path,model,matrices",
    [
        ("configs/mixtral_tiny.py", {}, {"query", "key", "value", "out", "gate", "up", "down"}),
        (
            "configs/mla_tiny.py",
            {"mtp_depth": 1},
            {"query_down", "query_up", "kv_down", "kv_up", "out", "gate", "up", "down", "eh_proj"},
        ),
    ],
)
def test_every_parameter_is_muons_or_adamws_by_its_axes(path, model, matrices):
    """Each parameter name is listed as a Muon matrix or as AdamW's, the model's Muon
    matrices are the ones expected, and a Muon matrix's batch axes (all but the
    reduction and output axes) are exactly its stacking axes."""
    params = _parameters(path, **model)
    dims = muon_dimensions(params)
    is_leaf = lambda x: isinstance(x, nnx.Variable)
    muon_names = set()
    for (where, var), d in zip(
        jax.tree_util.tree_leaves_with_path(params, is_leaf=is_leaf),
        jax.tree.leaves(dims, is_leaf=lambda x: x is None or hasattr(x, "reduction_axis")),
        strict=True,
    ):
        name = where[-1].key
        names = var.get_metadata()["out_sharding"]
        if d is None:
            assert name in ADAMW_NAMES, (name, names)
            continue
        muon_names.add(name)
        matrix = {i % len(names) for i in (*d.reduction_axis, *d.output_axis)}
        batch = {names[i] for i in range(len(names)) if i not in matrix}
        assert batch <= BATCH_AXES and not {names[i] for i in matrix} & BATCH_AXES, (name, names)
    assert muon_names == matrices


# The pipeline tests' model (a dense first layer, four MoE layers, aux losses and
# router biases) under Muon, 2 micro-batches accumulated, its experts on `ragged_dot`
# (the optimizer is no kernel's): the one-device reference.
BASE = on_ragged_dot(
    dataclasses.replace(
        one_device(2),
        train=dataclasses.replace(one_device(2).train, optimizer="muon", weight_decay=DECAY),
    )
)
LAYOUTS = {
    "dp": with_plan("dp", 8, 1, base=BASE),  # every matrix whole on every device
    "tp+etp": with_plan("tp", 2, 4, "etp", base=BASE),
    "tp+ep_etp": with_plan("tp", 2, 4, "ep_etp", base=BASE),
    "sp+ep_a2a,zero=2": with_plan("sp", 2, 4, "ep_a2a", base=BASE, zero=2),
    "fsdp+ep_ag,expert_fsdp": dataclasses.replace(
        with_plan("fsdp", 2, 4, "ep_ag", base=BASE),
        parallel=dataclasses.replace(
            with_plan("fsdp", 2, 4, "ep_ag", base=BASE).parallel, expert_fsdp=True
        ),
    ),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_equals_one_device(name):
    """Loss, every gradient and the parameters after three Muon steps within 1e-5 of one
    device: a matrix split over devices is updated as the whole matrix (the update runs
    on the global arrays; XLA gathers what Newton-Schulz multiplies)."""
    run, ref = planned(LAYOUTS[name]), reference(BASE)
    np.testing.assert_allclose(run.metrics["loss"], ref.metrics["loss"], rtol=1e-5)
    assert_trees_close(run.grads, ref.grads, rtol=1e-5)
    assert_trees_close(jax.device_get(run.state.params), jax.device_get(ref.state.params), 1e-5)


def test_two_stage_pipeline_equals_one_device():
    """2 stages under 1F1B, 2 micro-batches: the stacked weights held as the pipeline
    holds them are still each layer's own matrices (their leading axes are batch axes)."""
    plan = dataclasses.replace(pipelined(2, 1, 4, 2).parallel, schedule="1f1b")
    train = dataclasses.replace(BASE.train, grad_accum=1)
    run = planned(dataclasses.replace(BASE, train=train, parallel=plan))
    ref = reference(BASE)
    np.testing.assert_allclose(run.metrics["loss"], ref.metrics["loss"], rtol=1e-5)
    assert_trees_close(pipeline.canonical(run.grads), ref.grads, rtol=1e-5)
    after = jax.device_get(pipeline.canonical(run.state.params))
    assert_trees_close(after, jax.device_get(ref.state.params), 1e-5)


def _collectives(hlo: str) -> collections.Counter:
    """Executions per step of each kind of collective in a compiled program."""
    counts = collections.Counter()
    for c in hlo_collectives.parse(hlo):
        counts[c.kind] += c.count
    return counts


def _exchanges(config) -> int:
    """The Muon exchanges `muon_placement` plans for `config`'s weights, per update: one
    in per mesh axis taken off a matrix dimension (an all-to-all, or an all-gather where
    the axis divides no stacking dimension), one out per all-to-all (where the axis was
    only dropped, each device slices its part of the whole update)."""
    config, layout = planned_layout(config)
    _, state = abstract_state(config, layout)
    placed = muon_placement.of_state(state, layout, muon_dimensions)
    total = 0
    for p in jax.tree.leaves(placed, is_leaf=lambda x: isinstance(x, muon_placement.Placement)):
        total += sum(1 + (move.stack is not None) for move in p.moves)
    return total


# apply_gradients computes the update twice: once to check the new parameters are
# finite, once in the donated buffers.
UPDATES_PER_STEP = 2


@pytest.mark.parametrize("name", ["tp+etp", "fsdp+ep_ag,expert_fsdp"])
def test_newton_schulz_adds_no_collective_per_step(name, monkeypatch):
    """The compiled step's collectives do not depend on the number of Newton-Schulz
    steps (each matrix is whole where they run), and Muon adds to AdamW's step only the
    exchanges in and out that `muon_placement` plans for each weight, of the bytes
    `comm_report` predicts for them (`moe_jax.plan.muon_cost`)."""
    config = LAYOUTS[name]
    adamw = dataclasses.replace(config, train=dataclasses.replace(config.train, optimizer="adamw"))
    hlo = planned(config).hlo  # the equality test's program
    five = _collectives(hlo)
    resolved, _ = planned_layout(config)
    muon = comm_report.summarize(resolved, hlo_collectives.parse(hlo))[
        "muon_exchange_bytes_per_step"
    ]
    assert muon["measured"] == muon["predicted"] > 0, muon
    extra = five.total() - _collectives(planned_program(adamw)).total()
    monkeypatch.setattr(optimizer, "NS_STEPS", 1)
    assert _collectives(planned_program(config)) == five
    assert 0 < extra <= UPDATES_PER_STEP * _exchanges(config), (five, extra)


@pytest.mark.parametrize(
    "shape,spec",
    [
        ((2, 4, 8, 12), P(None, "expert", ("data", "tensor"), None)),  # both onto the stack
        ((1, 2, 8, 12), P(None, None, ("data", "tensor"), "expert")),  # data gathered
    ],
)
def test_placement_moves_each_axis_explicitly(shape, spec):
    """A weight split over two mesh axes on one matrix dimension (and one on the stack,
    or the other matrix dimension), on 2 x 2 x 2 devices: the function `Placement.run`
    applies sees whole matrices (a per-matrix X X^T X equals the float64 one of the whole
    weight), and the program's only collectives are the moves `muon_cost.exchange_sent`
    counts, of its bytes (an axis that divides no stacking dimension gathered, its way
    back a slice): no resharding left to XLA's partitioner."""
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("data", "expert", "tensor"))
    x = np.random.default_rng(2).normal(size=shape).astype(np.float32)
    dims = MuonDimensionNumbers((-2,), (-1,))
    place = muon_placement.placements({"w": x}, {"w": NamedSharding(mesh, spec)}, {"w": dims})
    cube = lambda b: jnp.einsum("...ij,...kj,...kl->...il", b, b, b)
    run = jax.jit(lambda a: place["w"].run(cube, a))
    got = run(jax.device_put(x, NamedSharding(mesh, spec)))
    want = np.einsum("...ij,...kj,...kl->...il", *[x.astype(np.float64)] * 3)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)
    hlo = run.lower(jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec)))
    measured = sorted((c.kind, c.bytes) for c in hlo_collectives.parse(hlo.compile().as_text()))
    predicted = muon_cost.exchange_sent(dict(mesh.shape), spec, shape, 2)
    moves = place["w"].moves
    kinds = ["all-gather" if m.stack is None else "all-to-all" for m in moves]
    kinds += ["all-to-all" for m in moves if m.stack is not None]
    sent = [b for b, _ in predicted]
    assert measured == sorted(zip(kinds, sent, strict=True)) and min(sent) > 0


@pytest.mark.parametrize("name", ["tp+etp", "sp+ep_a2a,zero=2"])
def test_planner_counts_the_trainers_muon_work(name):
    """The planner's Muon terms (`moe_jax.plan.muon_cost`) from the trainer's own state
    and placements: moments per parameter as the optimizer's state
    holds them, and per device 5 (4 m^2 n + 2 m^3) FLOPs per m x n matrix (m <= n) of
    the stack's share its whole-matrix placement leaves each device; the compiled
    update's temporaries within 20% of `muon_cost.update_bytes` (tp+etp 1.03x, sp+ep_a2a
    with ZeRO-2 0.92x; dp 1.17x and fsdp+ep_ag 1.11x, measured once, not compiled here).
    The ranking prices both terms under Muon (the exchange where a matrix is split) and
    neither under AdamW, whose elementwise update moves more."""
    config, layout = planned_layout(LAYOUTS[name])
    _, state = abstract_state(config, layout)
    plan = config.parallel
    # the moments: every array of the state but its step counts and Muon's coefficients
    moment = lambda path, x: x.ndim and "ns_coeffs" not in jax.tree_util.keystr(path)
    elements = lambda tree: sum(
        x.size for path, x in jax.tree_util.tree_leaves_with_path(tree) if moment(path, x)
    )
    moments = elements(state.opt_state) / elements(state.params)
    assert muon_cost.moments_per_param(config) == pytest.approx(moments, rel=1e-9)
    placed = muon_placement.of_state(state, layout, muon_dimensions)
    is_place = lambda x: x is None or isinstance(x, muon_placement.Placement)
    is_dims = lambda x: x is None or isinstance(x, MuonDimensionNumbers)
    dims = jax.tree.leaves(muon_dimensions(state.params), is_leaf=is_dims)
    places = jax.tree.leaves(placed, is_leaf=is_place)
    sizes, flops = dict(layout.mesh.shape), 0
    for w, d, place in zip(jax.tree.leaves(state.params), dims, places, strict=True):
        if place is None:
            continue
        fan_in = math.prod(w.shape[a] for a in d.reduction_axis)
        m, n = sorted((fan_in, math.prod(w.shape[a] for a in d.output_axis)))
        batch = w.ndim - len(d.reduction_axis) - len(d.output_axis)
        split = math.prod(sizes[a] for entry in place.whole.spec[:batch] for a in axes_of(entry))
        flops += math.prod(w.shape[:batch]) // split * 5 * (4 * m * m * n + 2 * m**3)
    assert muon_cost.muon_work(config).flops == flops > 0
    # XLA's temporaries of the step's two updates (nothing else compiled; XLA:CPU)
    placed_state = with_shardings(state, mesh_lib.train_state_shardings(state, layout, plan.zero))
    update = lambda s, lr: apply_gradients(config, s, {"loss": s.step * 0.0}, s.params, lr, layout)
    compiled = jax.jit(update, donate_argnums=0).lower(placed_state, RATE).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp == pytest.approx(muon_cost.update_bytes(config), rel=0.2)
    adamw = dataclasses.replace(config, train=dataclasses.replace(config.train, optimizer="adamw"))
    # ranked among the plans of this layout under ZeRO-1 only
    only = dict(attention=(plan.attention,), experts=(plan.experts,), intra=(plan.intra,))
    zero_1 = lambda p: p.parallel.zero == 1
    muon_plan, adamw_plan = (
        planner.rank(
            c, 8, "h100", limit=1, check_memory=False, accept=zero_1, **only
        ).best.cost.breakdown
        for c in (config, adamw)
    )
    assert muon_plan["newton_schulz"] > 0
    # ZeRO-1's parameters as the layout holds them: tp splits the attention matrices
    # over heads, sp + ep_a2a splits only the expert stack (nothing to exchange)
    assert (muon_plan["muon_exchange"] > 0) == (plan.attention == "tp")
    assert muon_plan["optimizer"] < adamw_plan["optimizer"]
    assert not {"newton_schulz", "muon_exchange"} & set(adamw_plan)
