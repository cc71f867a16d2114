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
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.torch import save_file

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
    "Qwen3MoeForCausalLM": dict(
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
        head_dim=12,
        norm_topk_prob=True,
    ),
    "LlamaForCausalLM": dict(head_dim=12),
    "Qwen2ForCausalLM": dict(tie_word_embeddings=True),
}
TOKENS = (8, 16)  # batch 8: any plan of the 8 test devices splits it


def _model(architecture: str):
    cls = getattr(transformers, architecture)
    config = cls.config_class(**{**COMMON, **FAMILIES[architecture]})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = cls(config).eval()
    with torch.no_grad():  # norms near 1, biases and every weight random: nothing at init
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    return model


def _run(model, tokens: np.ndarray) -> dict[str, np.ndarray]:
    with torch.no_grad():
        moe = hasattr(model.config, "num_experts_per_tok")
        out = model(torch.from_numpy(tokens), output_router_logits=moe)
    result = {"logits": out.logits.float().numpy()}
    router = getattr(out, "router_logits", None)
    if router:
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


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    if command == "build":
        build(args[0], Path(args[1]))
    else:
        logits(Path(args[0]), Path(args[1]))
