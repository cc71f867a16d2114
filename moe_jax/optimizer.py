"""The optimizer: AdamW after global-norm clipping, and its learning-rate schedule.

Why a module of its own: the train state holds this optimizer's state, and the
planner's memory model reads the state's shapes (`moe_jax.train_state`) without
depending on the training step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from moe_jax.config import TrainConfig


def learning_rate(cfg: TrainConfig) -> optax.Schedule:
    """Linear warmup to the peak over `warmup_steps`, then `schedule`:

    * `cosine`, `linear`: decay to min_lr_ratio * peak at the last step;
    * `constant`: the peak to the end;
    * `wsd` (warmup-stable-decay): the peak until the last `wsd_decay_fraction` of
      the steps, then linear decay to the floor (a run can be extended, or branched
      into a decay, from any checkpoint of the stable phase);
    * `inverse_sqrt`: peak * sqrt(warmup / step), never under the floor.
    """
    peak, floor = cfg.learning_rate, cfg.learning_rate * cfg.min_lr_ratio
    warmup = optax.linear_schedule(0.0, peak, max(cfg.warmup_steps, 1))
    after = max(cfg.steps - cfg.warmup_steps, 1)  # steps after the warmup
    if cfg.schedule == "cosine":
        decay = optax.cosine_decay_schedule(peak, after, alpha=cfg.min_lr_ratio)
    elif cfg.schedule == "linear":
        decay = optax.linear_schedule(peak, floor, after)
    elif cfg.schedule == "constant":
        decay = optax.constant_schedule(peak)
    elif cfg.schedule == "wsd":
        # A warmup reaching into the decay window shortens the decay, not the floor.
        decaying = min(max(round(cfg.steps * cfg.wsd_decay_fraction), 1), after)
        stable = max(after - decaying, 0)
        decay = optax.linear_schedule(peak, floor, decaying, transition_begin=stable)
    else:  # inverse_sqrt; join_schedules counts steps from the end of the warmup
        warm = max(cfg.warmup_steps, 1)
        decay = lambda step: jnp.maximum(peak * jnp.sqrt(warm / (step + warm)), floor)
    return optax.join_schedules([warmup, decay], [cfg.warmup_steps])


def decay_mask(cfg: TrainConfig):
    """Weight decay on matrices; never on biases; norm scales (the q/k norms' too) and
    the embedding table as configured."""

    def decays(path, leaf) -> bool:
        names = {str(getattr(p, "key", getattr(p, "name", ""))) for p in path}
        if any(name.endswith("_bias") for name in names):
            return False
        if "scale" in names:
            return cfg.decay_norms
        if "table" in names:
            return cfg.decay_embeddings
        return leaf.ndim >= 2

    return lambda params: jax.tree_util.tree_map_with_path(decays, params)


def rates(cfg: TrainConfig, start: int = 0, stop: int | None = None) -> np.ndarray:
    """The learning rates (float32) of the updates made from the states of steps
    `start` to `stop` - 1 (default `train.steps` - 1; the state of step 0 takes the
    first update), by `learning_rate`, computed at once on the host before a run: the
    train step takes its rate as an argument, and reading one per step from the devices
    would make the loop wait. Jitted: one small program (cached across processes)
    instead of a dozen eagerly compiled operations at every start."""
    stop = cfg.steps if stop is None else stop
    steps = np.arange(start, max(stop, start), dtype=np.int32)
    return np.asarray(jax.jit(learning_rate(cfg))(steps), np.float32).reshape(len(steps))


def adamw(cfg: TrainConfig, lr: optax.Schedule | None = None) -> optax.GradientTransformation:
    """`optax.adamw` at the schedule `learning_rate(cfg)`, or at `lr` (the train step
    passes a schedule that returns the rate it was given). Either way the state holds
    the schedule's step count, so checkpoints read the same tree."""
    return optax.adamw(
        learning_rate(cfg) if lr is None else lr,
        cfg.b1,
        cfg.b2,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        mask=decay_mask(cfg),
    )


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """AdamW after global-norm clipping: the optimizer whose state checkpoints hold
    (`apply_gradients` runs its two parts itself)."""
    if cfg.grad_clip > 0:
        return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), adamw(cfg))
    return adamw(cfg)
