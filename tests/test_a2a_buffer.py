"""Bounded all-to-all buffers (`parallel.a2a_buffer_factor`) on 8 forced CPU devices.

Factor 0 keeps the worst-case buffers (n·t·k rows per device); a factor bounds each
destination's buffer to that multiple of the balanced share t·k/n. The tests check
the bytes that cross the wire, that a routing that fits gives the single-device
run, that a skewed one drops exactly the assignments that do not fit (counted in
`dropped_fraction`), and that the planning models shrink with the buffers.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax import config as config_lib
from moe_jax import trainer
from moe_jax.config import Config, DataConfig, MoEConfig, ParallelConfig, TrainConfig
from moe_jax.metrics import read_rows
from moe_jax.moe import experts
from moe_jax.moe.block import moe_forward
from moe_jax.moe.routing import route
from moe_jax.parallel import mesh as mesh_lib
from moe_jax.parallel.expert_parallel import EP_A2A, buffer_slots, send_slots
from moe_jax.parallel.ragged_exchange import EP_A2A_RAGGED, receive_bound
from moe_jax.plan import comm_volume
from moe_jax.plan.memory import block_activation_bytes
from moe_jax.plan.resolve import check_plan
from moe_jax.tools import comm_report, hlo_collectives
from tests.layouts import BASE, planned, reference, with_plan
from tests.test_parallel import _assert_first_step_matches
from tests.test_ragged_exchange import (
    _assert_close,
    _block_outputs,
    _emulated_ragged_all_to_all,
    _moe_params,
)

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")


def _factor(config: Config, factor: float) -> Config:
    return dataclasses.replace(
        config, parallel=dataclasses.replace(config.parallel, a2a_buffer_factor=factor)
    )


@pytest.mark.parametrize(
    "worst,tokens,local,factor,expected",
    [
        (32, 16, 1, 0.0, 32),  # 0: the worst case, whatever it is
        (32, 16, 1, 2.0, 8),  # n = 8: 2 * 16 * 2 / 8 = 8
        (32, 16, 2, 1.1, 16),  # n = 4: ceil(8.8) = 9, rounded up to 16
        (32, 16, 2, 0.1, 8),  # never below one aligned block
        (32, 16, 1, 100.0, 32),  # never above the worst case
    ],
)
def test_buffer_slots_by_hand(worst, tokens, local, factor, expected):
    cfg = MoEConfig(num_experts=8, top_k=2)
    assert buffer_slots(worst, tokens, cfg, local, factor) == expected


def test_every_buffer_follows_the_factor():
    """The padded buffers, the ragged receive regions and capacity mode's buckets."""
    cfg = MoEConfig(num_experts=8, top_k=2)
    assert (send_slots(64, cfg, 2), send_slots(64, cfg, 2, 1.0)) == (128, 32)
    assert (receive_bound(64, cfg, 2), receive_bound(64, cfg, 2, 1.0)) == (128, 32)
    assert receive_bound(64, cfg, 1, 1.0) == 16  # worst t·min(k, L) = 64, share 16
    capacity = dataclasses.replace(cfg, capacity_factor=1.0)  # 16 slots x 2 experts
    assert (send_slots(64, capacity, 2), send_slots(64, capacity, 2, 0.5)) == (32, 16)


@pytest.mark.parametrize("value", [-1.0, float("inf"), float("nan")])
def test_config_rejects_bad_factors(value):
    with pytest.raises(ValueError, match=r"parallel\.a2a_buffer_factor") as error:
        config_lib.load({"parallel": {"a2a_buffer_factor": value}})
    assert "\n" not in str(error.value)


def _token_exchange(run) -> dict:
    """comm_report's forward activation bytes per layer of a compiled run."""
    return comm_report.summarize(run.config, hlo_collectives.parse(run.hlo))[
        "activation_bytes_per_layer"
    ]


def test_bounded_buffers_send_the_routed_rows():
    """ACCEPTANCE, n = 8: factor 2 sends at most 2.1x the bytes of the routed rows there
    and back (t·k·h·B·(n-1)/n each way), worst-case buffers about n x."""
    config = with_plan("dp", 1, 8, "ep_a2a")
    bounded = _token_exchange(planned(_factor(config, 2.0)))
    worst = _token_exchange(planned(config))
    t, k, h, n, f = 16, BASE.moe.top_k, BASE.model.embed_dim, 8, 7 / 8
    routed = 2 * t * k * h * 4 * f
    assert bounded["measured_token_exchange"] <= 2.1 * routed
    assert worst["measured_token_exchange"] == pytest.approx(n * routed, rel=0.05)
    for a in (bounded, worst):  # the model follows: the same buffers, byte for byte
        assert a["measured_token_exchange"] == a["predicted"]


@pytest.mark.parametrize("data,intra,factor", [(2, 4, 2.0), (1, 8, 4.0)])
def test_routing_that_fits_equals_one_device(data: int, intra: int, factor: float):
    """Buffers of 16 rows (half the worst case) hold every assignment of this routing:
    the step equals the single-device one, as the worst-case buffers do."""
    assert send_slots(16, BASE.moe, BASE.moe.num_experts // intra, factor) == 16
    run = planned(_factor(with_plan("dp", data, intra, "ep_a2a"), factor))
    assert run.metrics["dropped_fraction"] == 0  # the routing fits: nothing dropped
    _assert_first_step_matches(run, reference(BASE))


def test_trainer_warns_when_a_dropless_run_drops(tmp_path, capsys):
    """8 rows per destination where 8 is the mean: some step drops, the log says so."""
    config = dataclasses.replace(
        _factor(with_plan("dp", 2, 4, "ep_a2a"), 0.01),
        train=TrainConfig(batch_size=8, seq_len=16, steps=2, log_every=1, eval_batches=1),
        data=DataConfig(source="synthetic"),
    )
    trainer.run(config, tmp_path)
    rows = [r for r in read_rows(tmp_path / "metrics.jsonl") if "loss" in r]
    warned = [line for line in capsys.readouterr().out.splitlines() if "did not fit" in line]
    assert [r["step"] for r in rows if r["dropped_fraction"] > 0] == [
        int(line.split(":")[0].split()[1]) for line in warned
    ]
    assert warned and "parallel.a2a_buffer_factor" in warned[0]


def _skewed_params(cfg: MoEConfig, dim: int):
    """Every token picks expert 0 (the bias wins selection), its second choice by the
    random router; combine weights stay the router's, all different."""
    return _moe_params(cfg, dim, jnp.zeros(cfg.num_experts).at[0].set(100.0))


def _kept(expert_index: np.ndarray, weights: np.ndarray, local: int, slots: int) -> np.ndarray:
    """Per destination, the `slots` best-weighted assignments (ties to the earlier one) of
    one device's [t, k] routing: what fits its buffers."""
    owner, flat = (expert_index // local).reshape(-1), weights.reshape(-1)
    order = np.lexsort((np.arange(flat.size), -flat, owner))
    rank = np.empty(flat.size, int)
    for dest in np.unique(owner):
        mine = order[owner[order] == dest]
        rank[mine] = np.arange(mine.size)
    return (rank < slots).reshape(expert_index.shape)


def _block_layout(data: int, intra: int, factor: float, spec=EP_A2A):
    config = check_plan(_factor(with_plan("dp", data, intra, "ep_a2a"), factor), 8)
    layout = mesh_lib.make_layout(config, mesh_lib.make_mesh(config))
    return dataclasses.replace(layout, expert_spec=spec)


@pytest.mark.parametrize("data,intra", [(1, 8), (2, 4)])
def test_overflow_drops_exactly_what_does_not_fit(data: int, intra: int):
    """All 16 tokens of each device send expert 0's owner a row, which has room for 8
    (factor 1: 16·2/n rounded up to 8 rows): the 8 best-weighted keep theirs, the rest
    are dropped like capacity drops (no contribution), counted in dropped_fraction; the
    output equals the single-device block with exactly those assignments removed."""
    cfg = MoEConfig(num_experts=8, top_k=2, expert_mlp_dim=16)
    params = _skewed_params(cfg, 32)
    x = jax.random.normal(jax.random.key(4), (8, 16, 32))
    (_, (y, stats)), grads = _block_outputs(_block_layout(data, intra, 1.0), cfg, params, x)
    local, t = cfg.num_experts // intra, 16
    slots = send_slots(t, cfg, local, 1.0)
    assert slots == 8
    tokens = x.reshape(-1, 32)
    routing = route(tokens, params.router, params.bias, cfg)
    index, weights = np.asarray(routing.expert_index), np.asarray(routing.weights)
    assert (index[:, 0] == 0).all()  # the skew: every token's first choice is expert 0
    shards = [slice(d * t, (d + 1) * t) for d in range(8)]  # device d: sequence d
    kept = np.concatenate([_kept(index[s], weights[s], local, slots) for s in shards])
    assert kept[index // local == 0].sum() == 8 * slots  # expert 0's owner: full
    np.testing.assert_allclose(stats.dropped_fraction, 1 - kept.mean(), atol=1e-7)
    assert stats.dropped_fraction >= 0.25
    dropped = dataclasses.replace(
        routing, keep=jnp.asarray(kept), weights=jnp.where(kept, routing.weights, 0.0)
    )
    want = experts.dense(tokens, dropped, params.experts, cfg).reshape(x.shape)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))
    assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads))


def test_ragged_form_bounds_its_regions_the_same_way(monkeypatch):
    """ep_a2a_ragged (its op emulated on CPU) with the same factor drops the same
    assignments as the padded form: equal outputs, statistics and gradients."""
    monkeypatch.setattr(jax.lax, "ragged_all_to_all", _emulated_ragged_all_to_all)
    cfg = MoEConfig(num_experts=8, top_k=2, expert_mlp_dim=16)
    params = _skewed_params(cfg, 32)
    x = jax.random.normal(jax.random.key(4), (8, 16, 32))
    ragged = _block_layout(2, 4, 2.0, EP_A2A_RAGGED)
    padded = dataclasses.replace(ragged, expert_spec=EP_A2A)
    got, want = _block_outputs(ragged, cfg, params, x), _block_outputs(padded, cfg, params, x)
    assert got[0][1][1].dropped_fraction > 0
    _assert_close(got, want)


def test_ragged_receive_buffer_is_the_bound():
    """Lowered with the real op (XLA:CPU cannot run it): the forward receive buffer holds
    n·B rows, B = the bounded region (factor 2 at n = 4: 2 x 16 tokens x 2 / 4 = 16)."""
    cfg = MoEConfig(num_experts=8, top_k=2, expert_mlp_dim=16)
    params = _skewed_params(cfg, 32)
    x = jax.ShapeDtypeStruct((8, 16, 32), jnp.float32)

    def rows(factor: float) -> set[str]:
        layout = _block_layout(2, 4, factor, EP_A2A_RAGGED)
        forward = lambda params, x: layout.moe(moe_forward, x, params, cfg)[0]
        text = jax.jit(forward).lower(params, x).as_text()
        return set(re.findall(r"@ragged_all_to_all\(.*\) -> tensor<(\d+)x32xf32>", text))

    assert rows(2.0) == {str(4 * 16), "32"}  # there: [n·B, h]; back: the t·k send rows
    assert rows(0.0) == {str(4 * 32), "32"}  # worst case B = t·min(k, L) = 32


def _memory_config(factor: float, experts_layout: str = "ep_a2a") -> Config:
    """t = 128 tokens per device, k = 2, n = 8: worst 256 rows per destination, balanced
    share 32 (large enough that the alignment to 8 rows does not round)."""
    config = dataclasses.replace(
        BASE,
        moe=dataclasses.replace(BASE.moe, impl="ragged_dot"),  # rows as they are, no tiles
        train=TrainConfig(batch_size=8, seq_len=128),
        parallel=ParallelConfig(
            attention="dp", experts=experts_layout, intra=8, data=1, a2a_buffer_factor=factor
        ),
    )
    config_lib.validate(config)
    return config


def test_memory_and_bytes_models_shrink_with_the_buffers():
    """Factor 2 at n = 8: each destination's buffer is 2·32 of the worst 256 rows, so
    received expert rows, their hidden activations and the padded bytes all shrink 4x;
    the ragged form's regions (worst t·min(k, L) = 128) shrink 2x, its bytes (the routed
    rows) not at all until the bound is below them."""
    worst, bounded = _memory_config(0.0), _memory_config(2.0)
    a, b = block_activation_bytes(worst, True), block_activation_bytes(bounded, True)
    for term in ("expert_rows", "expert_hidden", "exchange"):
        assert a[term] == 4 * b[term], term
    assert a["router"] == b["router"]  # routing is over the same tokens
    padded = comm_volume.activation_bytes(worst).experts
    assert padded == 4 * comm_volume.activation_bytes(bounded).experts
    ragged = {f: _memory_config(f, "ep_a2a_ragged") for f in (0.0, 2.0, 0.5)}
    rows = {f: block_activation_bytes(c, True)["expert_rows"] for f, c in ragged.items()}
    assert rows[0.0] == 2 * rows[2.0] == 8 * rows[0.5]
    sent = {f: comm_volume.activation_bytes(c).experts for f, c in ragged.items()}
    assert sent[0.0] == sent[2.0] == padded / 8
    assert sent[0.5] == padded / 16  # the bound (16 rows per destination) is below t·k/n
