"""One jitted training step: loss, gradients (accumulated over micro-batches),
AdamW update, router-bias update, and a skip when the loss, the gradients or the new
parameters are not finite.

The model is split into a static graph and two state trees: `params`
(trained by the optimizer) and `biases` (the routers' balancing biases,
updated by the sign rule after each step, never by gradients).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moe_jax import optimizer, qk_clip
from moe_jax.config import Config
from moe_jax.model import mtp as mtp_lib
from moe_jax.model.loss import loss_chunks, with_loss_weights
from moe_jax.model.transformer import split_peaks
from moe_jax.moe.balancing import update_biases
from moe_jax.parallel import (
    distributed_optimizer,
    grad_exchange,
    muon_placement,
    per_device_step,
    pipeline_1f1b,
    zero_padding,
)
from moe_jax.parallel import mesh as mesh_lib
from moe_jax.parallel import peaks as peaks_lib
from moe_jax.parallel.layout import Layout
from moe_jax.train_state import TrainState, init_state, moment_paddings


def abstract_state(config: Config, layout: Layout):
    """(graphdef, TrainState of shapes): nothing is computed or allocated."""
    return jax.eval_shape(lambda: init_state(config, layout))


def with_shardings(abstract, shardings):
    """An abstract state whose leaves carry their placement: what a restore reads into."""
    place = lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh)
    return jax.tree.map(place, abstract, shardings)


def init_program(config: Config, layout: Layout, shardings):
    """The jitted program that creates the initial TrainState with its outputs already
    placed by `shardings`: each device computes only its shards, so no array ever exists
    whole on one device (a Mixtral-sized model never fits on one)."""
    return jax.jit(lambda: init_state(config, layout)[1], out_shardings=shardings)


def init_placed(config: Config, layout: Layout, shardings):
    """The initial TrainState, made by `init_program`."""
    return init_program(config, layout, shardings)()


PEAKS = peaks_lib.METRIC  # the metric of each attention head's peak logit, per layer


def loss_fn(params, biases, graphdef, batch, config: Config, mtp: bool = True):
    """Total loss and its parts; MoE terms are summed over MoE layers. The language-model
    loss runs over `loss_chunks(...)` chunks of the sequence (`moe_jax.model.loss`).
    With `model.mtp_depth` (and `mtp`) the multi-token prediction term is added
    (`moe_jax.model.mtp`); a batch not yet `mtp.with_targets`'s must hold whole
    sequences (not one device's part)."""
    model = nnx.merge(graphdef, params, biases)
    chunks = loss_chunks(config, *batch["inputs"].shape)
    mtp_load = objective = None
    batch = with_loss_weights(batch)  # under a document mask: only counted targets
    positions, weights = batch.get("positions"), batch.get("weights")
    depth = config.model.mtp_depth if mtp else 0
    if depth:
        batch = mtp_lib.with_targets(batch, depth)
    if model.layout.loss_in_pipeline:  # 1F1B: the head and loss run inside the pipeline
        extra = (batch["mtp"], config.train.mtp_loss_weight) if depth else None
        objective, parts, stats = model.pipelined_losses(
            batch["inputs"], batch["targets"], chunks, positions, weights, extra
        )
        lm_loss, mtp_loss = parts["lm_loss"], parts.get("mtp_loss")
        if depth:
            stats, mtp_load = mtp_lib.merged(stats, parts["mtp_stats"])
    elif depth:
        lm_loss, mtp_loss, (stats, mtp_load) = mtp_lib.losses(model, batch, chunks)
    elif chunks == 1 and model.layout.chunk_loss is None:
        logits, stats = model(batch["inputs"], positions)
        lm_loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
        lm_loss = (lm_loss if weights is None else lm_loss * weights).mean()
    else:
        lm_loss, stats = model.chunked_loss(
            batch["inputs"], batch["targets"], chunks, positions, weights
        )
    stats, peaks = split_peaks(stats)
    metrics = {"lm_loss": lm_loss}
    if peaks is not None:  # per stack [units, blocks, heads]: for QK-clip (apply_gradients)
        metrics[PEAKS] = peaks
    loss = lm_loss
    if depth:
        metrics["mtp_loss"] = mtp_loss
        loss = loss + config.train.mtp_loss_weight * mtp_loss
    if mtp_load is not None:
        metrics["mtp_load"] = mtp_load
    if stats is not None:
        metrics.update(
            aux_loss=stats.aux_loss.sum(),
            seq_aux_loss=stats.seq_aux_loss.sum(),
            z_loss=stats.z_loss.sum(),
            load=stats.load,
            dropped_fraction=stats.dropped_fraction.mean(),
        )
        loss = loss + stats.loss(config.moe)
    metrics["loss"] = loss
    if objective is not None:  # the same value; the gradient comes by the objective
        loss = objective + jax.lax.stop_gradient(loss - objective)
    return loss, metrics


def _layout(graphdef, state: TrainState) -> Layout:
    return nnx.merge(graphdef, state.params, state.biases).layout


def _param_specs(state: TrainState, layout: Layout):
    return jax.tree.map(lambda s: s.spec, mesh_lib.state_shardings(state.params, layout))


def _synced(state: TrainState, layout: Layout, config: Config):
    """Which weights' gradients the backward sums itself (`per_device_step.step_gradients`):
    the distributed optimizer's stacked weights, layer by layer, or a 1F1B pipeline's
    stack (the model's `moe` stack), in the tick loop; None: all after the backward."""
    p = config.parallel
    if distributed_optimizer.syncs_in_backward(layout.zero, layout.stages, config.train.grad_accum):
        return distributed_optimizer.starts(state.params)
    if layout.loss_in_pipeline and pipeline_1f1b.sums_in_loop(p.schedule, p.zero):
        in_stack = lambda path, v: v.replace(path[0].key == "moe")
        is_variable = lambda x: isinstance(x, nnx.Variable)
        return jax.tree_util.tree_map_with_path(in_stack, state.params, is_leaf=is_variable)
    return None


def pipelined_loss(config: Config):
    """`loss_fn` for a pipelined model: its router statistics come as means over the
    `parallel.microbatches` micro-batches, so the load (a count) is scaled back to the
    step's total, as `accumulated` does."""
    micro = config.parallel.microbatches

    def loss(params, biases, graphdef, batch, config):
        total, metrics = loss_fn(params, biases, graphdef, batch, config)
        return total, _loads_times(metrics, micro)

    return loss


def gradients(state: TrainState, graphdef, batch, config: Config):
    """Mean loss metrics and gradients over `grad_accum` micro-batches (or a pipeline's
    `parallel.microbatches`). With `parallel.grad_exchange='bf16_a2a'` or a pipeline
    they are computed per device (`moe_jax.parallel.per_device_step`) and the gradients
    summed there (placed as it leaves them)."""
    layout = _layout(graphdef, state)
    batch = mtp_lib.with_targets(batch, config.model.mtp_depth)  # while sequences are whole
    batch = with_loss_weights(batch)  # while the batch is whole
    if not per_device_step.runs_per_device(layout):
        return accumulated(state.params, state.biases, graphdef, batch, config, loss_fn)
    specs = _param_specs(state, layout)
    loss = pipelined_loss(config) if layout.pipelined else loss_fn
    graphdef = per_device_step.per_device_graph(graphdef, state.params, state.biases)

    def per_device(params, biases, batch, loss_of, sync):
        return accumulated(params, biases, graphdef, batch, config, loss_of(loss), sync)

    # where the distributed optimizer may cut each master (else as the exchange cuts)
    starts = distributed_optimizer.starts(state.params) if layout.zero == 2 else None
    synced = _synced(state, layout, config)
    metrics, grads = per_device_step.step_gradients(
        layout,
        per_device,
        state.params,
        state.biases,
        batch,
        specs,
        config.model.dtype,
        starts,
        synced,
    )
    if layout.grad_exchange == "fp32" or layout.zero == 2:  # placed as the masters
        return metrics, grads
    return metrics, grad_exchange.gather_sums(layout, grads, specs, synced)


def accumulated(params, biases, graphdef, batch, config: Config, loss, sync=None):
    """`loss`'s metrics and gradients, accumulated over `grad_accum` micro-batches. With
    `sync` (`per_device_step.BackwardSync`, one micro-batch) the loss is differentiated
    by the master shards of the stacked weights, whose gradients its backward reduces
    layer by layer."""
    grad_fn = jax.value_and_grad(loss, has_aux=True)
    micro = config.train.grad_accum
    if sync is not None:
        synced_loss = lambda variables, *args: loss(sync.params(variables, params), *args)
        grad = jax.value_and_grad(synced_loss, has_aux=True)
        (_, metrics), grads = grad(sync.variables(params), biases, graphdef, batch, config)
        return metrics, grads
    if micro == 1:
        (_, metrics), grads = grad_fn(params, biases, graphdef, batch, config)
        return metrics, grads
    # Micro-batch m holds rows m, m + micro, ...: with the batch split over devices in
    # contiguous blocks (which `micro` divides), each device's micro-batches are its own
    # rows, nothing moves between devices, and a device that splits only its own rows
    # (inside the step's shard_map, `parallel.grad_exchange`) gets the same micro-batches.
    split = jax.tree.map(
        lambda x: x.reshape(x.shape[0] // micro, micro, *x.shape[1:]).swapaxes(0, 1), batch
    )

    def accumulate(grads, micro_batch):
        (_, metrics), more = grad_fn(params, biases, graphdef, micro_batch, config)
        return jax.tree.map(lambda g, m: g + m.astype(g.dtype), grads, more), metrics

    # Gradients start as float32 zeros like the parameters (the distributed optimizer's
    # compute weights may be bfloat16; the sums stay float32): inside a shard_map they
    # then vary over the same mesh axes as the gradients the scan adds to them. Metrics
    # leave the scan stacked (the loss is traced once, with no shapes to know
    # beforehand) and are summed in micro-batch order, as the carry would have summed them.
    zeros = jax.tree.map(lambda p: jnp.zeros_like(p, jnp.float32), params)
    grads, stacked = jax.lax.scan(accumulate, zeros, split)
    peaks = stacked.pop(PEAKS, None)  # the largest over the micro-batches, not the mean
    metrics = jax.tree.map(lambda x: x[0], stacked)
    for m in range(1, micro):
        metrics = jax.tree.map(lambda total, x, m=m: total + x[m], metrics, stacked)
    metrics, grads = jax.tree.map(lambda x: x / micro, (metrics, grads))
    if peaks is not None:
        metrics[PEAKS] = jax.tree.map(lambda p: p.max(0), peaks)
    return _loads_times(metrics, micro), grads


def _loads_times(metrics: dict, micro: int) -> dict:
    """`metrics` with the expert loads (means over `micro` micro-batches) scaled back to
    the whole batch's counts: loads add up."""
    loads = {k: metrics[k] * micro for k in ("load", "mtp_load") if k in metrics}
    return {**metrics, **loads}


# The learning rate's type: what a step compiled from abstract inputs is lowered with.
RATE = jax.ShapeDtypeStruct((), jnp.float32)


def step_shardings(state_sharding, batch_sharding: NamedSharding) -> tuple:
    """`train_step`'s in_shardings: the state's, the batch's, and the learning rate on
    every device (a host value, which a multi-process job may pass only replicated)."""
    return state_sharding, batch_sharding, NamedSharding(batch_sharding.mesh, P())


def train_step(graphdef, config: Config, state: TrainState, batch, lr):
    """Returns the next state and this step's metrics.

    `lr` is this step's learning rate, a float32 scalar computed on the host
    (`moe_jax.optimizer.rates`): the schedule and `train.steps` stay out of the
    program, so runs that differ only in them compile the same one (and share it
    through the persistent compilation cache). A step whose loss, gradient norm or new
    parameters are not finite changes nothing but the step counter and reports
    `skipped=1`.
    """
    metrics, grads = gradients(state, graphdef, batch, config)
    return apply_gradients(config, state, metrics, grads, lr, _layout(graphdef, state))


def apply_gradients(
    config: Config, state: TrainState, metrics: dict, grads, lr, layout: Layout | None = None
):
    """The clipped optimizer and router-bias updates of one step (`make_optimizer`'s, at
    the learning rate `lr`), from its gradients and metrics. Under `layout`'s mesh, Muon's
    Newton-Schulz runs where `moe_jax.parallel.muon_placement` puts each matrix whole.

    Written for XLA to update the donated state in place: the gradients are clipped
    before the update, in their own buffers (optax's clip inside the update would write
    a second copy), and a skipped step is a conditional, not a select between the old
    and the new state (a select reads the old moments after the new ones are written,
    so XLA copies them first)."""
    metrics = dict(metrics)
    cfg = config.train
    peaks = metrics.pop(PEAKS, None)
    if peaks is not None:
        metrics["max_attn_logit"] = qk_clip.peak_of(peaks)
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(grad_norm)
    if cfg.grad_clip > 0:  # optax.clip_by_global_norm's rule
        scale = jnp.minimum(1.0, cfg.grad_clip / grad_norm)
        grads = jax.tree.map(lambda g: g * scale.astype(g.dtype), grads)
    placed = muon_placement.of_state(state, layout, optimizer.muon_dimensions)
    rule = optimizer.update_rule(cfg, lambda count: lr, placed)
    rate = config.moe.bias_update_rate
    clipped = cfg.grad_clip > 0  # chain(clip, rule): the clip's state is empty

    pads = moment_paddings(cfg, state.params, layout)  # ZeRO-1's, where no dimension divides
    padded = zero_padding.pad(grads, pads)

    def stepped(params, opt_state):
        inner = opt_state[1] if clipped else opt_state
        updates, inner = rule.update(padded, inner, zero_padding.pad(params, pads))
        updates = zero_padding.unpad(updates, pads, params)
        return optax.apply_updates(params, updates), (opt_state[0], inner) if clipped else inner

    # The update may overflow where the loss and gradients did not (a huge learning rate
    # or weight decay): the new parameters are checked before the state is touched. Only
    # their finiteness leaves this pass (XLA fuses it into one reduction, the new moments
    # are dropped); the conditional below computes them again in the donated buffers.
    new_params = stepped(state.params, state.opt_state)[0]
    finite = finite & _all_finite(new_params)

    def update(current):
        params, opt_state, biases = current
        params, opt_state = stepped(params, opt_state)
        if peaks is not None and cfg.qk_clip:
            params = qk_clip.clipped(params, peaks, cfg.qk_clip_threshold, config.model)
        if "load" in metrics and rate > 0:
            biases = update_biases(biases, metrics, rate)
        return params, opt_state, biases

    params, opt_state, biases = jax.lax.cond(
        finite, update, lambda current: current, (state.params, state.opt_state, state.biases)
    )
    rng = jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step))
    metrics.update(
        grad_norm=grad_norm,
        lr=jnp.asarray(lr, jnp.float32),
        skipped=1 - finite.astype(jnp.int32),
    )
    return TrainState(state.step + 1, params, biases, opt_state, rng), metrics


def _all_finite(tree) -> jax.Array:
    """Whether every element of every array of `tree` is finite (a scalar bool)."""
    return jnp.all(jnp.stack([jnp.isfinite(x).all() for x in jax.tree.leaves(tree)]))


def eval_step(graphdef, config: Config, state: TrainState, batch) -> jax.Array:
    """Mean next-token cross-entropy (nats per token) on one batch: the main head's
    (multi-token prediction modules are not run)."""
    layout = _layout(graphdef, state)
    if not layout.pipelined:
        _, metrics = loss_fn(state.params, state.biases, graphdef, batch, config, mtp=False)
        return metrics["lm_loss"]
    graphdef = per_device_step.per_device_graph(graphdef, state.params, state.biases)
    loss = lambda params, biases, batch: loss_fn(params, biases, graphdef, batch, config, mtp=False)
    specs = _param_specs(state, layout)
    metrics = per_device_step.step_loss(layout, loss, state.params, state.biases, batch, specs)
    return metrics["lm_loss"]
