"""Model FLOPs for MFU: useful work per token, forward + backward, active parameters only.

Convention (the one Megatron-LM and MaxText use, with the causal mask counted):
  * every matmul with an active weight costs 2 FLOPs per weight per token
    forward and twice that backward, so 6 per weight per token;
  * attention scores and values (QK^T and PV) cost 2 * 2 * heads * head_dim
    FLOPs per query per attended key forward; a causal token attends on
    average to (seq_len + 1) / 2 keys; times 3 for forward + backward;
  * routed experts count top_k experts per token; the router and the
    output head count; embedding lookups, norms and softmaxes do not.
"""

from __future__ import annotations

from moe_jax.config import ModelConfig, MoEConfig


def active_matmul_params(cfg: ModelConfig, moe: MoEConfig) -> dict[str, int]:
    """Weights each token multiplies by, split by kind."""
    d = cfg.embed_dim
    attention = d * cfg.head_dim * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
    dense_mlp = 3 * d * cfg.mlp_dim
    experts = 3 * d * moe.expert_mlp_dim * moe.top_k
    shared = 3 * d * moe.shared_mlp_dim * moe.num_shared_experts
    router = d * moe.num_experts
    num_moe = cfg.num_moe_layers
    num_dense = cfg.num_layers - num_moe
    return {
        "attention": cfg.num_layers * attention,
        "dense_mlp": num_dense * dense_mlp,
        "moe": num_moe * (experts + shared + router),
        "head": d * cfg.vocab_size,
    }


def flops_per_token(cfg: ModelConfig, moe: MoEConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward)."""
    weights = sum(active_matmul_params(cfg, moe).values())
    mean_context = (seq_len + 1) / 2
    attention = 3 * 4 * cfg.num_heads * cfg.head_dim * mean_context * cfg.num_layers
    return 6.0 * weights + attention


# Dense bf16 peak TFLOP/s per chip (the paper's Table 4 for H800 / A100 / H20;
# vendor datasheets for the rest). Matched against `device.device_kind`.
PEAK_TFLOPS = {"H800": 989.0, "H100": 989.0, "H200": 989.0, "H20": 148.0, "A100": 312.0}


def peak_flops(device) -> float | None:
    """Peak FLOP/s of `device`, or None where no public figure applies (CPUs)."""
    kind = getattr(device, "device_kind", "")
    for name, tflops in sorted(PEAK_TFLOPS.items(), key=lambda item: -len(item[0])):
        if name in kind:
            return tflops * 1e12
    return None
