"""The features checkpoints of other families bring (q/k/v biases, per-head and
per-projection q/k norms, a gated shared expert) under parallel layouts, equal to one
device: every layout that slices heads (Ulysses' pairwise ring, tensor parallelism's
kv head of its own) slices their biases and norm scales with them; one that cannot
run a per-projection norm refuses it before compiling."""

from __future__ import annotations

import dataclasses

import pytest

from moe_jax.config import ParallelConfig
from moe_jax.plan.resolve import check_plan
from tests.layouts import BASE as TILED
from tests.layouts import assert_trees_close, on_ragged_dot, planned, reference

# Experts run ragged_dot (tests.layouts.on_ragged_dot): the features are the subject.
BASE = on_ragged_dot(TILED)

QWEN_LIKE = dataclasses.replace(
    BASE,
    model=dataclasses.replace(BASE.model, qkv_bias=True, qk_norm="head"),
    moe=dataclasses.replace(
        BASE.moe, num_shared_experts=1, shared_mlp_dim=24, shared_expert_gate=True
    ),
)
OLMOE_LIKE = dataclasses.replace(
    BASE, model=dataclasses.replace(BASE.model, qkv_bias=True, qk_norm="projection")
)
# (sp + ep_a2a with these features: tests/test_hf_convert.py, on imported models.)
PLANS = {
    # 8 query heads and 2 kv heads over 8 devices: each takes its kv head's bias and norm
    "tp+etp": ParallelConfig(attention="tp", experts="etp", data=1, intra=8),
    # the pairwise ring projects one destination's heads (and kv repeats) a step
    "sp+rings": ParallelConfig(
        attention="sp", experts="ep_a2a", data=1, intra=8, collective_matmul=True
    ),
}


@pytest.mark.parametrize(
    "base,plan",
    [(QWEN_LIKE, name) for name in PLANS],
    ids=lambda v: v if isinstance(v, str) else "qwen",
)
def test_layout_with_the_features_matches_single_device(base, plan: str):
    """First step's loss and every gradient (the biases' included), then the
    parameters after three AdamW steps (within 1e-4 of each leaf's largest value: the
    biases start at zero, and Adam's step on a near-zero gradient magnifies rounding)."""
    got = planned(dataclasses.replace(base, parallel=PLANS[plan]))
    want = reference(base)
    assert abs(float(got.metrics["loss"]) - float(want.metrics["loss"])) < 1e-5
    assert_trees_close(got.grads, want.grads, 1e-5)
    assert_trees_close(got.state.params, want.state.params, 1e-5, atol_scale=1e-4)


@pytest.mark.parametrize(
    "parallel,where",
    [
        (ParallelConfig(attention="tp", data=2, intra=4), "parallel.attention='tp'"),
        (
            ParallelConfig(attention="sp", data=2, intra=4, collective_matmul=True),
            "parallel.collective_matmul",
        ),
    ],
)
def test_a_per_projection_norm_on_split_heads_is_refused_in_one_line(parallel, where: str):
    with pytest.raises(ValueError, match=r"model.qk_norm='projection'") as error:
        check_plan(dataclasses.replace(OLMOE_LIKE, parallel=parallel), 8)
    assert where in str(error.value) and "\n" not in str(error.value)
