"""Model FLOPs per token against a count written out by hand for a tiny model."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from moe_jax.config import ModelConfig, MoEConfig
from moe_jax.flops import active_matmul_params, flops_per_token

MODEL = ModelConfig(
    vocab_size=10,
    num_layers=3,
    embed_dim=8,
    num_heads=2,
    num_kv_heads=1,
    head_dim=4,
    mlp_dim=16,
    first_k_dense=1,
    moe_every=1,
)
MOE = MoEConfig(
    num_experts=4,
    top_k=2,
    expert_mlp_dim=6,
    num_shared_experts=1,
    shared_mlp_dim=5,
)
SEQ = 7


def test_flops_per_token_by_hand():
    """Every term of the Megatron/MaxText convention, written out for d=8, 3 layers, seq 7."""
    d = 8
    # Attention projections per layer: q [8, 2*4], k [8, 1*4], v [8, 1*4], o [2*4, 8].
    attn_per_layer = 8 * 8 + 8 * 4 + 8 * 4 + 8 * 8  # 192
    attention = 3 * attn_per_layer  # all 3 layers have attention: 576
    # One dense layer (first_k_dense=1): SwiGLU gate, up [8, 16] and down [16, 8].
    dense_mlp = 1 * (8 * 16 + 8 * 16 + 16 * 8)  # 384
    # Two MoE layers, each: 2 of 4 routed experts of width 6, one shared expert of width 5,
    # and the router [8, 4].
    routed = 2 * (8 * 6 + 8 * 6 + 6 * 8)  # 288
    shared = 1 * (8 * 5 + 8 * 5 + 5 * 8)  # 120
    router = 8 * 4  # 32
    moe = 2 * (routed + shared + router)  # 880
    head = 8 * 10  # 80
    weights = attention + dense_mlp + moe + head
    assert weights == 1920
    # 6 FLOPs per weight per token (2 forward, 4 backward).
    matmul_flops = 6 * weights  # 11520
    # QK^T and PV: 2 * 2 * heads * head_dim per attended key, (7 + 1) / 2 = 4 keys on
    # average under the causal mask, times 3 for forward + backward, in each of 3 layers.
    attention_flops = 3 * (2 * 2 * 2 * 4) * 4 * 3  # 1152
    expected = matmul_flops + attention_flops
    assert expected == 12672
    assert d * MODEL.vocab_size == head

    assert active_matmul_params(MODEL, MOE) == {
        "attention": 576,
        "dense_mlp": 384,
        "moe": 880,
        "head": 80,
    }
    assert flops_per_token(MODEL, MOE, SEQ) == pytest.approx(expected, rel=0, abs=1e-9)


def test_moe_every_counts_interleaved_dense_layers():
    """With moe_every=2 after one dense layer, 5 layers = 1 dense + 2 x (dense, MoE)."""
    model = dataclasses.replace(MODEL, num_layers=5, moe_every=2)
    params = active_matmul_params(model, MOE)
    assert params["attention"] == 5 * 192
    assert params["dense_mlp"] == 3 * 384
    assert params["moe"] == 2 * 440
    assert params["head"] == 80


def test_top_k_adds_three_matrices_per_extra_expert():
    """Each extra routed expert per token adds 6 * 3 * d * f FLOPs per MoE layer."""
    d, f, num_moe = MODEL.embed_dim, MOE.expert_mlp_dim, MODEL.num_moe_layers
    assert num_moe == 2

    def flops(top_k):
        return flops_per_token(MODEL, dataclasses.replace(MOE, top_k=top_k), SEQ)

    # Doubling top_k from 1 to 2 adds exactly one expert's 3 matrices per MoE layer.
    assert flops(2) - flops(1) == 6 * 3 * d * f * num_moe
    # Doubling from 2 to 4 adds two experts' worth (the count is linear in top_k).
    assert flops(4) - flops(2) == 2 * 6 * 3 * d * f * num_moe
    assert flops(3) - flops(2) == 6 * 3 * d * f * num_moe


def test_inactive_experts_and_lookups_do_not_count():
    """More experts only grow the router; tied embeddings keep the head matmul."""
    more = dataclasses.replace(MOE, num_experts=8)
    extra_router = 6 * MODEL.num_moe_layers * MODEL.embed_dim * 4  # 4 more router columns
    assert flops_per_token(MODEL, more, SEQ) - flops_per_token(MODEL, MOE, SEQ) == extra_router
    tied = dataclasses.replace(MODEL, tie_embeddings=True)
    assert flops_per_token(tied, MOE, SEQ) == flops_per_token(MODEL, MOE, SEQ)


def test_attention_term_grows_with_mean_causal_context():
    """Going from seq 7 to seq 9 adds one key on average: 3 * 4 * heads * head_dim per layer."""
    delta = flops_per_token(MODEL, MOE, 9) - flops_per_token(MODEL, MOE, SEQ)
    assert delta == 3 * 4 * 2 * 4 * 1 * 3


def test_active_params_match_the_model():
    """The counted weights are the model's own matmul weights, with top_k of E experts active."""
    from moe_jax.model.transformer import Transformer

    model = nnx.eval_shape(lambda: Transformer(MODEL, MOE, rngs=nnx.Rngs(0)))
    total = 0.0
    for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param)):
        keys = jax.tree_util.keystr(path)
        size = float(np.prod(leaf.shape))
        if "norm" in keys or "embed" in keys:
            continue  # norms and the embedding lookup are not matmuls
        # Routed expert weights are the only [layers, E, in, out] leaves under an ffn.
        if "['ffn']" in keys and "shared" not in keys and len(leaf.shape) == 4:
            size *= MOE.top_k / MOE.num_experts  # only top_k of E routed experts are active
        total += size
    assert total == sum(active_matmul_params(MODEL, MOE).values())
