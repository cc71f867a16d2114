"""Expert weights split over 'data' (`parallel.expert_fsdp`, ZeRO-3 for experts) and the
vocabulary-parallel embedding, head and loss (`parallel.vocab_parallel`), on 8 forced
CPU devices: the same step as one device, each device storing only its share, and the
compiled program moving what the design says (weights gathered in float32 per layer and
their gradients reduce-scattered; no float32 logits over the whole vocabulary).
"""

from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np
import pytest

from moe_jax.plan.resolve import check_plan
from moe_jax.tools import hlo_collectives
from tests.layouts import BASE as TILED
from tests.layouts import assert_trees_close, on_ragged_dot, planned, reference, with_plan

# Experts run ragged_dot (tests.layouts.on_ragged_dot): where the weights live and what
# moves is the subject, not the expert kernel.
BASE = on_ragged_dot(TILED)
VOCAB = dataclasses.replace(BASE, model=dataclasses.replace(BASE.model, vocab_size=256))


def _with(config, train=None, **parallel):
    train = dataclasses.replace(config.train, **(train or {}))
    return dataclasses.replace(
        config, parallel=dataclasses.replace(config.parallel, **parallel), train=train
    )


def _matches(got, want) -> None:
    for key in ("loss", "lm_loss", "aux_loss", "z_loss"):
        np.testing.assert_allclose(got.metrics[key], want.metrics[key], rtol=1e-5, err_msg=key)
    assert_trees_close(got.grads, want.grads, 1e-5)
    assert_trees_close(jax.device_get(got.state.params), jax.device_get(want.state.params), 1e-4)


def _local_shape(run, *path) -> tuple[int, ...]:
    leaf = run.state.params
    for key in path:
        leaf = leaf[key]
    return leaf.get_value().addressable_shards[0].data.shape


EXPERT_FSDP = [("sp", "ep_a2a", 1), ("dp", "etp", 0), ("fsdp", "ep_ag", 1)]


@pytest.mark.parametrize("attention,experts,zero", EXPERT_FSDP)
def test_expert_fsdp_matches_single_device(attention, experts, zero):
    config = _with(with_plan(attention, 2, 4, experts, BASE, zero), expert_fsdp=True)
    _matches(planned(config), reference(BASE))


def test_expert_fsdp_stores_a_data_share_and_gathers_it_per_layer_in_float32():
    run = planned(_with(with_plan("sp", 2, 4, "ep_a2a", BASE), expert_fsdp=True))
    m, e = BASE.model, BASE.moe
    # 8 experts over 4 'expert' devices, each one's 16 columns over the 2 data groups
    layers = m.num_layers
    assert _local_shape(run, "moe", "units", "blocks", 0, "ffn", "gate") == (
        layers,
        e.num_experts // 4,
        m.embed_dim,
        e.expert_mlp_dim // 2,
    )
    moe = [
        c
        for c in hlo_collectives.parse(run.hlo)
        if "/moe/" in c.op_name and c.role == "param_grad" and c.group_size == 2
    ]
    gathers = [c for c in moe if c.kind == "all-gather" and c.pass_ == "forward"]
    scatters = [c for c in moe if c.kind == "reduce-scatter" and c.pass_ == "backward"]
    # gate, up, down of each layer: gathered whole (f32) before use, gradients scattered
    shard = 3 * (e.num_experts // 4) * m.embed_dim * (e.expert_mlp_dim // 2) * 4
    assert {c.dtype for c in gathers + scatters} == {"f32"}
    assert sum(c.total for c in gathers) == layers * shard  # (g-1)/g of the whole: a shard
    assert sum(c.total for c in scatters) == layers * shard
    # and no expert-weight gradient is all-reduced over the data groups any more
    assert not [c for c in moe if c.kind == "all-reduce" and c.bytes >= shard // 3]


VOCAB_PLANS = [("sp", "ep_a2a", 2, 4, 2), ("dp", "ep_ag", 2, 4, 1), ("tp", "etp", 1, 8, 0)]


@pytest.mark.parametrize("attention,experts,data,intra,chunks", VOCAB_PLANS)
def test_vocab_parallel_matches_single_device(attention, experts, data, intra, chunks):
    config = _with(
        with_plan(attention, data, intra, experts, base=VOCAB),
        train={"loss_chunks": chunks},
        vocab_parallel=True,
    )
    _matches(planned(config), reference(VOCAB))


def test_vocab_parallel_splits_table_and_head_and_never_makes_whole_vocab_logits():
    config = _with(
        with_plan("sp", 2, 4, "ep_a2a", base=VOCAB), train={"loss_chunks": 2}, vocab_parallel=True
    )
    run = planned(config)
    v, d = VOCAB.model.vocab_size, VOCAB.model.embed_dim
    assert _local_shape(run, "embed", "table") == (v // 4, d)
    assert _local_shape(run, "head") == (d, v // 4)
    shapes = set(re.findall(r"f32\[([0-9,]+)\]", run.hlo))
    assert not [s for s in shapes if s.split(",")[-1] == str(v)]  # nothing [.., V] float32
    assert [s for s in shapes if s.split(",")[-1] == str(v // 4)]  # the logits' shards
    loss = [c for c in hlo_collectives.parse(run.hlo) if c.tag == "loss_exchange"]
    assert {c.kind for c in loss} >= {"all-gather", "all-reduce", "reduce-scatter"}
    unsplit = planned(with_plan("sp", 2, 4, "ep_a2a", base=VOCAB))
    assert [s for s in set(re.findall(r"f32\[([0-9,]+)\]", unsplit.hlo)) if s.endswith(str(v))]


@pytest.mark.parametrize(
    "parallel,model,moe,setting",
    [
        ({"vocab_parallel": True}, {}, {}, "model.vocab_size=259"),
        (
            {"vocab_parallel": True, "attention": "dp", "intra": 1, "data": 8},
            {"vocab_size": 256},
            {},
            "parallel.vocab_parallel",
        ),
        # 12 columns split over 4 expert-tensor x 2 data devices do not divide
        (
            {"expert_fsdp": True, "experts": "etp"},
            {},
            {"expert_mlp_dim": 12},
            "parallel.expert_fsdp",
        ),
    ],
)
def test_settings_that_cannot_split_are_rejected_in_one_line(parallel, model, moe, setting):
    base = with_plan("sp", 2, 4, "ep_a2a", BASE)
    base = dataclasses.replace(
        base,
        model=dataclasses.replace(base.model, **model),
        moe=dataclasses.replace(base.moe, **moe),
    )
    with pytest.raises(ValueError, match=re.escape(setting)) as error:
        check_plan(_with(base, **parallel), 8)
    assert "\n" not in str(error.value)
