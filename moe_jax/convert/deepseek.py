"""DeepSeek-V3 (and Kimi-K2, same architecture) and DeepSeek-V2 (and V2-Lite) as
`convert` families: their `config.json` in and out, and which tensor holds each
parameter of multi-head latent attention, the routed and shared experts, the router's
correction bias and the MTP layers.

Two things differ from a plain transpose:

- Rotary layout. The checkpoints' rotary channels are interleaved pairs (x0, x1),
  (x2, x3), ... (transformers' V3 de-interleaves them on the fly when `rope_interleave`,
  V2 rotates them as complex numbers); moe_jax turns half-split pairs (x_i, x_{i+r/2}).
  So the last `qk_rope_head_dim` rows of each head of `q_b_proj` (`q_proj`) and of
  `kv_a_proj_with_mqa` are reordered evens-then-odds on import and back on export;
  queries and keys move alike, so every score is unchanged.
- MTP layers `model.layers.{num_hidden_layers + i}` (V3's `num_nextn_predict_layers`)
  hold enorm, hnorm, eh_proj [d, 2d] (embedding half first), a decoder layer and
  `shared_head.norm`, read into `model.mtp`; their `embed_tokens` and `shared_head.head`
  are copies of the model's own (read: skipped; export: written back).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from moe_jax.config import Config, ModelConfig, MoEConfig
from moe_jax.convert import deepseek_routing as routing
from moe_jax.convert.hf_rope import rope_config_keys, rope_settings
from moe_jax.convert.tensors import Tensors, Unsupported, linear, mlp, same
from moe_jax.model import mtp

V3, V2 = routing.V3, routing.V2
ARCHITECTURES = (V3, V2)
MODEL_TYPES = {V3: "deepseek_v3", V2: "deepseek_v2"}
# An MTP layer's copies of the embedding and the head: skipped on import.
MTP_COPIES = ("embed_tokens.weight", "shared_head.head.weight")


def to_config(architecture: str, hf: dict[str, Any], where: str) -> Config:
    """The moe_jax architecture of a DeepSeek `config.json`, or one line."""
    if hf.get("hidden_act", "silu") != "silu":
        raise Unsupported(f"{where}: hidden_act={hf['hidden_act']!r} is not supported (silu)")
    if hf.get("attention_bias"):
        raise Unsupported(f"{where}: attention_bias=true is not supported (MLA has no biases)")
    if architecture == V3 and hf.get("rope_interleave") is False:
        raise Unsupported(
            f"{where}: rope_interleave=false is not supported (DeepSeek's checkpoints store "
            "their rotary channels interleaved: true)"
        )
    try:
        routing_model, moe = routing.routing_settings(hf, architecture, where)
    except routing.RoutingUnsupported as error:
        raise Unsupported(str(error)) from None
    layers, heads = hf["num_hidden_layers"], hf["num_attention_heads"]
    model = dict(
        vocab_size=hf["vocab_size"],
        num_layers=layers,
        embed_dim=hf["hidden_size"],
        num_heads=heads,
        num_kv_heads=heads,  # MLA: every head its own key and value
        mlp_dim=hf["intermediate_size"],
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        **rope_settings(hf, where),
        norm_eps=float(hf["rms_norm_eps"]),
        attention="mla",
        q_lora_rank=int(hf.get("q_lora_rank") or 0),
        kv_lora_rank=hf["kv_lora_rank"],
        qk_nope_head_dim=hf["qk_nope_head_dim"],
        qk_rope_head_dim=hf["qk_rope_head_dim"],
        v_head_dim=hf["v_head_dim"],
        mtp_depth=int(hf.get("num_nextn_predict_layers") or 0) if architecture == V3 else 0,
        **routing_model,
    )
    model["first_k_dense"] = min(model["first_k_dense"], layers)
    return Config(model=ModelConfig(**model), moe=MoEConfig(**moe))


def problems(architecture: str, config: Config) -> list[str]:
    """What of `config` the DeepSeek `architecture` cannot hold (empty: all)."""
    m = config.model
    checks = [
        (m.attention == "mla", f"model.attention={m.attention!r}"),
        (m.num_moe_layers > 0, "no MoE layers"),
        (architecture == V3 or m.mtp_depth == 0, "MTP modules (model.mtp_depth)"),
    ]
    found = [what for ok, what in checks if not ok]
    return found + (routing.routing_problems(config, architecture) if m.num_moe_layers else [])


def to_hf_config(architecture: str, config: Config, dtype: str) -> dict[str, Any]:
    """The `config.json` transformers builds the DeepSeek `architecture` from."""
    m = config.model
    hf: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": MODEL_TYPES[architecture],
        "vocab_size": m.vocab_size,
        "hidden_size": m.embed_dim,
        "intermediate_size": m.mlp_dim,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads,
        "num_key_value_heads": m.num_heads,
        "q_lora_rank": m.q_lora_rank or None,
        "kv_lora_rank": m.kv_lora_rank,
        "qk_nope_head_dim": m.qk_nope_head_dim,
        "qk_rope_head_dim": m.qk_rope_head_dim,
        "v_head_dim": m.v_head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "rms_norm_eps": m.norm_eps,
        **rope_config_keys(m),
        "tie_word_embeddings": m.tie_embeddings,
        "max_position_embeddings": 32768,
        "torch_dtype": dtype,
        "dtype": dtype,
        **routing.routing_config_keys(config, architecture),
    }
    if architecture == V3:
        hf.update(rope_interleave=True, num_nextn_predict_layers=m.mtp_depth)
    return hf


def _rope_rows(t: Tensors, heads: int, rope: int) -> Tensors:
    """`t` (one torch Linear) with the last `rope` rows of each of its `heads` row
    groups read evens-then-odds (interleaved -> half-split) and written back."""
    ((rows, _),) = t.shapes.values()
    order = np.arange(rows).reshape(heads, rows // heads)
    tail = order[:, order.shape[1] - rope :]
    order[:, order.shape[1] - rope :] = np.concatenate((tail[:, 0::2], tail[:, 1::2]), axis=1)
    order = order.reshape(-1)
    inverse = np.argsort(order)
    return Tensors(
        t.shapes,
        lambda get: t.read(lambda n: get(n)[...][order]),
        lambda w: {n: a[inverse] for n, a in t.write(w).items()},
    )


def layer_tensors(config: Config, layer: int, moe: bool) -> dict[str, Tensors]:
    """moe_jax block parameter -> its tensors for decoder layer `layer` (an MTP layer's
    block too); expert weights per expert (`ffn/gate@e`), the router bias `ffn/bias`."""
    m, e = config.model, config.moe
    d, h, rope = m.embed_dim, m.num_heads, m.qk_rope_head_dim
    nope, r_kv = m.qk_nope_head_dim, m.kv_lora_rank
    qk = nope + rope
    p = f"model.layers.{layer}."
    a = p + "self_attn."
    out = {
        "attn_norm/scale": same(p + "input_layernorm.weight", (d,)),
        "ffn_norm/scale": same(p + "post_attention_layernorm.weight", (d,)),
        "attn/kv_down": _rope_rows(
            linear(a + "kv_a_proj_with_mqa.weight", (r_kv + rope,), (d,)), 1, rope
        ),
        "attn/kv_norm/scale": same(a + "kv_a_layernorm.weight", (r_kv,)),
        "attn/kv_up": linear(a + "kv_b_proj.weight", (h, nope + m.v_head_dim), (r_kv,)),
        "attn/out": linear(a + "o_proj.weight", (d,), (h, m.v_head_dim)),
    }
    if m.q_lora_rank:
        r_q = m.q_lora_rank
        out["attn/query_down"] = linear(a + "q_a_proj.weight", (r_q,), (d,))
        out["attn/query_norm/scale"] = same(a + "q_a_layernorm.weight", (r_q,))
        out["attn/query_up"] = _rope_rows(linear(a + "q_b_proj.weight", (h, qk), (r_q,)), h, rope)
    else:
        out["attn/query"] = _rope_rows(linear(a + "q_proj.weight", (h, qk), (d,)), h, rope)
    if not moe:
        out.update(mlp(p + "mlp.", "ffn/", d, m.mlp_dim))
        return out
    out["ffn/router"] = linear(p + "mlp.gate.weight", (e.num_experts,), (d,))
    if e.score_fn == "sigmoid":  # V3: the correction bias steers selection
        out["ffn/bias"] = same(p + "mlp.gate.e_score_correction_bias", (e.num_experts,))
    f = e.expert_mlp_dim
    for x in range(e.num_experts):
        q = f"{p}mlp.experts.{x}."
        out[f"ffn/gate@{x}"] = linear(q + "gate_proj.weight", (f,), (d,))
        out[f"ffn/up@{x}"] = linear(q + "up_proj.weight", (f,), (d,))
        out[f"ffn/down@{x}"] = linear(q + "down_proj.weight", (d,), (f,))
    if e.num_shared_experts:
        width = e.num_shared_experts * e.shared_mlp_dim
        out.update(mlp(p + "mlp.shared_experts.", "ffn/shared/", d, width))
    return out


def mtp_tensors(config: Config) -> dict[str, Any]:
    """moe_jax parameter path -> tensors of the MTP modules (none when mtp_depth=0); an
    expert weight's is a list over experts."""
    m = config.model
    d = m.embed_dim
    out: dict[str, Any] = {}
    for k in range(m.mtp_depth):
        layer = m.num_layers + k
        p, path = f"model.layers.{layer}.", f"mtp/layers/{k}/"
        out[path + "enorm/scale"] = same(p + "enorm.weight", (d,))
        out[path + "hnorm/scale"] = same(p + "hnorm.weight", (d,))
        out[path + "eh_proj"] = linear(p + "eh_proj.weight", (d,), (2 * d,))
        out[path + "norm/scale"] = same(p + "shared_head.norm.weight", (d,))
        for name, t in layer_tensors(config, layer, mtp.is_moe(m, k + 1)).items():
            name, _, expert = name.partition("@")
            if expert:
                out.setdefault(path + "block/" + name, []).append(t)
            else:
                out[path + "block/" + name] = t
    return out


def with_mtp_copies(config: Config, tensors: dict[str, Tensors]) -> dict[str, Tensors]:
    """The embedding's and the head's tensors also writing each MTP layer's copy (the
    released checkpoints carry them; the import skips them)."""
    m = config.model
    if not m.mtp_depth:
        return tensors
    layers = range(m.num_layers, m.num_layers + m.mtp_depth)
    copies = {"model.embed_tokens.weight": [f"model.layers.{i}.{MTP_COPIES[0]}" for i in layers]}
    copies["lm_head.weight"] = [f"model.layers.{i}.{MTP_COPIES[1]}" for i in layers]
    if m.tie_embeddings:
        copies["model.embed_tokens.weight"] += copies.pop("lm_head.weight")

    def copying(t: Tensors) -> Tensors:
        def write(w):
            written = t.write(w)
            for name, value in list(written.items()):
                written.update({copy: value for copy in copies.get(name, ())})
            return written

        return Tensors(t.shapes, t.read, write)

    return {path: copying(t) for path, t in tensors.items()}


def skip(config: Config) -> Callable[[str], bool]:
    """Whether a stored tensor holds nothing moe_jax reads: an MTP layer's copies of the
    embedding and head, or any MTP layer past `model.mtp_depth` (all of them under
    `convert import --mtp=drop`)."""
    m = config.model

    def skipped(name: str) -> bool:
        parts = name.split(".")
        if name.startswith("model.layers.") and parts[2].isdigit():
            layer = int(parts[2])
            if layer >= m.num_layers + m.mtp_depth:
                return True
            return layer >= m.num_layers and name.endswith(MTP_COPIES)
        return False

    return skipped


def check_mtp_stored(config: Config, stored: dict[str, Any], where: str) -> None:
    """One line when the config states MTP layers the checkpoint does not hold (what
    transformers saves: its classes have none)."""
    m = config.model
    for layer in range(m.num_layers, m.num_layers + m.mtp_depth):
        if f"model.layers.{layer}.eh_proj.weight" not in stored:
            raise ValueError(
                f"{where}: num_nextn_predict_layers={m.mtp_depth} but MTP layer "
                f"model.layers.{layer} is not stored (transformers saves none): import with "
                "--mtp=drop"
            )
