"""What each memory feature saves on Mixtral-8x7B, per device, by the planner's memory model.

Why: the "Memory" section of docs/planner-and-memory.md quotes these figures; this
script is where they come from. It takes the plan the planner chooses for 64 H100
(pp=1, gradients synchronised per micro-batch as the trainer compiles them,
model.remat='selective'), prints the per-device breakdown the trainer prints at
start-up, then switches one feature off at a time and prints what the device would
need without it. Nothing is compiled: the model
traces shapes only (tests/test_plan_memory.py checks it against XLA).

    python bench/memory_savings.py [--gpus 64] [--gpu h100]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import runpy
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from moe_jax import config as config_lib
from moe_jax.config import Config
from moe_jax.memory_check import parameter_counts
from moe_jax.plan import memory, planner
from moe_jax.plan.describe import plan_line
from moe_jax.plan.resolve import check_plan

GB = 1e9
ROOT = Path(__file__).resolve().parents[1]


def _with(config: Config, section: str, **changes) -> Config:
    return dataclasses.replace(
        config, **{section: dataclasses.replace(getattr(config, section), **changes)}
    )


def _line(label: str, m: memory.Memory) -> str:
    return (
        f"{label:<58}{m.total / GB:>8.1f} GB  (params {m.params / GB:.1f}, grads "
        f"{m.grads / GB:.1f}, optimizer {m.optimizer / GB:.1f}, activations "
        f"{m.activations / GB:.1f})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=64)
    parser.add_argument("--gpu", default="h100")
    args = parser.parse_args()
    raw = runpy.run_path(str(ROOT / "configs" / "mixtral_8x7b.py"))["get_config"]()
    raw.model.remat = "selective"
    base = config_lib.load(raw)
    best = planner.rank(base, args.gpus, args.gpu, pp=1, limit=1, grad_sync="per_micro_batch")
    plan = best.best.plan
    # a GPU plan (nothing is compiled): checked as the GPU runs it
    config = check_plan(plan.config(base, base.train.batch_size), args.gpus, platform="gpu")
    total, active = parameter_counts(config)
    need = memory.memory_per_device(config)
    print(
        f"Mixtral-8x7B on {args.gpus} x {args.gpu}: {total / 1e9:.1f}B parameters, "
        f"{active / 1e9:.1f}B active per token"
    )
    print(
        f"plan: {plan_line(config.parallel)}, micro-batch {best.best.cost.micro_batch} x "
        f"{config.train.grad_accum}, remat={config.model.remat}, "
        f"attention_impl={config.model.attention_impl}"
    )
    print(_line("with every feature (what the trainer prints)", need))
    whole = 4 * total
    print(
        f"{'1 sharded start-up: params on one device':<58}{whole / GB:>8.1f} GB before "
        f"(the float32 model, whole), {(need.params + need.optimizer) / GB:.1f} GB now"
    )
    changed = {
        "3 expert weights not split over data": _with(config, "parallel", expert_fsdp=False),
        "3 and the vocabulary split (vocab_parallel)": _with(
            config, "parallel", vocab_parallel=True
        ),
        "4 attention_impl='xla' (stores s^2 scores), remat='none'": _with(
            _with(config, "model", remat="none"), "model", attention_impl="xla"
        ),
        "5 loss in one chunk (f32 [B, S, V] logits)": _with(config, "train", loss_chunks=1),
        "6 remat='none'": _with(config, "model", remat="none"),
        "6 remat='full'": _with(config, "model", remat="full"),
    }
    for label, other in changed.items():
        print(_line(label, memory.memory_per_device(check_plan(other, args.gpus, platform="gpu"))))
    a2a = _with(config, "parallel", attention="sp", experts="ep_a2a", expert_fsdp=False)
    a2a = check_plan(a2a, args.gpus, platform="gpu")
    for factor in (0.0, 2.0):
        bounded = _with(a2a, "parallel", a2a_buffer_factor=factor)
        terms = memory.block_activation_bytes(bounded, moe=True)
        rows = terms["expert_rows"] + terms["expert_hidden"]
        print(
            f"7 sp+ep_a2a, a2a_buffer_factor={factor:g}: expert rows and hidden "
            f"{rows / GB:.2f} GB per layer (no remat); "
            + _line("", memory.memory_per_device(bounded)).strip()
        )
    print(f"(the planner fills at most {planner.USABLE_MEMORY:.0%} of a GPU's memory)")


if __name__ == "__main__":
    main()
