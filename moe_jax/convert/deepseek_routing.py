"""DeepSeek-V2 and V3 routing in and out of a Hugging Face `config.json`: the table the
DeepSeek families' import and export use (what each field becomes, and what is refused).

Read as transformers 5.24's classes compute, which the tests check against:

- V3 (`DeepseekV3TopkRouter`): sigmoid scores in float32; `e_score_correction_bias`
  (a tensor, the MoE block's `RouterBias`) added for selection only; groups ranked by
  the sum of their best two biased scores, `topk_group` kept, the rest masked with
  -inf; the weights gathered from the unbiased scores, renormalised (+1e-20) when
  `norm_topk_prob`, times `routed_scaling_factor`. `topk_method` and `scoring_func`
  (remote-code fields; the class ignores them) must say the same: `noaux_tc`, `sigmoid`.
- V2 (`DeepseekV2TopkRouter`): softmax over all experts; `topk_method` `greedy` (no
  groups) or `group_limited_greedy` (groups ranked by their best score); never
  renormalised (the class ignores `norm_topk_prob`, so True is refused); times
  `routed_scaling_factor`.
- Both: every layer from `first_k_dense_replace` on is MoE (the classes ignore
  `moe_layer_freq`, so only 1 is read); `n_shared_experts` shared experts of width
  `moe_intermediate_size`, ungated, run as one MLP (`mlp.shared_experts`).
"""

from __future__ import annotations

from typing import Any

from moe_jax.config import Config

V3 = "DeepseekV3ForCausalLM"
V2 = "DeepseekV2ForCausalLM"

# The transformers class defaults of the fields a config.json may leave out.
_DEFAULTS = {
    V3: dict(
        n_group=8,
        topk_group=4,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        first_k_dense_replace=3,
        n_shared_experts=1,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
    ),
    V2: dict(
        n_group=None,
        topk_group=None,
        norm_topk_prob=False,
        routed_scaling_factor=1.0,
        first_k_dense_replace=0,
        n_shared_experts=2,
        topk_method="greedy",
        scoring_func="softmax",
    ),
}

# (HF field, moe_jax setting): the mapping table of docs/model.md.
FIELDS = (
    ("n_routed_experts", "moe.num_experts"),
    ("num_experts_per_tok", "moe.top_k"),
    ("moe_intermediate_size", "moe.expert_mlp_dim (and moe.shared_mlp_dim)"),
    ("n_shared_experts", "moe.num_shared_experts (moe.shared_expert_gate=False)"),
    ("scoring_func", "moe.score_fn: V3 sigmoid, V2 softmax"),
    ("topk_method", "V3 noaux_tc; V2 greedy (moe.n_groups=1) or group_limited_greedy"),
    ("n_group", "moe.n_groups (V2: with group_limited_greedy only)"),
    ("topk_group", "moe.topk_groups"),
    ("(group score)", "moe.group_score: V3 top2_sum, V2 max"),
    ("norm_topk_prob", "moe.renormalize (V2: False only)"),
    ("routed_scaling_factor", "moe.routed_scaling"),
    ("first_k_dense_replace", "model.first_k_dense (model.moe_every=1)"),
    ("moe_layer_freq", "1 only (the transformers classes ignore it)"),
    ("e_score_correction_bias (tensor)", "the MoE block's RouterBias (V3)"),
)


class RoutingUnsupported(ValueError):
    """A DeepSeek routing field moe_jax cannot reproduce (one line)."""


def _field(hf: dict[str, Any], architecture: str, key: str) -> Any:
    value = hf.get(key)
    return _DEFAULTS[architecture][key] if value is None else value


def routing_settings(
    hf: dict[str, Any], architecture: str, where: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(model settings, moe settings) of a DeepSeek `config.json`'s routing, or one line."""
    if architecture not in _DEFAULTS:
        raise RoutingUnsupported(f"{where}: {architecture!r} is not {V3} or {V2}")

    def get(key: str) -> Any:
        return _field(hf, architecture, key)

    score = "sigmoid" if architecture == V3 else "softmax"
    if get("scoring_func") != score:
        raise RoutingUnsupported(
            f"{where}: scoring_func={get('scoring_func')!r}; {architecture} scores with {score}"
        )
    methods = ("noaux_tc",) if architecture == V3 else ("greedy", "group_limited_greedy")
    method = get("topk_method")
    if method not in methods:
        raise RoutingUnsupported(
            f"{where}: topk_method={method!r} is not supported for {architecture} "
            f"(valid: {list(methods)})"
        )
    if hf.get("moe_layer_freq", 1) != 1:
        raise RoutingUnsupported(
            f"{where}: moe_layer_freq={hf['moe_layer_freq']} is not supported (1: transformers "
            "makes every layer from first_k_dense_replace on an MoE layer)"
        )
    renormalize = bool(get("norm_topk_prob"))
    if architecture == V2 and renormalize:
        raise RoutingUnsupported(
            f"{where}: norm_topk_prob=true is not supported for {V2} (transformers' router "
            "never renormalises, and the published checkpoints set it false)"
        )
    grouped = method != "greedy" and (get("n_group") or 1) > 1
    width = hf["moe_intermediate_size"]
    moe = dict(
        num_experts=hf["n_routed_experts"],
        top_k=hf["num_experts_per_tok"],
        expert_mlp_dim=width,
        num_shared_experts=int(get("n_shared_experts") or 0),
        shared_mlp_dim=width,
        shared_expert_gate=False,
        score_fn=score,
        renormalize=renormalize,
        routed_scaling=float(get("routed_scaling_factor")),
        n_groups=int(get("n_group")) if grouped else 1,
        topk_groups=int(get("topk_group")) if grouped else 1,
        group_score="max" if grouped and architecture == V2 else "top2_sum",
        capacity_factor=0.0,  # dropless, as transformers computes
    )
    model = dict(first_k_dense=int(get("first_k_dense_replace")), moe_every=1)
    return model, moe


def routing_problems(config: Config, architecture: str) -> list[str]:
    """What of `config`'s routing the DeepSeek `architecture` cannot hold (empty: all)."""
    m, e = config.model, config.moe
    v3 = architecture == V3
    grouped = e.n_groups > 1
    checks = [
        (e.score_fn == ("sigmoid" if v3 else "softmax"), f"moe.score_fn={e.score_fn!r}"),
        (not grouped or e.group_score == ("top2_sum" if v3 else "max"), "moe.group_score"),
        (v3 or not e.renormalize, "moe.renormalize=True"),
        (not e.shared_expert_gate, "moe.shared_expert_gate=True"),
        (
            not e.num_shared_experts or e.shared_mlp_dim == e.expert_mlp_dim,
            "shared experts of another width than the routed ones",
        ),
        (m.moe_every == 1, "dense layers between MoE layers"),
    ]
    return [what for ok, what in checks if not ok]


def routing_config_keys(config: Config, architecture: str) -> dict[str, Any]:
    """The routing keys of a DeepSeek `config.json` for `config` (check
    `routing_problems` first)."""
    m, e = config.model, config.moe
    grouped = e.n_groups > 1
    if architecture == V3:
        method, score = "noaux_tc", "sigmoid"
    else:
        method, score = ("group_limited_greedy" if grouped else "greedy"), "softmax"
    return {
        "n_routed_experts": e.num_experts,
        "num_experts_per_tok": e.top_k,
        "moe_intermediate_size": e.expert_mlp_dim,
        "n_shared_experts": e.num_shared_experts,
        "scoring_func": score,
        "topk_method": method,
        "n_group": e.n_groups,
        "topk_group": e.topk_groups,
        "norm_topk_prob": e.renormalize,
        "routed_scaling_factor": e.routed_scaling,
        "first_k_dense_replace": m.first_k_dense,
        "moe_layer_freq": 1,
    }
