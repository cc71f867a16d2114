"""What every setting means: the one source of `--config_help` and of the configuration
reference in docs/configuration.md (`python -m moe_jax.config_help --markdown` prints that
table; tests/test_docs.py checks the page holds it unchanged)."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from moe_jax import config as config_lib

MEANINGS: dict[str, str] = {
    "model.vocab_size": (
        "token ids, at least 2; the byte tokenizer needs 259 (256 bytes, BOS, EOS, PAD)"
    ),
    "model.num_layers": "transformer blocks, dense and MoE together",
    "model.embed_dim": "width of the residual stream",
    "model.num_heads": "attention query heads",
    "model.num_kv_heads": "key/value heads, each shared by `num_heads / num_kv_heads` query heads",
    "model.head_dim": "width of each attention head (even: rotary pairs)",
    "model.mlp_dim": "width of the dense SwiGLU layers",
    "model.first_k_dense": "leading layers that are dense",
    "model.moe_every": "after the dense prefix, every `moe_every`-th layer is MoE",
    "model.tie_embeddings": "the output head reuses the embedding table",
    "model.rope_theta": "base of the rotary position embedding (> 1)",
    "model.rope_scaling": (
        "rotary scaling the checkpoint was trained with (HF `rope_type`): `none`, `linear` "
        "(positions / `rope_factor`) or `yarn`"
    ),
    "model.rope_factor": "linear and yarn: how many times the context is stretched (>= 1)",
    "model.rope_original_max_position": (
        "yarn: the pretraining context length (HF `original_max_position_embeddings`)"
    ),
    "model.rope_beta_fast": "yarn: rotations bounding the kept fast pairs (HF `beta_fast`)",
    "model.rope_beta_slow": "yarn: rotations bounding the interpolated slow pairs (HF `beta_slow`)",
    "model.rope_mscale": "yarn: HF `mscale` of the cos/sin factor; 0 = unset",
    "model.rope_mscale_all_dim": (
        "yarn: HF `mscale_all_dim` (cos/sin factor, and MLA's softmax scale); 0 = unset"
    ),
    "model.rope_attention_factor": (
        "yarn: HF `attention_factor` on cos/sin; 0 = from the factor and the mscales"
    ),
    "model.rope_truncate": "yarn: round the correction range to whole pairs (HF `truncate`)",
    "model.norm_eps": "epsilon of every RMSNorm",
    "model.qkv_bias": "biases on the query, key and value projections (Qwen2, Qwen2-MoE)",
    "model.qk_norm": (
        "RMSNorm on queries and keys before rotary: `none`, `head` (over each head, Qwen3) "
        "or `projection` (over the whole projection, OLMoE; needs whole heads per device)"
    ),
    "model.dtype": "compute dtype, `float32` or `bfloat16`; parameters are always float32",
    "model.remat": (
        "recompute activations in the backward pass: `none`; `full` (each layer keeps only its "
        "input); `selective` (the paper's SAR: keeps only GEMM and exchange outputs, rebuilds "
        "norms, SiLU, routing and weight casts); `offload` (GPU: `selective` with the kept tensors "
        "in pinned host memory)"
    ),
    "model.attention_impl": (
        "attention core: `xla` (stores the [s, s] scores), `cudnn` (GPU flash attention, "
        "bfloat16), `blockwise` (flash-style blocks in plain JAX, any backend) or `auto` (cudnn on "
        "GPU in bfloat16, else blockwise)"
    ),
    "model.attention": (
        "`gqa` (grouped-query attention) or `mla` (multi-head latent attention, DeepSeek-V2/V3; "
        "`num_kv_heads` = `num_heads`, `head_dim` unread)"
    ),
    "model.q_lora_rank": "mla: width of the query latent; 0 = one query projection (V2-Lite)",
    "model.kv_lora_rank": "mla: width of the key/value latent (what `sample` caches per token)",
    "model.qk_nope_head_dim": "mla: per-head query/key width without rotary",
    "model.qk_rope_head_dim": "mla: rotary width (even); its key is shared by every head",
    "model.v_head_dim": "mla: per-head value width (may differ from the query/key width)",
    "model.mtp_depth": (
        "multi-token prediction modules after the stack (DeepSeek-V3; HF "
        "`num_nextn_predict_layers`): module k predicts the token k + 1 ahead; 0 = off. "
        "Trained only: `sample` and `evaluate` use the main head"
    ),
    "moe.num_experts": "routed experts per MoE layer",
    "moe.top_k": "experts each token is sent to",
    "moe.expert_mlp_dim": "hidden width of each routed expert",
    "moe.num_shared_experts": "always-on shared experts",
    "moe.shared_mlp_dim": "width of each shared expert",
    "moe.shared_expert_gate": "scale the shared experts' output by sigmoid(x @ w) (Qwen2-MoE)",
    "moe.score_fn": "router scores: `softmax` or `sigmoid`",
    "moe.renormalize": "rescale the selected weights to sum to one",
    "moe.routed_scaling": "factor on the routed experts' combine weights",
    "moe.n_groups": "expert groups for group-limited routing (DeepSeek-V3); 1 disables it",
    "moe.topk_groups": "groups a token may choose its experts from",
    "moe.group_score": (
        "what ranks a group: `top2_sum` (the sum of its best two biased scores, DeepSeek-V3) "
        "or `max` (its best score, DeepSeek-V2's group_limited_greedy)"
    ),
    "moe.capacity_factor": (
        "slots per expert as a multiple of `tokens * top_k / num_experts`; 0 = dropless"
    ),
    "moe.impl": (
        "expert compute: `auto`, `tiled`, `ragged_dot`, `pallas`, `tokamax` (the optional "
        "tokamax package's grouped GEMM: `pip install tokamax==0.0.17`), `capacity` or `dense` "
        "(docs/model.md)"
    ),
    "moe.tile_size": "rows per tile of the `tiled` grouped matmul (`impl` tiled or auto); 0 = auto",
    "moe.aux_loss_coef": "weight of the batch load-balancing loss (Switch)",
    "moe.seq_aux_loss_coef": "weight of the per-sequence load-balancing loss (DeepSeek-V3)",
    "moe.z_loss_coef": "weight of the router z-loss (ST-MoE)",
    "moe.bias_update_rate": "step of the aux-loss-free router-bias update; 0 disables it",
    "train.steps": "optimizer steps",
    "train.batch_size": "global batch, in sequences",
    "train.seq_len": "tokens per sequence",
    "train.grad_accum": "micro-batches per step (must divide `batch_size`)",
    "train.learning_rate": "peak learning rate",
    "train.schedule": "after warmup: `cosine` or `linear` decay to the floor, `constant`, "
    "`wsd` (warmup-stable-decay) or `inverse_sqrt`",
    "train.wsd_decay_fraction": "schedule=wsd: the last fraction of the steps, which decay "
    "linearly to the floor",
    "train.min_lr_ratio": "final learning rate / peak",
    "train.warmup_steps": "steps of linear warmup from 0 to the peak",
    "train.optimizer": (
        "`adamw`, or `muon`: Muon (momentum orthogonalised by 5 Newton-Schulz steps, "
        "scaled to AdamW's RMS) for the hidden matrices, each expert's and each layer's on "
        "its own, AdamW for the embedding, head, routers, norms and biases"
    ),
    "train.muon_momentum": "optimizer=muon: the matrices' Nesterov momentum",
    "train.moment_dtype": (
        "`float32`, or `bfloat16`: the optimizer's moments (AdamW's two, Muon's momentum) "
        "stored in bf16 between steps and updated in float32, as DeepSeek-V3 trained: half "
        "their memory; the master weights and gradient sums stay float32"
    ),
    "train.weight_decay": (
        "decoupled weight decay (matrices; norms and embeddings as set below; under "
        "`muon` every hidden matrix)"
    ),
    "train.qk_clip": (
        "Kimi-K2's QK-clip (MuonClip with `muon`): each attention head's largest "
        "pre-softmax logit is tracked in the forward and logged (`max_attn_logit`), and "
        "after the update the query and key weights of every head whose peak passed "
        "`qk_clip_threshold` are rescaled to bring it to the threshold"
    ),
    "train.qk_clip_threshold": "qk_clip: the largest logit τ a head keeps (> 0; Kimi-K2: 100)",
    "train.decay_norms": "apply weight decay to norm scales",
    "train.decay_embeddings": "apply weight decay to the embedding table",
    "train.b1": "AdamW first-moment decay",
    "train.b2": "AdamW second-moment decay",
    "train.eps": "AdamW epsilon",
    "train.grad_clip": "global-norm gradient clipping; 0 disables it",
    "train.seed": "seed of the initialisation, data order and synthetic data; in [0, 2**32)",
    "train.log_every": "steps between logged metrics",
    "train.eval_every": "steps between validations; 0 evaluates only at the end",
    "train.eval_batches": "validation batches per evaluation",
    "train.checkpoint_every": "steps between checkpoints; 0 saves only at the end",
    "train.keep_checkpoints": "newest checkpoints kept",
    "train.max_bad_steps": "consecutive non-finite losses before the run stops",
    "train.memory_limit_gb": (
        "memory per device the plan must fit in, checked before anything is compiled; 0: the "
        "device's own limit (GPU: what JAX reports; CPU: 90% of the machine's RAM shared by its "
        "devices)"
    ),
    "train.init_from": (
        "a moe_jax run directory or Hugging Face checkpoint directory whose weights a fresh run "
        "starts from (step 0, fresh optimizer: a fine-tune); a workdir with its own checkpoint "
        "resumes that instead"
    ),
    "train.upcycle": (
        "with `init_from` a dense model: `none`, `copy` (every expert the dense MLP) or `split` "
        "(expert e is slice e mod g of the MLP's width, router columns repeated; exact with "
        "moe.top_k a multiple of g and moe.routed_scaling=g)"
    ),
    "train.wandb": (
        "also log to Weights & Biases: `off`, `offline` (written under the workdir, synced "
        "later with `wandb sync`) or `online`; needs the wandb package, never installed by "
        "moe_jax"
    ),
    "train.wandb_project": "the W&B project of `train.wandb` (not empty when it is on)",
    "train.loss_chunks": (
        "chunks of the sequence the loss and its gradient run over, so float32 [batch, seq, vocab] "
        "logits never exist; 0 picks the fewest power-of-two chunks keeping one chunk's logits "
        "under 256 MiB (1 for small models)"
    ),
    "train.mtp_loss_weight": (
        "loss = lm_loss + weight * mtp_loss (the mean over the `model.mtp_depth` depths); "
        "logged as `mtp_loss`"
    ),
    "data.source": "`stdlib` (embedded corpus), `tokens` (prepared files) or `synthetic`",
    "data.path": (
        "directory written by `python -m moe_jax.data.prepare`; only with `source=tokens` "
        "(refused with any other source, which would ignore it)"
    ),
    "data.val_fraction": "share of stdlib files held out for validation",
    "data.verify": (
        "with `source=tokens`: check every shard's SHA-256 against meta.json at start (reads "
        "the whole corpus once); a mismatch stops the run in one line naming the shard"
    ),
    "data.sources": (
        "a mixture instead of `data.path`: `DIR:WEIGHT:NAME,DIR:WEIGHT:NAME` (a list of "
        "(DIR, WEIGHT, NAME) in a config file), windows drawn by weight, `val_loss/<name>` "
        "per source; with `source=tokens` ([data](data.md#mixtures))"
    ),
    "data.document_mask": (
        "attention within each document of a window, positions restarting at each, no "
        "target across a boundary ([data](data.md#packing-and-document-masks)); "
        "`false`: today's windows exactly; no effect with `source=synthetic`"
    ),
    "parallel.layout": (
        "`manual`: the settings below; `auto`: the planner (`python -m moe_jax.plan`) chooses "
        "attention, experts, intra, data, zero, etp, overlap and pipeline for the devices at hand"
    ),
    "parallel.gpu": (
        "with `layout='auto'`: the hardware preset the planner assumes (`h800`, `h100`, `h200`, "
        "`a100`, `h20`); empty: this device's kind, H800 if unknown (CPU)"
    ),
    "parallel.attention": (
        "layout of attention and dense MLPs: `dp` (batch split, weights replicated), `fsdp` (batch "
        "split, weights split over `data` and gathered per block), `tp` (Megatron: heads and MLP "
        "columns split, sequence-parallel norms) or `sp` (Ulysses sequence parallel)"
    ),
    "parallel.experts": (
        "expert layout: `ep_ag` (all-gather tokens, local experts, reduce-scatter), `ep_a2a` "
        "(all-to-all to the experts' owners and back), `ep_a2a_ragged` (the same with "
        "`ragged_all_to_all`, GPU only), `etp` (every expert's width split n ways), `ep_etp` "
        "(experts over n/etp devices, width over etp), or `auto` (the paper's rule: `ep_ag` when "
        "`moe.top_k / parallel.intra` exceeds `parallel.ag_threshold`)"
    ),
    "parallel.a2a_buffer_factor": (
        "`ep_a2a`, `ep_a2a_ragged`: rows of each per-destination buffer as a multiple of the "
        "balanced share t·k/n (rounded up to 8, at most t·k); overflow is dropped and counted in "
        "`dropped_fraction`; 0: room for every assignment (exactly dropless)"
    ),
    "parallel.overlap_chunks": (
        "C: each expert block runs as C independent chunks of every device's tokens (split "
        "along the sequence), each exchanging, computing and combining on its own, so one "
        "chunk's exchanges can overlap another's expert compute (drops are decided per chunk); "
        "under `sp` the attention blocks run in C chunks of the batch the same way"
    ),
    "parallel.collective_matmul": (
        "collective matmul: `tp`'s all-gather + GEMM and GEMM + reduce-scatter, `sp`'s "
        "all-to-all + QKV and output GEMMs, and the all-gather expert layouts (`ep_ag`, `etp`, "
        "`ep_etp`) run as n-1 point-to-point steps (`collective-permute`), each overlapping the "
        "GEMM on the block at hand; the all-gather expert layouts need dropless routing "
        "(`moe.capacity_factor=0`)"
    ),
    "parallel.token_dtype": (
        "dtype of token movements: `native` (the compute dtype) or `fp8`: dispatch all-to-alls "
        "(ragged ones included) and all-gathers, the all-gather expert ring's steps and "
        "`sp`'s all-to-alls send an E4M3 payload with float32 scales per token and 128 "
        "channels (dequantised on arrival); their backward, the combines and every reduction "
        "stay in the compute dtype"
    ),
    "parallel.grad_exchange": (
        "how gradients are summed over devices: `fp32` (XLA's float32 reductions) or "
        "`bf16_a2a`: each device's float32 gradient rounded once to bf16, sent to its shards' "
        "owners by all-to-all (over the intra group, then over `stage` and `data`) and summed "
        "in float32; "
        "FSDP's gathers get the same backward"
    ),
    "parallel.stages": (
        "S: pipeline stages on an outer `stage` mesh axis; the MoE layer stack is cut over them "
        "(GPipe, every tick rematerialised), embedding, dense prefix, head and loss run on every "
        "stage with `stage` folded into the batch; 1: no pipeline"
    ),
    "parallel.microbatches": (
        "M: micro-batches per step through the pipeline, a multiple of `stages`; the step's "
        "accumulation (`train.grad_accum` stays 1); bubble (S-1)/(M R + S - 1); 1 without a "
        "pipeline (`train.grad_accum` splits that step)"
    ),
    "parallel.repeats": (
        "R: circular pipeline: each stage holds R non-adjacent groups of layers (group r S + s "
        "on stage s); S x R must divide the MoE layers"
    ),
    "parallel.schedule": (
        "`gpipe`: every forward tick, then every backward tick (inputs held: M R + S - 1); "
        "`1f1b`: each micro-batch's backward as soon as its loss is known, in one tick loop, "
        "the head and loss on the last stage (the same bubble; inputs held bounded by S R, "
        "not M); `zero_bubble`: 1F1B with each backward cut in two, the weights' gradients "
        "deferred so that every stage runs them in the same ticks (M R of them, not "
        "M R + S - 1; a stash of about S items of weight-GEMM inputs and output gradients); "
        "`gpipe` without a pipeline"
    ),
    "parallel.stash_depth": (
        "zero_bubble: the most ticks a stage defers an item's weight gradients after its "
        "input gradient; the stash holds about that many items plus one, and each tick "
        "takes one W out of the bubble (M R + S - 1 - depth ticks of W work); 0: S - 1, "
        "every stage's W in the same ticks (a stash of about S items)"
    ),
    "parallel.ag_threshold": "`auto` picks `ep_ag` when `moe.top_k / parallel.intra` exceeds this",
    "parallel.intra": "n: devices of one intra-node group (experts and sequence split over it)",
    "parallel.data": "data-parallel groups; `0` uses every device not taken by `intra`",
    "parallel.zero": (
        "ZeRO stage: `0` optimizer state replicated, `1` optimizer moments split over `data`, "
        "`2` the distributed optimizer: float32 master weights and moments split over every "
        "device sharing them, the step's weights all-gathered in `model.dtype`, the gradients "
        "reduce-scattered once per step (a stacked weight's inside the backward, layer by "
        "layer, with one micro-batch and no pipeline)"
    ),
    "parallel.expert_fsdp": (
        "expert weights (and their gradients and moments) also split over `data`, gathered in "
        "float32 per layer and reduce-scattered in the backward (ZeRO-3 for the experts)"
    ),
    "parallel.vocab_parallel": (
        "embedding table and output head split over the vocabulary on the intra group; the lookup "
        "and the chunked cross-entropy run on the vocabulary shards (Megatron's vocab-parallel "
        "loss)"
    ),
    "parallel.etp": (
        "`ep_etp` only: devices that split each expert's width (the other intra / etp own whole "
        "expert groups)"
    ),
    "profile.steps": (
        "`'start,stop'`: trace steps [start, stop) with `jax.profiler`, inside the run "
        "(stop <= `train.steps` + 1); empty: off"
    ),
}


def rows(values: dict[str, Any] | None = None) -> list[tuple[str, object, str]]:
    """(setting, value, meaning) of every setting, in the config's order: the value
    `values` (a config file's settings, as a dict of sections) gives, else the default."""
    rows = []
    for section, cls in config_lib.SECTIONS.items():
        given = (values or {}).get(section)
        given = given if isinstance(given, dict) else {}
        for field in dataclasses.fields(cls):
            name = f"{section}.{field.name}"
            value = given.get(field.name, getattr(cls(), field.name))
            rows.append((name, value, MEANINGS.get(name, "")))
    return rows


def markdown() -> str:
    """The configuration table of docs/configuration.md."""
    lines = ["| setting | default | meaning |", "|---|---|---|"]
    lines += [f"| `{name}` | `{default!r}` | {meaning} |" for name, default, meaning in rows()]
    return "\n".join(lines)


def text(values: dict[str, Any] | None = None) -> str:
    """The same, for a terminal (`--config_help`), with the values of `values` (the
    given config file and overrides) where it has them."""
    table = rows(values)
    width = max(len(name) for name, _, _ in table)
    return "\n".join(
        f"{name:<{width}}  {value!r:<12} {meaning.replace('`', '')}"
        for name, value, meaning in table
    )


if __name__ == "__main__":
    print(markdown() if "--markdown" in sys.argv else text())
