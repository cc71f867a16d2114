"""The modes of the paper's systems that the trainer does not run, for reproducing the
paper's table (`moe_jax.plan.paper_table`) and its Megatron-LM baseline only; the
planner never offers them to the trainer.

* `PAPER_OVERLAP`: MegaScale-MoE's overlap, every block's exchange pipelined over
  `Efficiency.overlap_chunks` chunks, the row gather and scatter fused into the grouped
  GEMM (its intra-operator fusion).
* `PAPER_PIPELINE`: the 1F1B pipeline of Megatron-LM and MegaScale-MoE: all layers cut
  contiguously, embedding on the first stage, head on the last (the trainer pipelines
  its MoE stack only, by `parallel.schedule`).
"""

from __future__ import annotations

PAPER_OVERLAP = "megascale"  # the paper's system, for reproducing its table only
PAPER_PIPELINE = "paper_1f1b"
