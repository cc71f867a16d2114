"""The MegaScale-MoE paper's scaling table (Table 3) against the cost model's prediction.

Why: the planner's constants come from public kernel and link measurements, not from
this table, so the table is an independent check of the whole model. Internal-352B
(`configs/megascale_352b.py`) on H800s, global batch 720 x 8192 tokens, 15 pipeline
stages. The paper's plan is SP attention + EP experts with n = 8 and the standard
all-to-all (`ep_a2a`; our dropless static buffers hold top-k x t rows for every
destination, an upper bound on the volume of the paper's Eq. 3, so the row is if
anything slow), selective activation rematerialization (the paper's SAR: only cheap
memory-bound operators are recomputed) and BF16 gradient exchange (the paper's
communication compression). Its baseline is Megatron-LM with tensor parallelism 8 for
both blocks, no token-exchange overlap, full recompute (the config's `remat="full"`)
and float32 gradient reduction (Megatron's --accumulate-allreduce-grads-in-fp32).
Both run 1F1B pipelines (`paper_modes.PAPER_PIPELINE`), not the trainer's.

    python -m moe_jax.plan.paper_table
"""

from __future__ import annotations

import dataclasses
import os
import runpy
from pathlib import Path

from moe_jax import config as config_lib
from moe_jax.config import Config
from moe_jax.flops import PEAK_TFLOPS
from moe_jax.plan import paper_modes, planner
from moe_jax.plan.hardware import GPU, get

GLOBAL_BATCH = 720
STAGES = 15
# The paper's step times fit (m + p - 1) * t with m = 720 / data one-sequence
# micro-batches for both systems (t ~ 58 ms and ~104 ms at every size).
MICRO_BATCH = 1
PAPER_EXPERTS = ("ep_a2a",)
PAPER_REMAT = "selective"  # MegaScale-MoE's SAR
PAPER_GRAD_DTYPE = "bfloat16"  # MegaScale-MoE's compressed gradient exchange
H800_PEAK = PEAK_TFLOPS["H800"] * 1e12
CONFIG = Path(__file__).resolve().parents[2] / "configs" / "megascale_352b.py"


@dataclasses.dataclass(frozen=True)
class PaperRow:
    """One row of the paper's Table 3 (seconds per step, tokens per second)."""

    gpus: int
    megatron_step_s: float
    megatron_tokens_per_sec: float
    megascale_step_s: float
    megascale_tokens_per_sec: float
    speedup: float


PAPER_MFU = {240: 0.3248, 1440: 0.2789}  # MegaScale-MoE's MFU, as the paper counts FLOPs
TABLE3 = (
    PaperRow(240, 39.94, 151.1e3, 21.61, 272.9e3, 1.81),
    PaperRow(480, 19.56, 301.1e3, 11.83, 498.6e3, 1.65),
    PaperRow(720, 13.70, 430.5e3, 7.97, 740.1e3, 1.72),
    PaperRow(960, 10.82, 550.2e3, 6.12, 963.8e3, 1.77),
    PaperRow(1440, 7.90, 746.6e3, 4.19, 1407.7e3, 1.88),
)


@dataclasses.dataclass(frozen=True)
class Row:
    """The prediction for one cluster size beside the paper's measurement."""

    paper: PaperRow
    megatron: planner.Candidate
    megascale: planner.Candidate

    @property
    def speedup(self) -> float:
        return self.megascale.cost.tokens_per_sec / self.megatron.cost.tokens_per_sec

    @property
    def errors(self) -> dict[str, float]:
        """Relative error of each prediction (prediction / paper - 1)."""
        p = self.paper
        return {
            "megatron": self.megatron.cost.tokens_per_sec / p.megatron_tokens_per_sec - 1,
            "megascale": self.megascale.cost.tokens_per_sec / p.megascale_tokens_per_sec - 1,
            "speedup": self.speedup / p.speedup - 1,
        }


def load_config() -> Config:
    return config_lib.load(runpy.run_path(str(CONFIG))["get_config"]())


def rows(config: Config | None = None, gpu: GPU | str = "h800") -> list[Row]:
    """Both plans predicted at every cluster size of Table 3."""
    config = config or load_config()
    gpu = get(gpu) if isinstance(gpu, str) else gpu
    out = []
    for paper in TABLE3:
        megascale = planner.rank(
            config,
            paper.gpus,
            gpu,
            GLOBAL_BATCH,
            STAGES,
            paper_modes.PAPER_OVERLAP,  # the paper's system, not one the trainer runs
            limit=1,
            check_memory=False,  # the paper ran these plans on these GPUs
            micro_batch=MICRO_BATCH,
            attention=("sp",),
            experts=PAPER_EXPERTS,
            intra=(gpu.gpus_per_node,),
            remat=PAPER_REMAT,
            grad_dtype=PAPER_GRAD_DTYPE,
            pipeline=paper_modes.PAPER_PIPELINE,  # its 1F1B pipeline, not the trainer's
        ).best
        megatron = planner.megatron_baseline(
            config,
            paper.gpus,
            gpu,
            GLOBAL_BATCH,
            STAGES,
            check_memory=False,
            micro_batch=MICRO_BATCH,
        ).best
        out.append(Row(paper, megatron, megascale))
    return out


def format_table(table: list[Row]) -> str:
    """GPUs | Megatron tokens/s (ours, paper, error) | SP+EP | speed-up, and MFU."""
    head = (
        f"{'GPUs':>5} | {'Megatron tok/s':>14} {'paper':>8} {'error':>7} | "
        f"{'SP+EP tok/s':>11} {'paper':>8} {'error':>7} | "
        f"{'speed-up':>8} {'paper':>6} {'error':>7} | {'MFU ours':>8} {'plan':<18}"
    )
    lines = [
        f"Internal-352B on H800, global batch {GLOBAL_BATCH} x 8192, {STAGES} stages: "
        "predicted against the paper's Table 3",
        head,
        "-" * len(head),
    ]
    for r in table:
        e, p = r.errors, r.paper
        ms, mt = r.megascale.cost, r.megatron.cost
        lines.append(
            f"{p.gpus:>5} | {mt.tokens_per_sec / 1e3:>13.1f}k "
            f"{p.megatron_tokens_per_sec / 1e3:>7.1f}k "
            f"{e['megatron']:>+7.1%} | {ms.tokens_per_sec / 1e3:>10.1f}k "
            f"{p.megascale_tokens_per_sec / 1e3:>7.1f}k {e['megascale']:>+7.1%} | "
            f"{r.speedup:>7.2f}x {p.speedup:>5.2f}x {e['speedup']:>+7.1%} | "
            f"{ms.mfu:>8.1%} {ms.plan.label:<18}"
        )
    lines.append(_flops_note(table))
    return "\n".join(lines)


def _flops_note(table: list[Row]) -> str:
    """FLOPs per token behind each MFU: ours (`moe_jax.flops`) and the paper's, implied by
    its MFU, throughput and GPU count."""
    per_token = lambda mfu, gpus, tokens_per_sec: mfu * gpus * H800_PEAK / tokens_per_sec
    ms = table[0].megascale.cost
    ours = per_token(ms.mfu, ms.plan.devices, ms.tokens_per_sec)
    paper = [
        per_token(PAPER_MFU[r.paper.gpus], r.paper.gpus, r.paper.megascale_tokens_per_sec)
        for r in table
        if r.paper.gpus in PAPER_MFU
    ]
    return (
        f"MFU ours: {ours / 1e9:.0f} GFLOP/token (moe_jax.flops); the paper's MFU "
        f"({', '.join(f'{v:.2%}' for v in PAPER_MFU.values())}) implies "
        f"{', '.join(f'{f / 1e9:.0f}' for f in paper)} GFLOP/token"
    )


def main() -> None:
    print(format_table(rows()), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the memory model only traces shapes
    main()
