"""The train state: the model's parameters and router biases, the optimizer's state, the
step counter and the RNG key, and how a fresh one is made.

Why a module of its own: the planner's memory model (`moe_jax.plan.memory`) traces the
state's shapes, and planning must not depend on the training step.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from optax.contrib import MuonDimensionNumbers

from moe_jax.config import Config, TrainConfig
from moe_jax.model.transformer import Transformer
from moe_jax.moe.block import RouterBias
from moe_jax.optimizer import make_optimizer, muon_dimensions
from moe_jax.parallel import mesh, pipeline, zero_padding
from moe_jax.parallel.layout import SINGLE_DEVICE, Layout


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    step: jax.Array
    params: nnx.State
    biases: nnx.State
    opt_state: optax.OptState
    rng: jax.Array  # raw uint32 key data, so checkpoints hold plain arrays


def build_model(config: Config, layout: Layout = SINGLE_DEVICE) -> Transformer:
    """The model laid out by `layout`, its MoE stack held as the layout's pipeline runs
    it (`moe_jax.parallel.pipeline.hold`)."""
    model = Transformer(config.model, config.moe, rngs=nnx.Rngs(config.train.seed), layout=layout)
    return pipeline.hold(model, layout)


def init_state(config: Config, layout: Layout = SINGLE_DEVICE):
    """(graphdef, TrainState) for a freshly initialised model laid out by `layout`."""
    model = build_model(config, layout)
    graphdef, params, biases = nnx.split(model, nnx.Param, RouterBias)
    pads = moment_paddings(config.train, params, layout)
    opt_state = make_optimizer(config.train).init(zero_padding.pad(params, pads))
    rng = jax.random.key_data(jax.random.key(config.train.seed))
    return graphdef, TrainState(jnp.zeros((), jnp.int32), params, biases, opt_state, rng)


def moment_paddings(cfg: TrainConfig, params, layout: Layout | None) -> tuple:
    """Per parameter (in `jax.tree.leaves` order) how ZeRO-1 pads its moments under
    `layout` (`moe_jax.parallel.zero_padding`): any AdamW moment, no Muon matrix's."""
    leaves = jax.tree.leaves(params)
    if layout is None or layout.zero != 1:
        return (None,) * len(leaves)
    eligible = None
    if cfg.optimizer == "muon":
        dims = muon_dimensions(params)
        whole = lambda d: d is None or isinstance(d, MuonDimensionNumbers)
        eligible = [d is None for d in jax.tree.leaves(dims, is_leaf=whole)]
    return mesh.moment_paddings(params, layout, eligible)
