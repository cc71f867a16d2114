"""The collectives of the compiled training step under AdamW, under Muon with its
Newton-Schulz left to XLA on the weights' own sharding, and under Muon with each matrix
whole where Newton-Schulz runs (`moe_jax.parallel.muon_placement`): executions per step
of each kind, on 8 forced CPU devices.

Why: docs/training.md's Muon section quotes these counts; this script is where they
come from. Nothing runs; each step is compiled from abstract inputs
(`moe_jax.tools.comm_report.compile_step`).

    python bench/muon_collectives.py [--config configs/mixtral_tiny.py] \\
        [--plans tp+etp,fsdp+ep_ag+expert_fsdp,sp+ep_a2a] [--intra 4]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import runpy

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import repo_root  # noqa: F401

from moe_jax import config as config_lib
from moe_jax.parallel import muon_placement
from moe_jax.tools import comm_report, hlo_collectives

DEVICES = 8


def counts(config) -> dict[str, int]:
    """Executions per step of each collective kind in `config`'s compiled step."""
    hlo, _ = comm_report.compile_step(config, {"xla_backend_optimization_level": 0})
    total = collections.Counter()
    for c in hlo_collectives.parse(hlo):
        total[c.kind] += c.count
    return dict(sorted(total.items()))


def variant(base, plan: str, intra: int, optimizer: str):
    """`base` under `attention+experts[+expert_fsdp]` on `intra` x (8 / intra) devices."""
    attention, experts, *more = plan.split("+")
    parallel = dataclasses.replace(
        base.parallel,
        attention=attention,
        experts=experts,
        expert_fsdp="expert_fsdp" in more,
        intra=intra,
        data=DEVICES // intra,
    )
    train = dataclasses.replace(base.train, optimizer=optimizer)
    return comm_report.validated(dataclasses.replace(base, parallel=parallel, train=train), DEVICES)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/mixtral_tiny.py")
    parser.add_argument("--plans", default="tp+etp,fsdp+ep_ag+expert_fsdp,sp+ep_a2a")
    parser.add_argument("--intra", type=int, default=4)
    args = parser.parse_args()
    base = config_lib.load(runpy.run_path(args.config)["get_config"]())
    placed = muon_placement.of_state
    for plan in args.plans.split(","):
        print(plan, "AdamW", counts(variant(base, plan, args.intra, "adamw")), flush=True)
        muon = variant(base, plan, args.intra, "muon")
        muon_placement.of_state = lambda *args: None  # Newton-Schulz left to XLA
        print(plan, "Muon, XLA's", counts(muon), flush=True)
        muon_placement.of_state = placed
        print(plan, "Muon, whole matrices", counts(muon), flush=True)


if __name__ == "__main__":
    main()
