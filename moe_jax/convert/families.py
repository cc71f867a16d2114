"""The Hugging Face families moe_jax reads and writes, as data: how a `config.json`
maps onto moe_jax's settings and back, and which tensor holds each parameter.

Every family here is a Llama-style decoder: pre-norm RMSNorm blocks, rotary embedding
in the rotate-half convention (the first and second halves of each head form the
pairs, as `moe_jax.model.layers.rotary` does), SwiGLU MLPs and experts. A family is
one `Family`; what differs between them is its names and its `config.json` keys.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from moe_jax.config import Config, ModelConfig, MoEConfig
from moe_jax.convert import deepseek
from moe_jax.convert.hf_rope import rope_config_keys, rope_settings
from moe_jax.convert.tensors import Tensors, Unsupported, linear, mlp, same, vector


@dataclasses.dataclass(frozen=True)
class Family:
    architecture: str  # config.json "architectures"[0]
    model_type: str
    moe: bool
    # Per-expert tensors: (module of the MoE block, names of gate, up and down); the fused
    # layout newer transformers versions keep in memory is `mlp.experts.gate_up_proj`.
    moe_module: str = "mlp"
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    shared_expert: bool = False  # Qwen2-MoE's gated shared expert
    qk_norm: bool = False  # Qwen3's per-head q/k RMSNorm
    experts_key: str = "num_experts"
    expert_width_key: str = "moe_intermediate_size"
    renormalize_key: str | None = "norm_topk_prob"  # None: always renormalised
    # q/k/v biases: set by this config.json key (default `fixed_bias`), else always
    # `fixed_bias`.
    bias_key: str | None = None
    fixed_bias: bool = False
    sparse_step_keys: bool = False  # decoder_sparse_step and mlp_only_layers


FAMILIES = {
    f.architecture: f
    for f in (
        Family(
            "MixtralForCausalLM",
            "mixtral",
            moe=True,
            moe_module="block_sparse_moe",
            expert_names=("w1", "w3", "w2"),
            experts_key="num_local_experts",
            expert_width_key="intermediate_size",
            renormalize_key=None,
        ),
        Family(
            "Qwen2MoeForCausalLM",
            "qwen2_moe",
            moe=True,
            shared_expert=True,
            bias_key="qkv_bias",
            fixed_bias=True,
            sparse_step_keys=True,
        ),
        Family(
            "Qwen3MoeForCausalLM",
            "qwen3_moe",
            moe=True,
            qk_norm=True,
            sparse_step_keys=True,
        ),
        Family("LlamaForCausalLM", "llama", moe=False),
        Family("Qwen2ForCausalLM", "qwen2", moe=False, fixed_bias=True),
        # Multi-head latent attention and DeepSeek routing: `moe_jax.convert.deepseek`.
        Family("DeepseekV3ForCausalLM", "deepseek_v3", moe=True, experts_key="n_routed_experts"),
        Family("DeepseekV2ForCausalLM", "deepseek_v2", moe=True, experts_key="n_routed_experts"),
    )
}
DEEPSEEK = ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM")
SUPPORTED = tuple(FAMILIES)


def family_of(hf: dict[str, Any], where: str) -> Family:
    architectures = hf.get("architectures") or []
    name = architectures[0] if architectures else hf.get("model_type", "?")
    if name not in FAMILIES:
        raise Unsupported(
            f"{where}: architecture {name!r} is not supported; supported: {list(SUPPORTED)} "
            "(sliding windows and biased output projections are not)"
        )
    return FAMILIES[name]


def _moe_pattern(layers: int, is_moe: list[bool], where: str) -> tuple[int, int]:
    """(first_k_dense, moe_every) giving the family's MoE layers, or one line."""
    for first in range(layers + 1):
        for every in range(1, layers - first + 1):
            if (layers - first) % every:
                continue
            pattern = [i >= first and (i - first) % every == every - 1 for i in range(layers)]
            if pattern == is_moe:
                return first, every
    if not any(is_moe):
        return layers, 1
    raise Unsupported(
        f"{where}: its MoE layers {[i for i, m in enumerate(is_moe) if m]} are not a dense "
        "prefix followed by every n-th layer, which moe_jax's stacks need"
    )


def to_config(hf: dict[str, Any], where: str) -> tuple[Family, Config]:
    """The family and the moe_jax architecture of a `config.json`, or one line."""
    family = family_of(hf, where)
    if family.architecture in DEEPSEEK:
        return family, deepseek.to_config(family.architecture, hf, where)
    if hf.get("hidden_act", "silu") != "silu":
        raise Unsupported(f"{where}: hidden_act={hf['hidden_act']!r} is not supported (silu)")
    if hf.get("use_sliding_window") or (
        hf.get("sliding_window") and family.model_type == "mixtral"
    ):
        raise Unsupported(f"{where}: sliding-window attention is not supported")
    for key in ("attention_bias", "mlp_bias"):  # biases on every projection, o_proj's too
        if hf.get(key):
            raise Unsupported(f"{where}: {key}=true is not supported (q/k/v biases only)")
    layers, d, heads = hf["num_hidden_layers"], hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or d // heads
    bias = (
        bool(hf.get(family.bias_key, family.fixed_bias)) if family.bias_key else family.fixed_bias
    )
    model = dict(
        vocab_size=hf["vocab_size"],
        num_layers=layers,
        embed_dim=d,
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        mlp_dim=hf["intermediate_size"],
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        **rope_settings(hf, where),  # θ and the checkpoint's rotary scaling
        norm_eps=float(hf["rms_norm_eps"]),
        qkv_bias=bias,
        qk_norm="head" if family.qk_norm else "none",
    )
    moe = {}
    if not family.moe:
        model.update(first_k_dense=layers, moe_every=1)
    else:
        experts = hf.get(family.experts_key) or hf.get("num_local_experts") or hf["num_experts"]
        is_moe = [True] * layers
        if family.sparse_step_keys:
            step, dense = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or [])
            is_moe = [i not in dense and (i + 1) % step == 0 for i in range(layers)]
        first, every = _moe_pattern(layers, is_moe, where)
        model.update(first_k_dense=first, moe_every=every)
        moe = dict(
            num_experts=experts,
            top_k=hf["num_experts_per_tok"],
            expert_mlp_dim=hf[family.expert_width_key],
            score_fn="softmax",
            renormalize=bool(hf.get(family.renormalize_key, False))
            if family.renormalize_key
            else True,
            capacity_factor=0.0,  # dropless, as the source computes
        )
        if family.shared_expert:
            moe.update(
                num_shared_experts=1,
                shared_mlp_dim=hf["shared_expert_intermediate_size"],
                shared_expert_gate=True,
            )
    return family, Config(model=ModelConfig(**model), moe=MoEConfig(**moe))


def _holds(family: Family, config: Config) -> list[str]:
    """What of `config` the family cannot hold (empty: it holds it exactly)."""
    if family.architecture in DEEPSEEK:
        return deepseek.problems(family.architecture, config)
    m, e = config.model, config.moe
    moe = m.num_moe_layers > 0
    problems = [
        (m.attention == "gqa", f"model.attention={m.attention!r}"),
        (m.mtp_depth == 0, "MTP modules (model.mtp_depth)"),
        (family.moe == moe, "MoE layers" if moe else "no MoE layers"),
        (m.qk_norm == ("head" if family.qk_norm else "none"), f"model.qk_norm={m.qk_norm!r}"),
        (
            family.bias_key is not None or m.qkv_bias == family.fixed_bias,
            f"model.qkv_bias={m.qkv_bias}",
        ),
    ]
    if moe:
        shared = e.num_shared_experts > 0
        problems += [
            (e.score_fn == "softmax", f"moe.score_fn={e.score_fn!r}"),
            (e.n_groups == 1, f"moe.n_groups={e.n_groups}"),
            (e.routed_scaling == 1.0, f"moe.routed_scaling={e.routed_scaling}"),
            (family.renormalize_key is not None or e.renormalize, "moe.renormalize=False"),
            (shared == family.shared_expert, "shared experts" if shared else "no shared expert"),
            (not shared or e.shared_expert_gate, "moe.shared_expert_gate=False"),
            (
                family.sparse_step_keys or (m.first_k_dense == 0 and m.moe_every == 1),
                "dense layers between MoE layers",
            ),
        ]
    return [what for ok, what in problems if not ok]


def family_for(config: Config, architecture: str | None = None) -> Family:
    """The family that holds `config` exactly: `architecture` if given, else the first
    that does. One line naming what no family (or the one asked for) can hold."""
    if architecture is not None:
        if architecture not in FAMILIES:
            raise Unsupported(f"--arch={architecture!r} is not one of {list(SUPPORTED)}")
        problems = _holds(FAMILIES[architecture], config)
        if problems:
            raise Unsupported(f"{architecture} cannot hold this model's {', '.join(problems)}")
        return FAMILIES[architecture]
    for family in FAMILIES.values():
        if not _holds(family, config):
            return family
    problems = {name: _holds(f, config) for name, f in FAMILIES.items()}
    raise Unsupported(
        "no supported family holds this model: "
        + "; ".join(f"{name} lacks {', '.join(p)}" for name, p in problems.items())
    )


def to_hf_config(family: Family, config: Config, dtype: str) -> dict[str, Any]:
    """The `config.json` transformers builds `family` from, for `config`."""
    if family.architecture in DEEPSEEK:
        return deepseek.to_hf_config(family.architecture, config, dtype)
    m, e = config.model, config.moe
    hf: dict[str, Any] = {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "vocab_size": m.vocab_size,
        "hidden_size": m.embed_dim,
        "intermediate_size": m.mlp_dim,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads,
        "num_key_value_heads": m.num_kv_heads,
        "head_dim": m.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": m.norm_eps,
        **rope_config_keys(m),
        "tie_word_embeddings": m.tie_embeddings,
        "max_position_embeddings": 32768,
        "torch_dtype": dtype,
        "dtype": dtype,
    }
    if family.bias_key:
        hf[family.bias_key] = m.qkv_bias
    if family.moe:
        hf.update(
            {
                family.experts_key: e.num_experts,
                "num_experts_per_tok": e.top_k,
                family.expert_width_key: e.expert_mlp_dim,
            }
        )
        if family.renormalize_key:
            hf[family.renormalize_key] = e.renormalize
        if family.sparse_step_keys:
            hf["decoder_sparse_step"] = m.moe_every
            hf["mlp_only_layers"] = list(range(m.first_k_dense))
        if family.shared_expert:
            hf["shared_expert_intermediate_size"] = e.num_shared_experts * e.shared_mlp_dim
    return hf


# ---------------------------------------------------------------- tensor names


def layer_tensors(family: Family, config: Config, layer: int, moe: bool) -> dict[str, Tensors]:
    """moe_jax block parameter (its path inside a block) -> its tensors, for one layer.
    Expert weights are per expert: keys `ffn/gate@e` etc.; the fused layout is
    `fused_expert_tensors`."""
    if family.architecture in DEEPSEEK:
        return deepseek.layer_tensors(config, layer, moe)
    m, e = config.model, config.moe
    d, h, kv, hd = m.embed_dim, m.num_heads, m.num_kv_heads, m.head_dim
    p = f"model.layers.{layer}."
    out = {
        "attn_norm/scale": same(p + "input_layernorm.weight", (d,)),
        "ffn_norm/scale": same(p + "post_attention_layernorm.weight", (d,)),
        "attn/query": linear(p + "self_attn.q_proj.weight", (h, hd), (d,)),
        "attn/key": linear(p + "self_attn.k_proj.weight", (kv, hd), (d,)),
        "attn/value": linear(p + "self_attn.v_proj.weight", (kv, hd), (d,)),
        "attn/out": linear(p + "self_attn.o_proj.weight", (d,), (h, hd)),  # [h, hd, d]
    }
    projections = (("query", "q", h), ("key", "k", kv), ("value", "v", kv))
    if m.qkv_bias:
        for name, short, heads in projections:
            out[f"attn/{name}_bias"] = vector(p + f"self_attn.{short}_proj.bias", (heads, hd))
    if m.qk_norm != "none":
        for name, short, heads in projections[:2]:
            shape = (hd,) if m.qk_norm == "head" else (heads, hd)
            out[f"attn/{name}_norm/scale"] = vector(p + f"self_attn.{short}_norm.weight", shape)
    if not moe:
        out.update(mlp(p + "mlp.", "ffn/", d, m.mlp_dim))
        return out
    module = p + family.moe_module + "."
    router = module + "gate.weight"
    out["ffn/router"] = linear(router, (e.num_experts,), (d,))
    gate, up, down = family.expert_names
    f = e.expert_mlp_dim
    for x in range(e.num_experts):
        q = f"{module}experts.{x}."
        out[f"ffn/gate@{x}"] = linear(q + gate + ".weight", (f,), (d,))
        out[f"ffn/up@{x}"] = linear(q + up + ".weight", (f,), (d,))
        out[f"ffn/down@{x}"] = linear(q + down + ".weight", (d,), (f,))
    if e.num_shared_experts:
        width = e.num_shared_experts * e.shared_mlp_dim
        out.update(mlp(p + "mlp.shared_expert.", "ffn/shared/", d, width))
        out["ffn/shared/output_gate"] = linear(p + "mlp.shared_expert_gate.weight", (1,), (d,))
    return out


def fused_expert_tensors(config: Config, layer: int) -> dict[str, Tensors]:
    """The fused layout of one layer's experts (`mlp.experts.gate_up_proj` [E, 2f, d],
    gate rows first, and `mlp.experts.down_proj` [E, d, f]; router `mlp.gate.weight`)."""
    e, d = config.moe, config.model.embed_dim
    f, n = e.expert_mlp_dim, e.num_experts
    p = f"model.layers.{layer}.mlp."
    gate_up, down = p + "experts.gate_up_proj", p + "experts.down_proj"
    out = {"ffn/router": linear(p + "gate.weight", (n,), (d,))}
    for x in range(n):
        shapes = {gate_up: (n, 2 * f, d)}
        out[f"ffn/gate@{x}"] = Tensors(shapes, lambda get, x=x: get(gate_up)[x, :f].T, None)
        out[f"ffn/up@{x}"] = Tensors(shapes, lambda get, x=x: get(gate_up)[x, f:].T, None)
        out[f"ffn/down@{x}"] = Tensors({down: (n, d, f)}, lambda get, x=x: get(down)[x].T, None)
    return out


def global_tensors(config: Config) -> dict[str, Tensors]:
    m = config.model
    out = {
        "embed/table": same("model.embed_tokens.weight", (m.vocab_size, m.embed_dim)),
        "final_norm/scale": same("model.norm.weight", (m.embed_dim,)),
    }
    if not m.tie_embeddings:
        out["head"] = linear("lm_head.weight", (m.vocab_size,), (m.embed_dim,))
    return out


# Buffers some checkpoints carry that hold no parameter.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
