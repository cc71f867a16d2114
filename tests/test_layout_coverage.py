"""What the layout-equality tests of test_parallel.py do not reach with the base model:
dense MLP layers and shared experts under every attention layout, and bfloat16
compute per layout family against the float32 single-device run."""

from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np
import pytest

from tests.layouts import (
    BASE,
    DENSE,
    assert_trees_close,
    on_ragged_dot,
    planned,
    reference,
    with_plan,
)
from tests.test_parallel import _assert_first_step_matches

# The dense layers, the shared experts and bfloat16 are the subject, not the expert
# kernel: the experts run ragged_dot (tests.layouts.on_ragged_dot), as in
# test_collective_matmul.py, whose plain programs are tp+ep_etp and sp+ep_a2a here
# (the session's compilation cache shares them).
BASE, DENSE = on_ragged_dot(BASE), on_ragged_dot(DENSE)
# Every attention and every expert layout once.
DENSE_PLANS = [("dp", "etp"), ("fsdp", "ep_ag"), ("tp", "ep_etp"), ("sp", "ep_a2a")]


@pytest.mark.parametrize("attention,experts", DENSE_PLANS)
def test_dense_layer_and_shared_experts_match_single_device(attention: str, experts: str):
    run = planned(with_plan(attention, 2, 4, experts, base=DENSE))
    want = reference(DENSE)
    _assert_first_step_matches(run, want)
    got = run.state
    assert_trees_close((got.params, got.biases), (want.state.params, want.state.biases))
    dense_mlp = run.grads["dense"]["units"]["blocks"][0]["ffn"]
    assert {"gate", "up", "down"} <= set(dense_mlp)  # the dense layer is there, as an MLP
    assert "shared" in run.grads["moe"]["units"]["blocks"][0]["ffn"]


BF16 = dataclasses.replace(BASE, model=dataclasses.replace(BASE.model, dtype="bfloat16"))
# One plan per family: data parallel, Megatron (tensor parallel for both blocks), and
# the paper's (sequence-parallel attention, expert-parallel experts) in both EP forms.
BF16_PLANS = [("fsdp", "ep_a2a"), ("tp", "etp"), ("sp", "ep_a2a"), ("sp", "ep_ag")]
# Against the float32 single-device run: the loss within 0.2% (measured 0.06%). Each
# gradient leaf's relative error (Frobenius norm) within 1.25x that of bfloat16 on one
# device, or 1% where that is smaller: bf16 itself moves the router's gradient by
# 9.6% and the experts' by 5-6% (measured, the same on one device and under every
# plan here), so a layout may add rounding but no error of its own.
BF16_LOSS_RTOL, BF16_GRAD_FACTOR, BF16_GRAD_FLOOR = 2e-3, 1.25, 1e-2


def _relative_errors(got, want) -> dict[str, float]:
    errors = {}
    for (path, w), g in zip(jax.tree.leaves_with_path(want), jax.tree.leaves(got), strict=True):
        w, g = np.asarray(w, np.float64), np.asarray(g, np.float64)
        errors[jax.tree_util.keystr(path)] = float(np.linalg.norm(g - w) / np.linalg.norm(w))
    return errors


@pytest.mark.parametrize("attention,experts", BF16_PLANS)
def test_bfloat16_layouts_track_float32_single_device(attention: str, experts: str):
    run, want = planned(with_plan(attention, 2, 4, experts, base=BF16)), reference(BASE)
    for key in ("loss", "lm_loss", "aux_loss", "z_loss"):
        np.testing.assert_allclose(
            run.metrics[key], want.metrics[key], rtol=BF16_LOSS_RTOL, err_msg=key
        )
    own = _relative_errors(reference(BF16).grads, want.grads)
    for leaf, error in _relative_errors(run.grads, want.grads).items():
        assert error <= max(BF16_GRAD_FACTOR * own[leaf], BF16_GRAD_FLOOR), (leaf, error, own[leaf])


def _reductions(lowered: str) -> list[str]:
    """Element type of every all-reduce in a lowered (StableHLO) program: the type of
    its reduction region's arguments."""
    pattern = r'"stablehlo\.all_reduce".*?\^bb0\(%\w+: tensor<(\w+)>'
    return re.findall(pattern, lowered, flags=re.S)


def _exchange_types(lowered: str) -> set[str]:
    """Element types of the operands of every all-to-all and all-gather."""
    types = set()
    for line in lowered.splitlines():
        if '"stablehlo.all_to_all"' in line or '"stablehlo.all_gather"' in line:
            operands = line.rsplit(" : (", 1)[-1].split(") ->")[0]
            types |= set(re.findall(r"x((?:bf|f|ui|i)\d+)>", operands))
    return types


@pytest.mark.parametrize("attention,experts", BF16_PLANS)
def test_bfloat16_gradients_are_reduced_in_float32(attention: str, experts: str):
    """Weights enter the layouts as stored (float32) and are cast inside, so the gradient
    all-reduces that `shard_map`'s transpose makes run in float32 while the token
    exchanges carry bfloat16. Read from the lowered program: XLA:CPU's compile upcasts
    every bf16 collective to f32, which would hide a bf16 reduction."""
    lowered = planned(with_plan(attention, 2, 4, experts, base=BF16)).lowered
    reductions = _reductions(lowered)
    assert len(reductions) > 2 and set(reductions) <= {"f32", "i32"}, reductions
    assert "bf16" in _exchange_types(lowered)
