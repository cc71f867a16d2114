"""`moe.impl=pallas` inside every expert layout's `shard_map` (8 forced CPU devices,
kernels interpreted): the training step equals one device's, FP8 token exchange
included."""

from __future__ import annotations

import dataclasses

import pytest

from moe_jax.parallel.registry import EXPERTS
from tests.layouts import BASE, assert_trees_close, planned, reference, with_plan

PALLAS = dataclasses.replace(BASE, moe=dataclasses.replace(BASE.moe, impl="pallas"))
LAYOUTS = sorted(name for name, spec in EXPERTS.items() if "cpu" not in spec.platforms_without)


def _assert_same_step(got, want, rtol=1e-5):
    for key in ("loss", "lm_loss", "aux_loss", "z_loss"):
        assert abs(got.metrics[key] - want.metrics[key]) <= rtol * abs(want.metrics[key]), key
    assert (got.metrics["load"] == want.metrics["load"]).all()
    assert_trees_close(got.grads, want.grads, rtol)


@pytest.mark.parametrize("experts", LAYOUTS)
def test_pallas_under_each_expert_layout_matches_one_device(experts: str):
    _assert_same_step(planned(with_plan("sp", 2, 4, experts, base=PALLAS)), reference(BASE))


def test_pallas_with_fp8_token_exchange_matches_the_tiled_kernel():
    """FP8 changes the numbers, so the same exchange with the CPU kernel is the reference."""
    fp8 = lambda base: dataclasses.replace(
        with_plan("sp", 2, 4, "ep_a2a", base=base),
        parallel=dataclasses.replace(with_plan("sp", 2, 4, "ep_a2a").parallel, token_dtype="fp8"),
    )
    _assert_same_step(planned(fp8(PALLAS)), planned(fp8(BASE)), rtol=1e-4)
