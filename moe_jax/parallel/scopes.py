"""Name scopes that mark ops in the compiled program: one table for writer and reader.

The layouts in `moe_jax.parallel` put their exchanges, chunks and ring steps under
these scopes (`jax.named_scope`); `moe_jax.tools.hlo_collectives` reads them back
from each compiled op's `op_name` to tag what it counts. No jax import, so the
reader stays jax-free.
"""

from __future__ import annotations

# Tokens moved between layouts, the router statistics combined across devices, and
# the vocabulary-parallel loss's gathers and reductions. Other collectives serve
# parameters.
TOKEN_EXCHANGE, ROUTER_STATS, LOSS_EXCHANGE = "token_exchange", "router_stats", "loss_exchange"
# `parallel.grad_exchange='bf16_a2a'`'s gradient all-to-alls (`moe_jax.parallel.grad_exchange`),
# and the distributed optimizer's reduce-scatters and weight gathers
# (`moe_jax.parallel.distributed_optimizer`).
GRAD_EXCHANGE, WEIGHT_GATHER = "grad_exchange", "weight_gather"
# Muon's momentum moved to where each matrix is whole, and its update moved back
# (`moe_jax.parallel.muon_placement`).
MUON_EXCHANGE = "muon_exchange"
# The pipelined layer stack's tick loops, and its stage-to-stage sends
# (`moe_jax.parallel.pipeline`).
PIPELINE, STAGE_SEND = "pipeline", "stage_send"
# The batch's per-document positions (data.document_mask) gathered for layouts that
# split the sequence (`moe_jax.parallel.layout.Layout.positions`) and for every stage
# of a pipeline (`moe_jax.parallel.pipeline`).
DOCUMENT_POSITIONS = "document_positions"
# Each attention head's peak logit reduced over the devices (train.qk_clip,
# `moe_jax.parallel.peaks`): heads x 4 bytes per layer.
ATTENTION_PEAKS = "attention_peaks"
# The scopes that make a collective an activation exchange, in the order the reader
# tries them (`moe_jax.tools.hlo_collectives`' `tag`).
TAGS = (
    TOKEN_EXCHANGE,
    ROUTER_STATS,
    LOSS_EXCHANGE,
    STAGE_SEND,
    DOCUMENT_POSITIONS,
    ATTENTION_PEAKS,
)
# Chunk c of a block run in `parallel.overlap_chunks` pieces is under `chunk_scope(c)`,
# step i of a collective matmul's ring (`parallel.collective_matmul`) under `ring_scope(i)`.
CHUNK, RING = "chunk", "ring"


def chunk_scope(c: int) -> str:
    return f"{CHUNK}{c}"


def ring_scope(i: int) -> str:
    return f"{RING}{i}"
