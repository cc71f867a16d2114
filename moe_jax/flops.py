"""Model FLOPs for MFU: useful work per token, forward + backward, active parameters only.

Convention (the one Megatron-LM and MaxText use, with the causal mask counted):
  * every matmul with an active weight costs 2 FLOPs per weight per token
    forward and twice that backward, so 6 per weight per token;
  * attention scores and values (QK^T and PV) cost 2 * heads * (qk + v) FLOPs
    per query per attended key forward (qk, v: the query/key and value widths of
    a head, both head_dim under gqa); a causal token attends on average to
    (seq_len + 1) / 2 keys; times 3 for forward + backward;
  * multi-token prediction (model.mtp_depth = D) adds per token D blocks (dense or
    MoE as `mtp.is_moe` says), D eh_proj [2d, d] and D more head matmuls;
  * routed experts count top_k experts per token; the router and the
    output head count; embedding lookups, norms and softmaxes do not.
"""

from __future__ import annotations

from moe_jax.config import ModelConfig, MoEConfig
from moe_jax.config_attention import attention_weights, head_widths


def active_matmul_params(cfg: ModelConfig, moe: MoEConfig) -> dict[str, int]:
    """Weights each token multiplies by, split by kind."""
    d = cfg.embed_dim
    attention = attention_weights(cfg)
    dense_mlp = 3 * d * cfg.mlp_dim
    experts = 3 * d * moe.expert_mlp_dim * moe.top_k
    shared = 3 * d * moe.shared_mlp_dim * moe.num_shared_experts
    router = d * moe.num_experts
    num_moe = cfg.num_moe_layers + _mtp_moe_layers(cfg)
    layers = cfg.num_layers + cfg.mtp_depth
    out = {
        "attention": layers * attention,
        "dense_mlp": (layers - num_moe) * dense_mlp,
        "moe": num_moe * (experts + shared + router),
        "head": d * cfg.vocab_size * (1 + cfg.mtp_depth),
    }
    if cfg.mtp_depth:
        out["mtp_proj"] = cfg.mtp_depth * 2 * d * d
    return out


def _mtp_moe_layers(cfg: ModelConfig) -> int:
    """MTP modules with an MoE block (`moe_jax.model.mtp.is_moe`'s rule, without jax)."""
    if not cfg.num_moe_layers:
        return 0
    return sum(cfg.block_of(cfg.num_layers + k)[3] for k in range(cfg.mtp_depth))


def flops_per_token(cfg: ModelConfig, moe: MoEConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward)."""
    weights = sum(active_matmul_params(cfg, moe).values())
    mean_context = (seq_len + 1) / 2
    qk, v = head_widths(cfg)
    layers = cfg.num_layers + cfg.mtp_depth
    attention = 3 * 2 * cfg.num_heads * (qk + v) * mean_context * layers
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
