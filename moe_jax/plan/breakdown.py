"""The keys of a plan's step breakdown (`moe_jax.plan.cost_model.StepCost.breakdown`),
as the planner's explanation and table group them: compute, and exposed communication
(the pipeline bubble is the rest)."""

from __future__ import annotations

COMPUTE = (
    "expert_gemm",
    "dense_gemm",
    "attention_core",
    "routing_permute",
    "elementwise",
    "fp8_casts",
    "grad_accumulation",
    "optimizer",
    "newton_schulz",  # train.optimizer=muon (`moe_jax.plan.muon_cost`)
)
EXCHANGES = (
    "attention_exchange",
    "expert_exchange",
    "weight_gather",
    "pipeline_p2p",
    "grad_sync",
    "muon_exchange",  # train.optimizer=muon (`moe_jax.plan.muon_cost`)
)
