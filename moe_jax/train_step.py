"""One jitted training step: loss, gradients, AdamW update, router-bias update.

The model is split into a static graph and two state trees: `params`
(trained by the optimizer) and `biases` (the routers' balancing biases,
updated by the sign rule after each step, never by gradients).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from moe_jax.config import Config, TrainConfig
from moe_jax.model.transformer import Transformer
from moe_jax.moe.balancing import update_bias
from moe_jax.moe.block import RouterBias


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    step: jax.Array
    params: nnx.State
    biases: nnx.State
    opt_state: optax.OptState


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """AdamW with linear warmup and cosine decay; decay only on matrices."""
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, cfg.learning_rate, max(cfg.warmup_steps, 1), max(cfg.steps, cfg.warmup_steps + 1)
    )
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
    adamw = optax.adamw(schedule, cfg.b1, cfg.b2, weight_decay=cfg.weight_decay, mask=decay_mask)
    if cfg.grad_clip > 0:
        return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), adamw)
    return adamw


def build_model(config: Config, seed: int | None = None) -> Transformer:
    seed = config.train.seed if seed is None else seed
    return Transformer(config.model, config.moe, rngs=nnx.Rngs(seed))


def init_state(config: Config, model: Transformer | None = None):
    """(graphdef, TrainState) for a freshly initialised model."""
    model = model if model is not None else build_model(config)
    graphdef, params, biases = nnx.split(model, nnx.Param, RouterBias)
    opt_state = make_optimizer(config.train).init(params)
    return graphdef, TrainState(jnp.zeros((), jnp.int32), params, biases, opt_state)


def loss_fn(params, biases, graphdef, batch, config: Config):
    """Total loss and its parts; MoE terms are summed over MoE layers."""
    logits, stats = nnx.merge(graphdef, params, biases)(batch["inputs"])
    lm_loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()
    metrics = {"lm_loss": lm_loss}
    loss = lm_loss
    if stats is not None:
        moe = config.moe
        metrics.update(
            aux_loss=stats.aux_loss.sum(),
            seq_aux_loss=stats.seq_aux_loss.sum(),
            z_loss=stats.z_loss.sum(),
            load=stats.load,
            expert_load_max_over_mean=stats.max_over_mean(),
            dropped_fraction=stats.dropped_fraction.mean(),
        )
        loss = (
            loss
            + moe.aux_loss_coef * metrics["aux_loss"]
            + moe.seq_aux_loss_coef * metrics["seq_aux_loss"]
            + moe.z_loss_coef * metrics["z_loss"]
        )
    metrics["loss"] = loss
    return loss, metrics


def train_step(graphdef, config: Config, state: TrainState, batch):
    """Returns the next state and this step's metrics."""
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    (_, metrics), grads = grad_fn(state.params, state.biases, graphdef, batch, config)
    tx = make_optimizer(config.train)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    biases = state.biases
    if "load" in metrics and config.moe.bias_update_rate > 0:
        rate = config.moe.bias_update_rate
        biases = jax.tree.map(lambda b: update_bias(b, metrics["load"], rate), biases)
    metrics["grad_norm"] = optax.tree.norm(grads)
    return TrainState(state.step + 1, params, biases, opt_state), metrics
