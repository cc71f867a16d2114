"""The names `parallel.attention`, `parallel.experts` and `parallel.gpu` choose from.

Their owners (the layout registry, the planner's GPU presets) import jax and the
blocks; `moe_jax.config` checks a config against these tables instead, so loading
and validating a config imports neither. `tests/test_imports.py` checks each table
against its owner, so a layout or preset added there and not here fails a test.
"""

from __future__ import annotations

# The keys of `moe_jax.parallel.registry.ATTENTION` and `.EXPERTS`, in their order.
ATTENTION_LAYOUTS = ("dp", "fsdp", "tp", "sp")
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "zero_bubble")
OPTIMIZERS = ("adamw", "muon")
MOMENT_DTYPES = ("float32", "bfloat16")  # `train.moment_dtype`
EXPERT_LAYOUTS = ("ep_a2a", "ep_a2a_ragged", "ep_ag", "etp", "ep_etp")
# The keys of `moe_jax.plan.hardware.GPUS`, in their order.
GPU_PRESETS = ("h800", "h100", "h200", "a100", "h20")
