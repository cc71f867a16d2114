"""The ragged all-to-all expert layout.

XLA:CPU does not implement `ragged_all_to_all`, so on CPU the index arithmetic
is checked against numpy (hand-made routings pushed through a numpy model of
the op's documented semantics), the program is lowered (not run), and the
whole layout runs with the op replaced by an emulation built from all_to_all.
The same comparisons with the real op run on GPU/TPU.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax.config import MoEConfig
from moe_jax.moe import dispatch as dsp
from moe_jax.moe.block import MoEParams, moe_forward
from moe_jax.moe.experts import ExpertWeights
from moe_jax.moe.routing import Routing
from moe_jax.parallel import mesh as mesh_lib
from moe_jax.parallel import registry
from moe_jax.parallel.expert_parallel import EP_A2A
from moe_jax.parallel.ragged_exchange import (
    EP_A2A_RAGGED,
    NAME,
    receive_bound,
    received_experts,
    send_header,
)
from moe_jax.plan.resolve import check_plan
from tests.layouts import BASE as TILED
from tests.layouts import loss_and_grads, on_ragged_dot, reference, with_plan
from tests.test_parallel import MESHES

on_cpu = jax.default_backend() == "cpu"
needs_device = pytest.mark.skipif(on_cpu, reason="XLA:CPU does not implement ragged_all_to_all")
# The GPU path's kernel behind the ragged exchange (tests.layouts.on_ragged_dot): the
# exchange is the subject here, not the expert kernel.
BASE = on_ragged_dot(TILED)
needs_8 = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")
EXCHANGES = [
    pytest.param(False, marks=needs_device, id="device"),
    pytest.param(True, id="emulated"),
]


def test_name_is_not_taken():
    assert NAME not in registry.EXPERTS or registry.EXPERTS[NAME] is EP_A2A_RAGGED


def test_send_header_by_hand():
    sizes, offsets, header = send_header(jnp.array([2, 0, 3, 1]), 2)
    np.testing.assert_array_equal(sizes, [2, 4])
    np.testing.assert_array_equal(offsets, [0, 2])
    np.testing.assert_array_equal(header, [[2, 0, 0], [3, 1, 2]])


def test_received_experts_by_hand():
    expert, present = received_experts(jnp.array([[2, 0], [1, 1]]), 3)
    np.testing.assert_array_equal(present, [1, 1, 0, 1, 1, 0])
    np.testing.assert_array_equal(expert, [0, 0, 0, 0, 1, 0])


@pytest.mark.parametrize(
    "top_k,local,capacity_factor,expected",
    [(2, 1, 0.0, 10), (2, 4, 0.0, 20), (6, 4, 0.0, 40), (2, 4, 1.0, 12)],
)
def test_receive_bound(top_k, local, capacity_factor, expected):
    """T * min(k, L); in capacity mode at most L * capacity (T=10, E=8: capacity 3)."""
    cfg = MoEConfig(num_experts=8, top_k=top_k, capacity_factor=capacity_factor)
    assert receive_bound(10, cfg, local) == expected


def _np_ragged_all_to_all(operands, outputs, input_offsets, send_sizes, output_offsets, recv):
    """The op's documented semantics, one slice per device, over per-device numpy arrays."""
    results = [np.array(o) for o in outputs]
    for src, operand in enumerate(operands):
        for dst, result in enumerate(results):
            size, start, at = (
                send_sizes[src][dst],
                input_offsets[src][dst],
                output_offsets[src][dst],
            )
            assert size == recv[dst][src]
            assert start + size <= len(operand) and at + size <= len(result)
            result[at : at + size] = operand[start : start + size]
    return results


def _round_trip(expert_index: np.ndarray, keep: np.ndarray, num_experts: int):
    """Push [n, T, k] routings through the dispatcher's plan with numpy collectives;
    check every assignment reaches its expert and comes back to its buffer row."""
    n, tokens, k = expert_index.shape
    local = num_experts // n
    bound = receive_bound(tokens, MoEConfig(num_experts=num_experts, top_k=k), local)
    layouts, payloads, plans = [], [], []
    for dev in range(n):
        routing = Routing(
            expert_index=jnp.asarray(expert_index[dev], jnp.int32),
            weights=jnp.ones((tokens, k)),
            keep=jnp.asarray(keep[dev]),
            logits=jnp.zeros((tokens, num_experts)),
            probs=jnp.zeros((tokens, num_experts)),
        )
        layout = dsp.sorted_layout(routing, num_experts)
        row = np.asarray(layout.row)
        payload = np.full((tokens * k, 3), -1)
        for t, j in zip(*np.nonzero(keep[dev]), strict=True):
            payload[row[t, j]] = (dev, t, expert_index[dev, t, j])
        layouts.append(row)
        payloads.append(payload)
        plans.append([np.asarray(a) for a in send_header(layout.group_sizes, n)])
    sizes, offsets, headers = zip(*plans, strict=True)
    received = [np.stack([headers[s][d] for s in range(n)]) for d in range(n)]
    counts = [h[:, :local] for h in received]
    recv_sizes = [c.sum(1) for c in counts]
    empty = [np.full((n * bound, 3), -1)] * n
    regions = [np.full(n, dev * bound) for dev in range(n)]
    rows = _np_ragged_all_to_all(payloads, empty, offsets, sizes, regions, recv_sizes)
    for dev in range(n):
        expert, present = map(np.asarray, received_experts(jnp.asarray(counts[dev]), bound))
        np.testing.assert_array_equal(present, rows[dev][:, 0] >= 0)
        np.testing.assert_array_equal(rows[dev][present, 2], dev * local + expert[present])
        sent = [
            (s, t, expert_index[s, t, j])
            for s in range(n)
            for t, j in zip(*np.nonzero(keep[s]), strict=True)
        ]
        want = [assignment for assignment in sent if assignment[2] // local == dev]
        assert Counter(map(tuple, rows[dev][present])) == Counter(want)
    starts = [np.arange(n) * bound] * n
    their = [h[:, local] for h in received]
    blank = [np.full((tokens * k, 3), -1)] * n
    back = _np_ragged_all_to_all(rows, blank, starts, recv_sizes, their, sizes)
    for dev in range(n):
        np.testing.assert_array_equal(back[dev], payloads[dev])


def _distinct_choices(rng, n: int, tokens: int, k: int, num_experts: int) -> np.ndarray:
    return np.stack(
        [[rng.choice(num_experts, k, replace=False) for _ in range(tokens)] for _ in range(n)]
    )


ROUTINGS = {
    # name: (expert_index [n, T, k], keep or None, num_experts)
    "by_hand": (np.array([[[0, 1], [2, 3], [1, 2]], [[3, 2], [3, 0], [1, 3]]]), None, 4),
    "all_to_device_0": (np.tile([0, 1], (4, 5, 1)), None, 8),  # fills device 0's bound
    "one_expert_each": (np.tile([7, 6], (8, 3, 1)), None, 8),  # L=1: devices 6, 7 full
    "random": (_distinct_choices(np.random.default_rng(0), 4, 9, 3, 8), None, 8),
    "with_drops": (
        _distinct_choices(np.random.default_rng(1), 4, 6, 2, 8),
        np.random.default_rng(2).random((4, 6, 2)) < 0.6,
        8,
    ),
}


@pytest.mark.parametrize("name", ROUTINGS)
def test_exchange_plan_round_trip(name: str):
    expert_index, keep, num_experts = ROUTINGS[name]
    keep = np.ones(expert_index.shape, bool) if keep is None else keep
    _round_trip(expert_index, keep, num_experts)


def _emulated_ragged_all_to_all(
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name
):
    """The op from all_to_all, gathers and a scatter (one slice per device), so the
    layout runs where XLA lacks the op; JAX differentiates it like any program."""
    rows = operand.shape[0]
    position = jnp.arange(rows)
    sent = position < send_sizes[:, None]  # [n, rows]
    picked = operand[jnp.minimum(input_offsets[:, None] + position, rows - 1)]
    blocks = jnp.where(sent[..., None], picked, 0)
    blocks = jax.lax.all_to_all(blocks, axis_name, 0, 0, tiled=True)  # block s: from s
    starts = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)
    target = jnp.where(position < recv_sizes[:, None], starts[:, None] + position, output.shape[0])
    # An add into the (zero) buffer: a scatter JAX can also transpose (the FP8 exchange's
    # backward is the transpose of its movement).
    return output.at[target.reshape(-1)].add(blocks.reshape(-1, *operand.shape[1:]), mode="drop")


@pytest.fixture
def exchange(request, monkeypatch):
    if request.param:
        monkeypatch.setattr(jax.lax, "ragged_all_to_all", _emulated_ragged_all_to_all)
    return request.param


def _layout(data: int, intra: int, spec=EP_A2A_RAGGED, attention: str = "dp"):
    config = with_plan(attention, data, intra, "ep_a2a", BASE)
    config = check_plan(config, jax.device_count())
    layout = mesh_lib.make_layout(config, mesh_lib.make_mesh(config))
    return config, dataclasses.replace(layout, expert_spec=spec)


def _assert_close(got, want, rtol=1e-5):
    for (path, a), b in zip(jax.tree.leaves_with_path(got), jax.tree.leaves(want), strict=True):
        scale = float(np.abs(b).max())
        np.testing.assert_allclose(
            a, b, rtol=rtol, atol=rtol * scale, err_msg=jax.tree_util.keystr(path)
        )


@needs_8
@pytest.mark.parametrize("exchange", EXCHANGES, indirect=True)
@pytest.mark.parametrize("attention,data,intra", [("dp", d, n) for d, n in MESHES] + [("sp", 2, 4)])
def test_matches_single_device(exchange, attention: str, data: int, intra: int):
    config, layout = _layout(data, intra, attention=attention)
    loss, metrics, grads = loss_and_grads(config, layout)
    ref = reference(BASE)
    ref_loss, ref_metrics, ref_grads = ref.metrics["loss"], ref.metrics, ref.grads
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for key in ("lm_loss", "aux_loss", "seq_aux_loss", "z_loss"):
        np.testing.assert_allclose(metrics[key], ref_metrics[key], rtol=1e-5, err_msg=key)
    np.testing.assert_array_equal(metrics["load"], ref_metrics["load"])
    _assert_close(grads, ref_grads)


def _moe_params(cfg: MoEConfig, dim: int, bias: jax.Array) -> MoEParams:
    keys = jax.random.split(jax.random.key(3), 4)
    e, f = cfg.num_experts, cfg.expert_mlp_dim
    return MoEParams(
        router=jax.random.normal(keys[0], (dim, e)) / np.sqrt(dim),
        bias=bias,
        experts=ExpertWeights(
            gate=jax.random.normal(keys[1], (e, dim, f)) / np.sqrt(dim),
            up=jax.random.normal(keys[2], (e, dim, f)) / np.sqrt(dim),
            down=jax.random.normal(keys[3], (e, f, dim)) / np.sqrt(f),
        ),
    )


def _block_outputs(layout, cfg: MoEConfig, params: MoEParams, x: jax.Array):
    """The expert block's output, router stats and gradients (params and input)."""

    def loss(params, x):
        y, stats = layout.moe(moe_forward, x, params, cfg)
        value = jnp.mean(jnp.square(y)) + 0.1 * stats.aux_loss() + 0.01 * stats.z_loss
        return value, (y, stats)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)


def _block_config(capacity_factor: float) -> MoEConfig:
    return MoEConfig(
        num_experts=8,
        top_k=2,
        expert_mlp_dim=16,
        capacity_factor=capacity_factor,
        impl=BASE.moe.impl,
    )


BLOCK_MESHES = MESHES if jax.device_count() >= 8 else [(1, jax.device_count())]
BLOCK_CASES = {
    # name: (capacity_factor, bias on the first two experts: 100 sends every token there)
    "balanced": (0.0, 0.0),
    "all_to_two_experts": (0.0, 100.0),
    "capacity": (0.75, 0.0),
}


@pytest.mark.parametrize("exchange", EXCHANGES, indirect=True)
@pytest.mark.parametrize("case", BLOCK_CASES)
@pytest.mark.parametrize("data,intra", BLOCK_MESHES)
def test_matches_padded_exchange(exchange, case: str, data: int, intra: int):
    """Outputs, router stats and gradients equal the padded `ep_a2a`'s, worst-case routing
    (every token to experts 0 and 1: their owners' receive buffers full) and capacity
    drops included."""
    capacity_factor, skew = BLOCK_CASES[case]
    cfg = _block_config(capacity_factor)
    params = _moe_params(cfg, 32, jnp.zeros(8).at[:2].set(skew))
    x = jax.random.normal(jax.random.key(4), (8, 16, 32))
    _, ragged = _layout(data, intra)
    padded = dataclasses.replace(ragged, expert_spec=EP_A2A)
    got, want = _block_outputs(ragged, cfg, params, x), _block_outputs(padded, cfg, params, x)
    _assert_close(got, want)


@pytest.mark.parametrize("exchange", EXCHANGES, indirect=True)
@pytest.mark.parametrize("case", ["balanced", "all_to_two_experts"])
def test_fp8_matches_the_padded_fp8_exchange(exchange, case: str):
    """`parallel.token_dtype='fp8'`: the routed rows are quantised per row as the padded
    exchange quantises them, so outputs and gradients equal the padded `ep_a2a`'s with
    FP8, and differ from the native exchange by E4M3's rounding (the backward is bf16's
    transpose: never FP8)."""
    capacity_factor, skew = BLOCK_CASES[case]
    cfg = _block_config(capacity_factor)
    params = _moe_params(cfg, 256, jnp.zeros(8).at[:2].set(skew))  # two 128-channel blocks
    x = jax.random.normal(jax.random.key(4), (8, 16, 256))
    data, intra = BLOCK_MESHES[-1]
    _, native = _layout(data, intra)
    ragged = dataclasses.replace(native, token_dtype="fp8")
    padded = dataclasses.replace(ragged, expert_spec=EP_A2A)
    got, want = _block_outputs(ragged, cfg, params, x), _block_outputs(padded, cfg, params, x)
    _assert_close(got, want)
    (_, (y, _)), _ = got
    (_, (y_native, _)), _ = _block_outputs(native, cfg, params, x)
    error = np.linalg.norm(y - y_native) / np.linalg.norm(y_native)
    assert 1e-3 < error < 0.1  # rounded, and within E4M3's few percent


def test_fp8_program_sends_bytes_and_scales_ragged():
    """Lowered: the dispatch is two ragged all-to-alls, the E4M3 payload as uint8 and its
    float32 scales (one per row and 128 channels); the combine and both backward
    exchanges stay float32 (the model's dtype here)."""
    config, ragged = _layout(2, 4)
    ragged = dataclasses.replace(ragged, token_dtype="fp8")
    cfg = config.moe
    params = _moe_params(cfg, 256, jnp.zeros(cfg.num_experts))
    x = jax.ShapeDtypeStruct((8, 16, 256), jnp.float32)

    def loss(params, x):
        y, stats = ragged.moe(moe_forward, x, params, cfg)
        return jnp.mean(jnp.square(y)) + stats.aux_loss()

    text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x).as_text()
    operands = re.findall(r"@ragged_all_to_all\(.*\}\s*:\s*\(tensor<([^>]*)>", text)
    assert sorted(operands) == [
        "128x256xf32",
        "128x256xf32",
        "32x256xf32",
        "32x256xui8",
        "32x2xf32",
    ]


def test_program_holds_ragged_exchanges():
    """Lowered (XLA:CPU cannot compile it): two ragged all-to-alls forward and two in
    the backward pass, over the intra groups, and no all-reduce beyond the padded
    exchange's (a buffer typed as replicated would add some, summing cotangents over
    devices)."""
    config, ragged = _layout(2, 4)
    padded = dataclasses.replace(ragged, expert_spec=EP_A2A)
    cfg = config.moe
    params = _moe_params(cfg, config.model.embed_dim, jnp.zeros(cfg.num_experts))
    x = jax.ShapeDtypeStruct((8, 16, config.model.embed_dim), jnp.float32)

    def program(layout) -> str:
        def loss(params, x):
            y, stats = layout.moe(moe_forward, x, params, cfg)
            return jnp.mean(jnp.square(y)) + stats.aux_loss()

        return jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x).as_text()

    ragged_hlo, padded_hlo = program(ragged), program(padded)
    assert ragged_hlo.count("@ragged_all_to_all") == 4
    groups = re.findall(r"@ragged_all_to_all.*replica_groups = dense<(.*?)>", ragged_hlo)
    assert set(groups) == {"[[0, 1, 2, 3], [4, 5, 6, 7]]"}  # the intra groups
    assert ragged_hlo.count("stablehlo.all_reduce") == padded_hlo.count("stablehlo.all_reduce")


@pytest.mark.skipif(not on_cpu, reason="checks the CPU limitation")
def test_cpu_lacks_the_op():
    """If this fails, XLA:CPU gained ragged_all_to_all: run the device tests on CPU."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("expert",))

    def body(x):
        ones = jnp.ones(2, jnp.int32)
        offsets = jnp.arange(2, dtype=jnp.int32)
        return jax.lax.ragged_all_to_all(
            x, jnp.zeros_like(x), offsets, ones, offsets, ones, axis_name="expert"
        )

    spec = jax.sharding.PartitionSpec("expert")
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
    with pytest.raises(Exception, match="`ragged-all-to-all` is not supported by XLA:CPU"):
        fn(jnp.zeros((4, 3)))
