"""Activation recomputation (`model.remat`): what a layer keeps for its backward pass.

* `none`: everything the backward reads is kept.
* `full`: only each scanned unit's input; the backward re-runs the whole unit
  forward, GEMMs and exchanges included.
* `selective` (MegaScale-MoE's selective activation rematerialization): the layer
  names what it produces with `checkpoint_name` and keeps only the outputs of its
  GEMMs and exchanges, which are expensive to redo: the exchanged q/k/v, the
  attention core's output and softmax statistics, the attention output, the
  residual stream entering the FFN (its norm's input), the rows the experts
  receive and the fc1/fc3 (gate/up) outputs and fc2's; under MLA also the outputs of
  the query and key/value down-projections (the latents, before their norms). Norms,
  rotary, SiLU and the product feeding fc2, routing and the cast copies of weights
  are rebuilt in the backward from what is kept (memory-bound work only).
* `offload` (GPU): as `selective`, with the kept tensors moved to pinned host
  memory between the forward and the backward.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.ad_checkpoint import checkpoint_name

from moe_jax.kernels import blockwise_attention

# Names of what `selective` keeps; the model tags these tensors where it makes them.
LAYER_INPUT = "layer_input"  # each block's output, the next block's input
QKV = "qkv"  # queries, keys, values as the attention core reads them (after any exchange)
CORE = blockwise_attention.RESIDUALS  # the flash core's output and softmax statistics
ATTENTION_OUT = "attention_out"  # the out-projection's input where an exchange made it
FFN_INPUT = "ffn_input"  # the residual stream entering the FFN norm
EXPERT_ROWS = "expert_rows"  # the rows the experts receive (after any exchange)
FC1_FC3 = "fc1_fc3"  # SwiGLU's gate and up projections (experts and dense MLPs)
FC2 = "fc2"  # the down projection's output
# MLA's down-projections' outputs, before their norms: the query latent and the joint
# [key/value latent, shared rotary key] (`moe_jax.model.mla`); its up-projections'
# outputs are the q/k/v of QKV.
MLA_LATENT = "mla_latent"
KEPT = (LAYER_INPUT, QKV, CORE, ATTENTION_OUT, FFN_INPUT, EXPERT_ROWS, FC1_FC3, FC2, MLA_LATENT)


def tag(x, name: str):
    """`x` (an array or a tree) named for the remat policy."""
    return jax.tree.map(lambda a: checkpoint_name(a, name), x)


def policy(remat: str):
    """The `jax.checkpoint` policy of a `model.remat` setting (None: save nothing)."""
    if remat == "selective":
        return jax.checkpoint_policies.save_only_these_names(*KEPT)
    if remat == "offload":
        return jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[],
            names_which_can_be_offloaded=list(KEPT),
            offload_src="device",
            offload_dst="pinned_host",
        )
    return None


def wrap(body: Callable, remat: str) -> Callable:
    """`body` (one scanned unit) under the recomputation `remat` asks for."""
    if remat == "none":
        return body
    return jax.checkpoint(body, policy=policy(remat))
