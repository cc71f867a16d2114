"""What the pipeline tests share: a small model with a dense first layer and four MoE
layers (four stages, or two with two repeats, cut it), its plans, and readers of the
compiled program."""

from __future__ import annotations

import dataclasses
import re

from moe_jax.config import Config, ParallelConfig
from moe_jax.parallel import mesh as mesh_lib
from moe_jax.parallel.scopes import PIPELINE
from moe_jax.tools import hlo_collectives
from moe_jax.train_step import abstract_state, with_shardings
from tests.layouts import BASE, planned_layout

# The layout tests' model (tests/layouts.py) with a dense first layer and four MoE
# layers, a sequence aux loss, and a batch M = 8 micro-batches can split.
MODEL = dataclasses.replace(
    BASE,
    model=dataclasses.replace(BASE.model, num_layers=5, first_k_dense=1, mlp_dim=48),
    moe=dataclasses.replace(BASE.moe, seq_aux_loss_coef=0.05),
    train=dataclasses.replace(BASE.train, batch_size=16),
)


def pipelined(stages, data, intra, micro, repeats=1, attention="sp", experts="ep_a2a"):
    plan = ParallelConfig(
        attention=attention,
        experts=experts,
        intra=intra,
        data=data,
        stages=stages,
        microbatches=micro,
        repeats=repeats,
    )
    return dataclasses.replace(MODEL, parallel=plan)


def one_device(micro: int) -> Config:
    """The reference: the same micro-batches accumulated on one device."""
    return dataclasses.replace(MODEL, train=dataclasses.replace(MODEL.train, grad_accum=micro))


def pipeline_trip_counts(hlo: str) -> list[int]:
    """Known trip counts of the `while` loops the pipeline's scope made."""
    counts = []
    for ins in hlo_collectives.instructions(hlo):
        if ins.opcode == "while" and PIPELINE in ins.op_name:
            found = re.search(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"', ins.attrs)
            if found:
                counts.append(int(found.group(1)))
    return counts


def placed(config):
    config, layout = planned_layout(config)
    _, abstract = abstract_state(config, layout)
    shardings = mesh_lib.train_state_shardings(abstract, layout, config.parallel.zero)
    return config, layout, with_shardings(abstract, shardings), shardings
