"""transformers' side of a conversion check: a script for any Python that has torch and
transformers (the parity tests run it in the Python 3.11 environment `make test`
builds, .venv-hf; see docs/weights.md). moe_jax never imports it, and it never imports
moe_jax: the two sides hand tokens, logits and expert choices over as files.

    python transformers_side.py build ARCH OUT   a tiny random ARCH model, saved per
                                                 expert (OUT/hf) and fused (OUT/hf_fused),
                                                 its logits and expert choices on fixed
                                                 tokens (OUT/reference.npz)
    python transformers_side.py logits DIR NPZ   from_pretrained(DIR)'s logits and expert
                                                 choices on NPZ's tokens, in DIR/logits.npz
    python transformers_side.py references OUT   transformers' rotary frequencies, cos/sin
                                                 and DeepSeek routers on fixed cases, each
                                                 with the config.json fields that state it
                                                 (OUT/rope.npz, OUT/routing.npz)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.torch import load_file, save_file

# Dimensions are never square and never equal to one another, so a transposed or
# swapped tensor cannot load: vocab 301, hidden 40, dense width 56, expert width 24,
# shared width 28, head_dim 12 where the family sets it (else 40 / 4 = 10).
COMMON = dict(
    vocab_size=301,
    hidden_size=40,
    intermediate_size=56,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
    tie_word_embeddings=False,
)
_MLA = dict(  # every head its own key and value
    num_key_value_heads=4, kv_lora_rank=14, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=11
)
FAMILIES = {
    "MixtralForCausalLM": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=24),
    "Qwen2MoeForCausalLM": dict(
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=28,
        mlp_only_layers=[0],  # a dense first layer
        norm_topk_prob=False,
    ),
    "Qwen3MoeForCausalLM": dict(  # with YaRN (as Qwen3 extends its context)
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
        head_dim=12,
        norm_topk_prob=True,
        max_position_embeddings=256,
        rope_parameters=dict(
            rope_type="yarn", rope_theta=5000.0, factor=4.0, original_max_position_embeddings=64
        ),
    ),
    "LlamaForCausalLM": dict(  # with linear rotary scaling
        head_dim=12, rope_parameters=dict(rope_type="linear", rope_theta=5000.0, factor=2.5)
    ),
    "Qwen2ForCausalLM": dict(tie_word_embeddings=True),
    # MLA (latents 18 and 14 wide, heads [6 | 4 rotary] for q/k and 11 for v), a dense
    # first layer, an MTP layer (tensors added by `_add_mtp`; transformers ignores them).
    "DeepseekV3ForCausalLM": dict(  # with YaRN and 4 groups of 2, 2 kept
        **_MLA,
        q_lora_rank=18,
        rms_norm_eps=1e-6,  # transformers' latent norms always use 1e-6
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        num_nextn_predict_layers=1,
        max_position_embeddings=256,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=5000.0,
            factor=4.0,
            original_max_position_embeddings=64,
            mscale=0.9,
            mscale_all_dim=0.8,
        ),
    ),
    "DeepseekV2ForCausalLM": dict(  # V2-Lite's shape: no query latent, greedy softmax top-k
        **_MLA,
        q_lora_rank=None,
        rms_norm_eps=1e-6,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
        n_shared_experts=2,
        topk_method="greedy",
        first_k_dense_replace=1,
        routed_scaling_factor=1.5,
    ),
}
TOKENS = (8, 16)  # batch 8: any plan of the 8 test devices splits it


def _model(architecture: str, **change):
    cls = getattr(transformers, architecture)
    config = cls.config_class(**{**COMMON, **FAMILIES[architecture], **change})
    config._attn_implementation = "eager"
    torch.manual_seed(len(change))
    model = cls(config).eval()
    with torch.no_grad():  # norms near 1, biases and every weight random: nothing at init
        buffers = [b for b in model.named_buffers() if b[0].endswith("e_score_correction_bias")]
        for name, p in [*model.named_parameters(), *buffers]:  # DeepSeek-V3's router bias too
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    return model


def _add_mtp(model, state: dict) -> dict:
    """DeepSeek-V3's MTP layers (`num_nextn_predict_layers`), which transformers neither
    builds nor loads, as the released checkpoints store them after the main layers:
    random norms, eh_proj and a decoder layer (experts per expert), and copies of the
    embedding and head."""
    config = model.config
    depth = getattr(config, "num_nextn_predict_layers", 0) or 0
    first = config.num_hidden_layers
    if not depth:
        return state
    longer = _model(config.architectures[0], num_hidden_layers=first + depth).state_dict()
    state = dict(state)
    d = config.hidden_size
    for layer in range(first, first + depth):
        p = f"model.layers.{layer}."
        for name, value in longer.items():
            if not name.startswith(p):
                continue
            if name.endswith("experts.gate_up_proj"):
                f = value.shape[1] // 2
                for e in range(value.shape[0]):
                    state[f"{p}mlp.experts.{e}.gate_proj.weight"] = value[e, :f].contiguous()
                    state[f"{p}mlp.experts.{e}.up_proj.weight"] = value[e, f:].contiguous()
            elif name.endswith("experts.down_proj"):
                for e in range(value.shape[0]):
                    state[f"{p}mlp.experts.{e}.down_proj.weight"] = value[e].contiguous()
            else:
                state[name] = value.contiguous()
        for norm in ("enorm", "hnorm", "shared_head.norm"):
            state[f"{p}{norm}.weight"] = 1.0 + 0.2 * torch.randn(d)
        state[f"{p}eh_proj.weight"] = 0.15 * torch.randn(d, 2 * d)
        state[f"{p}embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
        state[f"{p}shared_head.head.weight"] = state["lm_head.weight"].clone()
    return state


def _chosen_by_hooks(model):
    """The top-k experts each DeepSeek router returns, in layer order (hooks on them)."""
    chosen = []
    for module in model.modules():
        if type(module).__name__.endswith("TopkRouter"):
            module.register_forward_hook(lambda m, i, out: chosen.append(out[2].numpy()))
    return chosen


def _run(model, tokens: np.ndarray) -> dict[str, np.ndarray]:
    deepseek = model.config.model_type.startswith("deepseek")
    hooked = _chosen_by_hooks(model) if deepseek else None
    with torch.no_grad():
        moe = hasattr(model.config, "num_experts_per_tok") and not deepseek
        out = model(torch.from_numpy(tokens), output_router_logits=moe)
    result = {"logits": out.logits.float().numpy()}
    router = getattr(out, "router_logits", None)
    if hooked:
        result["chosen"] = np.stack(hooked)  # [moe layers, tokens, k]
    elif router:
        k = model.config.num_experts_per_tok
        chosen = [torch.topk(torch.softmax(r.float(), -1), k, -1).indices.numpy() for r in router]
        result["chosen"] = np.stack(chosen)  # [moe layers, tokens, k]
    return result


def build(architecture: str, out: Path) -> None:
    model = _model(architecture)
    model.save_pretrained(out / "hf")  # the per-expert layout (experts.N.w1 ...)
    fused = out / "hf_fused"  # the fused layout transformers 5 keeps in memory
    fused.mkdir(parents=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    mtp = {k: v for k, v in _add_mtp(model, state).items() if k not in state}
    if mtp:  # into both layouts (per expert in both, as the released checkpoints)
        shard = out / "hf" / "model.safetensors"
        save_file({**load_file(str(shard)), **mtp}, str(shard), metadata={"format": "pt"})
    state.update(mtp)
    save_file(state, str(fused / "model.safetensors"), metadata={"format": "pt"})
    (fused / "config.json").write_text((out / "hf" / "config.json").read_text())
    tokens = np.random.default_rng(1).integers(0, COMMON["vocab_size"], TOKENS).astype(np.int64)
    np.savez(out / "reference.npz", tokens=tokens, **_run(model, tokens))
    names = sorted(json.loads((out / "hf" / "config.json").read_text()))
    print(f"built {architecture} in {out} ({len(state)} tensors, config keys {len(names)})")


def logits(directory: Path, reference: Path) -> None:
    architecture = json.loads((directory / "config.json").read_text())["architectures"][0]
    cls = getattr(transformers, architecture)
    model = cls.from_pretrained(directory, attn_implementation="eager").eval()
    tokens = np.load(reference)["tokens"]
    np.savez(directory / "logits.npz", **_run(model.float(), tokens))
    print(f"{architecture} from {directory}: logits in {directory / 'logits.npz'}")


# Rotary cases: config.json fields of a Llama (rotate-half rope, the families' own) or
# of a DeepSeek (for YaRN's softmax multiplier), in the v5 `rope_parameters` form or the
# older `rope_scaling` beside `rope_theta`.
ROPE_CASES = {
    "linear": dict(head_dim=12, rope_parameters=dict(rope_type="linear", factor=2.5)),
    "yarn": dict(
        head_dim=12,
        max_position_embeddings=256,
        rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64),
    ),
    "yarn_mscales_old_form": dict(
        head_dim=16,
        rope_theta=20000.0,
        max_position_embeddings=1024,
        rope_scaling=dict(
            type="yarn",
            factor=8.0,
            original_max_position_embeddings=128,
            beta_fast=16,
            beta_slow=2,
            mscale=0.9,
            mscale_all_dim=0.6,
        ),
    ),
    "yarn_no_truncate_factor_from_lengths": dict(
        head_dim=20,
        max_position_embeddings=1024,
        rope_parameters=dict(
            rope_type="yarn", factor=None, original_max_position_embeddings=128, truncate=False
        ),
    ),
    "yarn_attention_factor": dict(
        head_dim=12,
        max_position_embeddings=288,
        rope_parameters=dict(
            rope_type="yarn", factor=3.0, original_max_position_embeddings=96, attention_factor=1.3
        ),
    ),
    "deepseek_v3": dict(  # as DeepSeek-V3 ships it (qk_rope_head_dim 64)
        deepseek=True,
        max_position_embeddings=163840,
        rope_scaling=dict(
            type="yarn",
            factor=40,
            original_max_position_embeddings=4096,
            beta_fast=32,
            beta_slow=1,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
    ),
    "deepseek_v2_lite": dict(
        deepseek=True,
        max_position_embeddings=163840,
        rope_scaling=dict(
            type="yarn",
            factor=40,
            original_max_position_embeddings=4096,
            beta_fast=32,
            beta_slow=1,
            mscale=0.707,
            mscale_all_dim=0.707,
        ),
    ),
}
ROPE_POSITIONS = (0, 1, 5, 17, 63, 200, 511)

# Routing cases: (architecture, config.json fields); the correction bias is negative
# throughout, so that a dropped group masked with 0 instead of -inf would win.
ROUTING_CASES = {
    "v3_groups": ("DeepseekV3ForCausalLM", dict(n_routed_experts=16, num_experts_per_tok=3,
                  n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)),
    "v3_no_groups": ("DeepseekV3ForCausalLM", dict(n_routed_experts=10, num_experts_per_tok=4,
                     n_group=1, topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.5)),
    "v2_greedy": ("DeepseekV2ForCausalLM", dict(n_routed_experts=10, num_experts_per_tok=3,
                  topk_method="greedy", routed_scaling_factor=16.0)),
    "v2_group_limited": ("DeepseekV2ForCausalLM", dict(n_routed_experts=12,
                         num_experts_per_tok=3, topk_method="group_limited_greedy", n_group=4,
                         topk_group=2, routed_scaling_factor=2.0)),
}  # fmt: skip
ROUTER_SIZE = dict(hidden_size=20, moe_intermediate_size=6, num_attention_heads=4)


def _rope_case(fields: dict) -> dict[str, np.ndarray]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    fields = dict(fields)
    if fields.pop("deepseek", False):
        from transformers.models.deepseek_v3 import modeling_deepseek_v3 as v3

        config = transformers.DeepseekV3Config(**fields)
        inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](config)
        multiplier = v3.yarn_apply_mscale(config.rope_parameters, 1.0)
        return dict(inv_freq=inv_freq.numpy(), factor=factor, multiplier=multiplier)
    from transformers.models.llama import modeling_llama as llama

    config = transformers.LlamaConfig(hidden_size=48, num_attention_heads=4, **fields)
    kind = config.rope_parameters["rope_type"]
    inv_freq, factor = ROPE_INIT_FUNCTIONS[kind](config)
    positions = torch.tensor([ROPE_POSITIONS])
    x = torch.from_numpy(np.random.default_rng(2).standard_normal((1, 3, 7, config.head_dim)))
    x = x.float()  # [batch, heads, seq, head_dim]
    cos, sin = llama.LlamaRotaryEmbedding(config)(x, positions)
    turned, _ = llama.apply_rotary_pos_emb(x, x, cos, sin)
    return dict(
        inv_freq=inv_freq.numpy(),
        factor=factor,
        x=x.numpy(),
        turned=turned.numpy(),
        positions=positions.numpy(),
    )


def _routing_case(architecture: str, fields: dict, seed: int) -> dict[str, np.ndarray]:
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as v2
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as v3

    v3_arch = architecture == "DeepseekV3ForCausalLM"
    cls = transformers.DeepseekV3Config if v3_arch else transformers.DeepseekV2Config
    config = cls(**fields)
    router = (v3.DeepseekV3TopkRouter if v3_arch else v2.DeepseekV2TopkRouter)(config)
    rng = np.random.default_rng(seed)
    experts, d = fields["n_routed_experts"], ROUTER_SIZE["hidden_size"]
    weight = rng.standard_normal((experts, d)).astype(np.float32)
    bias = -rng.uniform(0.3, 1.8, experts).astype(np.float32)
    x = rng.standard_normal((64, d)).astype(np.float32)
    with torch.no_grad():
        router.weight.copy_(torch.from_numpy(weight))
        if v3_arch:
            router.e_score_correction_bias.copy_(torch.from_numpy(bias))
        _, weights, indices = router(torch.from_numpy(x))
    return dict(
        x=x,
        weight=weight,
        bias=bias if v3_arch else np.zeros_like(bias),
        weights=weights.numpy(),
        indices=indices.numpy(),
    )


def references(out: Path) -> None:
    """ROPE_CASES and ROUTING_CASES through transformers, each with its config.json fields
    (as JSON) under `NAME/config`, into OUT/rope.npz and OUT/routing.npz."""
    out.mkdir(parents=True, exist_ok=True)
    rope = {}
    for name, fields in ROPE_CASES.items():
        rope[f"{name}/config"] = np.array(json.dumps(fields))
        rope.update({f"{name}/{k}": v for k, v in _rope_case(fields).items()})
    np.savez(out / "rope.npz", **rope)
    routing = {}
    for seed, (name, (architecture, fields)) in enumerate(ROUTING_CASES.items()):
        fields = {**ROUTER_SIZE, **fields}
        config = {"architectures": [architecture], **fields}
        routing[f"{name}/config"] = np.array(json.dumps(config))
        routing.update(
            {f"{name}/{k}": v for k, v in _routing_case(architecture, fields, seed).items()}
        )
    np.savez(out / "routing.npz", **routing)
    print(f"references in {out}: {len(ROPE_CASES)} rotary, {len(ROUTING_CASES)} routing cases")


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    if command == "build":
        build(args[0], Path(args[1]))
    elif command == "references":
        references(Path(args[0]))
    else:
        logits(Path(args[0]), Path(args[1]))
