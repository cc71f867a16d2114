"""What the transformers side computes beside whole models, against moe_jax's own: the
rotary frequencies and scales (linear, YaRN) that a checkpoint's config implies and the
DeepSeek V2/V3 routers. The references come from the session's one transformers run (`hf_built`)."""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest

from moe_jax import config as config_lib
from tests import hf_cases, hf_side

pytestmark = hf_side.NEEDS_HF


def test_rotary_scaling_matches_transformers(hf_built):
    """Each rotary case of the transformers side (linear; YaRN with and without mscales,
    in the v5 and the older config form, its factor from the lengths, untruncated, an
    explicit attention factor; DeepSeek-V3 and V2-Lite as shipped), read through the
    import's mapping: transformers' inverse frequencies, cos/sin factor, MLA softmax
    multiplier and rotated vectors; the export's `rope_parameters` read back the same."""
    from moe_jax.convert import hf_rope
    from moe_jax.model import rope
    from moe_jax.model.layers import rotary

    cases = hf_cases.cases(np.load(hf_built("references") / "rope.npz"))
    assert len(cases) == 7
    turned = {}  # every case's rotation, in one compiled program
    for name, ref in cases.items():
        hf = json.loads(str(ref["config"]))
        settings = hf_rope.rope_settings(hf, name)
        model = dataclasses.replace(config_lib.ModelConfig(), **settings)
        config_lib.validate(config_lib.Config(model=model))
        scaling = rope.RopeScaling.of(model)
        dim = 2 * ref["inv_freq"].shape[0]
        freq = rope.inverse_frequencies(dim, model.rope_theta, scaling)
        np.testing.assert_allclose(freq, ref["inv_freq"], rtol=2e-6, err_msg=name)
        assert rope.cos_sin_factor(scaling) == pytest.approx(float(ref["factor"]), rel=1e-12)
        if "multiplier" in ref:  # DeepSeek: get_mscale(factor, mscale_all_dim) squared
            want = float(ref["multiplier"])
            assert rope.softmax_multiplier(scaling) == pytest.approx(want, rel=1e-12)
            assert want != 1.0
        if "x" in ref:  # [batch, heads, seq, head_dim] -> moe_jax's [batch, seq, heads, hd]
            x = np.swapaxes(ref["x"], 1, 2)
            turned[name] = (x, ref["positions"], model.rope_theta, scaling)
        again = {"rope_parameters": hf_rope.rope_parameters(model)}
        assert hf_rope.rope_settings(again, name) == settings
    got = jax.jit(lambda xs: {n: rotary(x, p, *turned[n][2:]) for n, (x, p) in xs.items()})(
        {name: case[:2] for name, case in turned.items()}
    )
    assert len(got) == 5
    for name, value in got.items():  # float32 angles up to 511 rad: ~3e-5
        want = np.swapaxes(cases[name]["turned"], 1, 2)
        np.testing.assert_allclose(np.asarray(value), want, rtol=0, atol=1e-4, err_msg=name)


def test_deepseek_routing_matches_transformers_routers(hf_built):
    """DeepSeek-V3's router (sigmoid, a negative correction bias, groups by their top-2
    sum with and without groups) and V2's (softmax, greedy and group-limited by the group
    max), each read from its config.json fields: the same experts and weights for every
    token; the export's fields read back the same settings; bad fields refused."""
    from moe_jax.convert import deepseek_routing as ds
    from moe_jax.moe.routing import route

    cases = hf_cases.cases(np.load(hf_built("references") / "routing.npz"))
    assert len(cases) == 4
    settings = {}
    for name, ref in cases.items():
        hf = json.loads(str(ref["config"]))
        architecture = hf["architectures"][0]
        model, moe = ds.routing_settings(hf, architecture, name)
        settings[name] = config_lib.MoEConfig(**moe)
        config = config_lib.Config(
            model=dataclasses.replace(config_lib.ModelConfig(), **model), moe=settings[name]
        )
        assert ds.routing_problems(config, architecture) == []
        again = ds.routing_config_keys(config, architecture)
        assert ds.routing_settings({**hf, **again}, architecture, name) == (model, moe)
    inputs = {name: (ref["x"], ref["weight"].T, ref["bias"]) for name, ref in cases.items()}
    routed = jax.jit(lambda ins: {n: route(*i, settings[n]) for n, i in ins.items()})(inputs)
    for name, routing in routed.items():
        ours, theirs = np.asarray(routing.expert_index), cases[name]["indices"]
        order, their_order = np.argsort(ours, -1), np.argsort(theirs, -1)
        sort = lambda a, o: np.take_along_axis(a, o, -1)
        np.testing.assert_array_equal(sort(ours, order), sort(theirs, their_order), name)
        np.testing.assert_allclose(
            sort(np.asarray(routing.weights), order),
            sort(cases[name]["weights"], their_order),
            rtol=1e-5,  # float32 logits of two matmuls; sigmoid's tail keeps their error
            err_msg=name,
        )
    # The trap the negative bias sets: masking the dropped groups with 0 picks other experts.
    ref = cases["v3_groups"]
    zero_masked = hf_cases.v3_choices_masking_with_zero(ref, groups=4, kept=2, k=3)
    assert (zero_masked != np.sort(ref["indices"], -1)).any()
    v2 = json.loads(str(cases["v2_greedy"]["config"]))
    with pytest.raises(ValueError, match="norm_topk_prob=true is not supported"):
        ds.routing_settings({**v2, "norm_topk_prob": True}, ds.V2, "c")
    v3 = json.loads(str(cases["v3_groups"]["config"]))
    with pytest.raises(ValueError, match=r"topk_method='greedy' is not supported"):
        ds.routing_settings({**v3, "topk_method": "greedy"}, ds.V3, "c")


# Kimi-K2's published config.json (the fields that matter): DeepSeek-V3's class with
# other numbers, one group, no MTP layer, YaRN with beta_fast = beta_slow = 1.
KIMI_K2 = dict(
    architectures=["DeepseekV3ForCausalLM"],
    model_type="kimi_k2",
    vocab_size=163840,
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_hidden_layers=61,
    num_nextn_predict_layers=0,
    num_attention_heads=64,
    num_key_value_heads=64,
    n_shared_experts=1,
    n_routed_experts=384,
    routed_scaling_factor=2.827,
    kv_lora_rank=512,
    q_lora_rank=1536,
    qk_rope_head_dim=64,
    v_head_dim=128,
    qk_nope_head_dim=128,
    topk_method="noaux_tc",
    n_group=1,
    topk_group=1,
    num_experts_per_tok=8,
    moe_layer_freq=1,
    first_k_dense_replace=1,
    norm_topk_prob=True,
    scoring_func="sigmoid",
    hidden_act="silu",
    max_position_embeddings=131072,
    rms_norm_eps=1e-6,
    rope_theta=50000.0,
    rope_scaling=dict(
        type="yarn",
        factor=32.0,
        original_max_position_embeddings=4096,
        beta_fast=1.0,
        beta_slow=1.0,
        mscale=1.0,
        mscale_all_dim=1.0,
    ),
    tie_word_embeddings=False,
)


def test_a_kimi_k2_config_reads_as_deepseek_v3_and_writes_back():
    """Kimi-K2's config.json imports as DeepseekV3ForCausalLM (MLA, 384 experts in one
    group, one dense layer, YaRN) and the export's config.json states the same."""
    from moe_jax.convert import families

    family, config = families.to_config(KIMI_K2, "kimi")
    config_lib.validate(config)
    m, e = config.model, config.moe
    assert (m.attention, m.q_lora_rank, m.kv_lora_rank, m.mtp_depth) == ("mla", 1536, 512, 0)
    assert (e.num_experts, e.top_k, e.n_groups, e.score_fn) == (384, 8, 1, "sigmoid")
    assert (m.first_k_dense, e.routed_scaling, m.rope_beta_fast) == (1, 2.827, 1.0)
    assert families.family_for(config) is family
    written = families.to_hf_config(family, config, "bfloat16")
    again = families.to_config(written, "export")[1]
    assert again == config
    for key in ("n_routed_experts", "routed_scaling_factor", "q_lora_rank", "v_head_dim"):
        assert written[key] == KIMI_K2[key], key
