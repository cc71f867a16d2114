"""`model.remat`: selective recomputation (the paper's SAR) computes what no recomputation
computes, keeps far less, and the memory model predicts what it keeps (8 forced CPU
devices, see conftest.py)."""

from __future__ import annotations

import dataclasses
import re
import runpy

import jax
import pytest

from moe_jax import config as config_lib
from moe_jax.plan import memory
from moe_jax.plan.resolve import check_plan
from tests.layouts import BASE, assert_trees_close, on_ragged_dot, planned, reference, with_plan
from tests.test_plan_memory import _stored, _temp_bytes


def _remat(config, remat: str):
    return dataclasses.replace(config, model=dataclasses.replace(config.model, remat=remat))


@pytest.mark.parametrize("plan", [None, ("sp", "ep_a2a"), ("tp", "ep_ag")], ids=str)
@pytest.mark.parametrize("remat", ["selective", "full"])
def test_recomputation_changes_no_number(plan, remat):
    """Loss, metrics and gradients of the first step equal those without recomputation
    within 1e-6, on one device and under two layouts; the experts multiplied by the GPU
    path's ragged_dot (tests.layouts.on_ragged_dot), whose rows selective recomputation
    keeps (the memory test below runs tiled)."""
    run = reference if plan is None else planned
    base = BASE if plan is None else with_plan(plan[0], 2, 4, plan[1])
    base = on_ragged_dot(base)
    got, want = run(_remat(base, remat)), run(base)
    for key in ("loss", "lm_loss", "aux_loss", "z_loss"):
        assert got.metrics[key] == pytest.approx(want.metrics[key], rel=1e-6), key
    assert_trees_close(got.grads, want.grads, rtol=1e-6)


def _per_layer(config) -> tuple[float, float]:
    """(compiled, predicted) activation bytes of one MoE layer's forward + backward: the
    difference between 4 and 2 scanned layers, halved (see test_plan_memory)."""
    deeper = dataclasses.replace(config, model=dataclasses.replace(config.model, num_layers=4))
    measured = (_temp_bytes(deeper) - _temp_bytes(config)) / 2
    predicted = (_stored(deeper) - _stored(config)) / 2
    return measured, predicted


def test_selective_keeps_40_percent_less_than_none_on_mixtral_tiny_as_predicted():
    raw = runpy.run_path("configs/mixtral_tiny.py")["get_config"]()
    config = check_plan(config_lib.load(raw), jax.device_count())  # sp + ep_a2a, n = 8
    none_measured, none_predicted = _per_layer(_remat(config, "none"))
    selective_measured, selective_predicted = _per_layer(_remat(config, "selective"))
    assert selective_measured <= 0.6 * none_measured
    assert none_predicted == pytest.approx(none_measured, rel=0.15)
    assert selective_predicted == pytest.approx(selective_measured, rel=0.15)


def test_selective_memory_model_counts_only_the_named_tensors():
    """Hand count for BASE under sp + ep_a2a (d=2, n=4), float32, one MoE block: t = 4·16/4
    = 16 tokens of h = 32. Kept: block output and FFN input 2·t·h·4; q, k, v after the
    exchange, 4 sequences of 16 positions, 2 query heads and the kv head repeated up to
    1 per device, of width 8: 4·16·(2 + 2·1)·8·4; the core's output before the exchange
    back 4·16·2·8·4 and logsumexp 4·2·16·4; the out-projection's input t·8·8·4; the
    received rows, n·slots = 4·32, their fc1/fc3 (tile-padded rows R) and fc2."""
    config = _remat(check_plan(with_plan("sp", 2, 4, "ep_a2a"), 8), "selective")
    terms = memory.block_activation_bytes(config, moe=True)
    t, h = 16, 32
    attention = 2 * t * h * 4 + 4 * 16 * 4 * 8 * 4 + (4 * 16 * 2 * 8 * 4 + 4 * 2 * 16 * 4)
    attention += t * 8 * 8 * 4
    rows = terms["expert_hidden"] // (6 * 16 * 4)  # R padded rows of 16 columns, float32
    experts = 4 * 32 * h * 4 + 2 * rows * 16 * 4 + rows * h * 4
    assert memory.selective_block_bytes(config, moe=True) == attention + experts


def test_offload_needs_a_gpu():
    config = _remat(with_plan("sp", 2, 4, "ep_a2a"), "offload")
    with pytest.raises(ValueError, match=re.escape("model.remat='offload'")) as error:
        check_plan(config, 8)
    assert "\n" not in str(error.value)
