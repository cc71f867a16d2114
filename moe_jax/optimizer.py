"""The optimizer: AdamW, or Muon for the hidden matrices (`train.optimizer`), after
global-norm clipping, and its learning-rate schedule.

Why a module of its own: the train state holds this optimizer's state, and the
planner's memory model reads the state's shapes (`moe_jax.train_state`) without
depending on the training step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax.contrib import MuonDimensionNumbers, MuonState, scale_by_muon
from optax.contrib._muon import orthogonalize_via_newton_schulz, scale_by_shape

from moe_jax.config import TrainConfig

# The matrices Muon updates, by parameter name: (reduction axes, output axes), counted
# from the end. Leading axes (the stack's layers, the experts, a pipeline's repeats)
# are batch axes: each layer's and each expert's matrix is orthogonalised on its own.
# Any other parameter (embedding table, output head, routers, norms, biases) is
# AdamW's; tests/test_muon.py checks every parameter of the model families is named.
_QKV = ((-3,), (-2, -1))  # [..., in, heads, head_dim]
_LINEAR = ((-2,), (-1,))  # [..., in, out]
MUON_MATRICES = {
    **dict.fromkeys(("query", "key", "value", "query_up", "kv_up"), _QKV),
    "out": ((-3, -2), (-1,)),  # [..., heads, head_dim, embed]
    **dict.fromkeys(("gate", "up", "down", "query_down", "kv_down", "eh_proj"), _LINEAR),
}
# Moonlight's scale (Liu et al. 2025): 0.2 sqrt(max(fan_in, fan_out)) gives the update
# AdamW's RMS, so that AdamW's learning rate and weight decay carry over.
MUON_RMS = 0.2
# Newton-Schulz steps per update (optax's default): not a setting; tests compile the
# step with fewer to show that no collective runs per step.
NS_STEPS = 5


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


def kept_in(
    inner: optax.GradientTransformation, dtype, moments: tuple[str, ...]
) -> optax.GradientTransformation:
    """`inner` with its state's `moments` fields stored in `dtype` between steps and
    updated in float32: they are widened before `inner` runs and rounded after it, so
    each update is computed from float32 moments (optax's own `mu_dtype` would compute
    `b1 * mu` in the narrow type). The state's tree stays `inner`'s."""
    if jnp.dtype(dtype) == jnp.float32:
        return inner
    cast = lambda state, to: state._replace(
        **{name: optax.tree.cast(getattr(state, name), to) for name in moments}
    )

    def update(updates, state, params=None):
        updates, state = inner.update(updates, cast(state, jnp.float32), params)
        return updates, cast(state, dtype)

    return optax.GradientTransformation(lambda params: cast(inner.init(params), dtype), update)


def adamw(cfg: TrainConfig, lr: optax.Schedule | None = None) -> optax.GradientTransformation:
    """`optax.adamw`'s chain (its state tree) at the schedule `learning_rate(cfg)`, or at
    `lr` (the train step passes a schedule that returns the rate it was given), the
    moments kept in `train.moment_dtype` (`kept_in`: as DeepSeek-V3 kept both in bf16;
    master weights and gradient sums stay float32). Either way the state holds the
    schedule's step count, so checkpoints read the same tree."""
    adam = optax.scale_by_adam(cfg.b1, cfg.b2, eps=cfg.eps)
    return optax.chain(
        kept_in(adam, cfg.moment_dtype, ("mu", "nu")),
        optax.add_decayed_weights(cfg.weight_decay, decay_mask(cfg)),
        optax.scale_by_learning_rate(learning_rate(cfg) if lr is None else lr),
    )


def _name(path) -> str:
    """A parameter's own name: the last string key of its path."""
    keys = [p.key for p in path if isinstance(getattr(p, "key", None), str)]
    return keys[-1] if keys else ""


def muon_dimensions(params):
    """Per parameter its `MuonDimensionNumbers`, or None where AdamW updates it."""

    def dims(path, leaf):
        axes = MUON_MATRICES.get(_name(path))
        return None if axes is None or leaf.ndim < 2 else MuonDimensionNumbers(*axes)

    return jax.tree_util.tree_map_with_path(dims, params)


def _orthogonalised(x: jax.Array, dims: MuonDimensionNumbers, coeffs, steps: int, place):
    """optax's Newton-Schulz (`orthogonalize_via_newton_schulz`) on each matrix of `x`,
    run where `place` (`moe_jax.parallel.muon_placement.Placement`) puts the matrices
    whole. The stacking dimensions stay separate dimensions (optax merges them into one,
    which would move the stack's shards between devices): the matrices are vmapped over
    each of them."""
    matrix = sorted(a % x.ndim for a in (*dims.reduction_axis, *dims.output_axis))
    batch = x.ndim - len(matrix)
    if matrix != list(range(batch, x.ndim)):  # MUON_MATRICES: trailing, in order
        raise ValueError(f"Muon matrix axes {dims} are not the trailing axes of {x.shape}")
    fan_in = int(np.prod([x.shape[a % x.ndim] for a in dims.reduction_axis]))
    one = lambda m: orthogonalize_via_newton_schulz(m, coeffs, steps)
    for _ in range(batch):
        one = jax.vmap(one)
    block = lambda b: one(b.reshape(*b.shape[:batch], fan_in, -1)).reshape(b.shape)
    return place.run(block, x)


def scale_by_placed_muon(
    beta: float, dimensions, placements, steps: int = NS_STEPS
) -> optax.GradientTransformation:
    """optax's `scale_by_muon` (its state, its Nesterov momentum written with its own
    tree helpers) with each matrix's Newton-Schulz run where `placements` (a tree like
    the parameters': a `Placement` per Muon matrix, None elsewhere) puts it."""
    base = scale_by_muon(beta=beta, ns_steps=steps, weight_dimension_numbers=dimensions)

    def update(updates, state, params=None):
        mu = optax.tree.update_moment(updates, state.mu, beta, 1)
        count = optax.safe_increment(state.count)
        nesterov = jax.tree.map(
            lambda m, g: beta * m + (1 - beta) * g,
            optax.tree.bias_correction(mu, beta, optax.safe_increment(count)),
            optax.tree.bias_correction(updates, beta, count),
        )
        orthogonalise = lambda x, d, p: (
            x if p is None else _orthogonalised(x, d, state.ns_coeffs, steps, p)
        )
        is_leaf = lambda x: isinstance(x, optax.MaskedNode)
        dims = dimensions(updates)
        out = jax.tree.map(orthogonalise, nesterov, dims, placements, is_leaf=is_leaf)
        return out, MuonState(count=count, mu=mu, ns_coeffs=state.ns_coeffs)

    return optax.GradientTransformation(base.init, update)


def muon(
    cfg: TrainConfig, lr: optax.Schedule | None = None, placements=None, steps: int | None = None
) -> optax.GradientTransformation:
    """Muon for the hidden matrices (`MUON_MATRICES`), AdamW (`adamw`) for the rest, at
    the schedule `learning_rate(cfg)` or `lr`. Built from optax's parts: its
    `scale_by_muon` (Nesterov momentum `train.muon_momentum`, kept in
    `train.moment_dtype`, bias-corrected, then `NS_STEPS` Newton-Schulz steps with the
    quintic coefficients on each matrix, Frobenius normalised first) and `scale_by_shape`
    (`MUON_RMS`), then decoupled weight decay on every matrix and the learning rate, as
    AdamW's. With `placements` (`moe_jax.parallel.muon_placement.placements`, from the
    train step) Newton-Schulz runs on whole matrices (`scale_by_placed_muon`)."""
    rate = learning_rate(cfg) if lr is None else lr
    steps = NS_STEPS if steps is None else steps
    if placements is None:
        orthogonal = scale_by_muon(
            beta=cfg.muon_momentum, ns_steps=steps, weight_dimension_numbers=muon_dimensions
        )
    else:
        orthogonal = scale_by_placed_muon(cfg.muon_momentum, muon_dimensions, placements, steps)
    matrices = optax.chain(
        kept_in(orthogonal, cfg.moment_dtype, ("mu",)),
        scale_by_shape(weight_dimension_numbers=muon_dimensions, consistent_rms=MUON_RMS),
        optax.add_decayed_weights(cfg.weight_decay),
        optax.scale_by_learning_rate(rate),
    )
    labels = lambda params: jax.tree.map(
        lambda d: "adamw" if d is None else "muon",
        muon_dimensions(params),
        is_leaf=lambda x: x is None or isinstance(x, MuonDimensionNumbers),
    )
    return optax.partition({"muon": matrices, "adamw": adamw(cfg, rate)}, labels)


def update_rule(cfg: TrainConfig, lr: optax.Schedule | None = None, placements=None):
    """`train.optimizer`'s transformation (without the clipping); `placements`: where
    Muon's Newton-Schulz runs (`muon`)."""
    return muon(cfg, lr, placements) if cfg.optimizer == "muon" else adamw(cfg, lr)


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """`update_rule` after global-norm clipping: the optimizer whose state checkpoints
    hold (`apply_gradients` runs its two parts itself)."""
    if cfg.grad_clip > 0:
        return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), update_rule(cfg))
    return update_rule(cfg)
