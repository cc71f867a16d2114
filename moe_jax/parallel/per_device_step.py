"""The step run per device: the loss and its gradients inside one `shard_map` over the
whole mesh.

Why: two features need what GSPMD hides. The bf16 gradient exchange
(`moe_jax.parallel.grad_exchange`) must see each device's unreduced gradient, and a
pipeline (`moe_jax.parallel.pipeline`) passes micro-batches between stages by
`ppermute`, which only exists per device. Here every parameter enters as its own shard,
made device-varying over the mesh axes it is replicated on, so autodiff leaves each
device its partial gradient, summed over the devices that share the parameter on the
way out.

The model runs with `Layout.per_device` set (`per_device_graph`): its blocks are then
traced as per-device bodies (a block's own shard_map is a plain call of its body,
`Layout.block_map`) and a loss is one device's share, averaged here
(`mean_over_devices`).
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
from flax import nnx
from jax.sharding import PartitionSpec as P

from moe_jax.kernels.varying import varying_axes
from moe_jax.parallel import distributed_optimizer, grad_exchange, peaks, pipeline
from moe_jax.parallel.grad_exchange import is_spec, summed_axes
from moe_jax.parallel.layer_sync import Synced
from moe_jax.parallel.layout import EVERY, Layout


def runs_per_device(layout: Layout) -> bool:
    """Whether a step of this layout runs here: for the bf16 gradient exchange, the
    distributed optimizer and a pipeline."""
    return layout.grad_exchange == "bf16_a2a" or layout.zero == 2 or layout.pipelined


def per_device_graph(graphdef, *states):
    """The model graph of `graphdef` with every module's layout marked `per_device`, for
    `nnx.merge` with the same states inside the step's shard_map."""
    model = nnx.merge(graphdef, *states)
    layout = dataclasses.replace(model.layout, per_device=True)
    for _, node in nnx.iter_graph(model):
        if isinstance(getattr(node, "layout", None), Layout):
            node.layout = layout
    return nnx.graphdef(model)


def _mean_of(x: jax.Array) -> jax.Array:
    """The mean over all devices; over an axis `x` does not vary over it is itself."""
    axes = tuple(a for a in EVERY if a in varying_axes(x))
    return jax.lax.pmean(x, axes) if axes else x


def mean_over_devices(loss_fn):
    """`loss_fn` (-> (loss, metrics) on one device's tokens) as the mean over all devices:
    the whole batch's loss, each device computing its share."""

    def mean_loss(*args):
        loss, metrics = loss_fn(*args)
        metrics = dict(metrics)
        top = {} if peaks.METRIC not in metrics else {peaks.METRIC: metrics.pop(peaks.METRIC)}
        top = peaks.max_over_devices(top)  # a maximum, not a mean
        return _mean_of(loss), {**jax.tree.map(_mean_of, metrics), **top}

    return mean_loss


def _step_batch(layout: Layout, batch):
    """(batch as the step's shard_map takes it, its spec, the per-device reshape)."""
    if layout.pipelined:
        batch, spec = pipeline.microbatch_major(batch, layout)
        return batch, spec, pipeline.local_batch
    return batch, layout.activation_spec(rank=2), lambda b: b


def step_loss(layout: Layout, loss_fn, params, biases, batch, specs):
    """`loss_fn(params, biases, batch) -> (loss, metrics)` on one device's tokens (a model
    of `per_device_graph`), run per device in one shard_map over the mesh; returns the
    mean metrics over all devices. What a pipelined model needs even without gradients."""
    batch, batch_spec, local = _step_batch(layout, batch)

    def body(params, biases, batch):
        return mean_over_devices(loss_fn)(params, biases, local(batch))[1]

    bias_specs = jax.tree.map(lambda _: P(), biases)
    return jax.shard_map(
        body,
        mesh=layout.mesh,
        in_specs=(specs, bias_specs, jax.tree.map(lambda _: batch_spec, batch)),
        out_specs=P(),
    )(params, biases, batch)


def step_gradients(
    layout: Layout,
    gradients,
    params,
    biases,
    batch,
    specs,
    dtype=None,
    starts=None,
    synced=None,
):
    """`gradients(params, biases, batch, loss_of, sync) -> (metrics, grads)` run per
    device in one shard_map over the mesh: `loss_of(loss_fn)` makes the mean over all
    devices of a loss computed on one device's tokens (`mean_over_devices`). Returns the
    metrics and the gradients summed over the devices that share their parameter: by
    `grad_exchange.exchange` under 'bf16_a2a', each placed by its `reduced_spec`; else
    by a float32 all-reduce, each placed as its parameter.

    Under the distributed optimizer (`layout.zero == 2`) `params` are the float32
    masters (`starts`: where each may be cut, `distributed_optimizer.starts`), each
    gathered in `dtype` for the step (`distributed_optimizer.compute_weights`), and every
    gradient leaves as its master's float32 shard.

    `synced` (a tree of bools like `params`, or None) marks the weights whose gradients
    `gradients` sums itself, inside the backward: `sync` is then a `BackwardSync` that
    hands it those weights as `layer_sync.Synced` (the distributed optimizer's stacked
    weights, layer by layer, `distributed_optimizer.syncs_in_backward`; a 1F1B
    pipeline's stack, in its tick loop, `pipeline_1f1b.sums_in_loop`); else None, and
    all are summed after it."""
    sizes = layout.mesh.shape
    shapes = jax.tree.map(lambda p: p.shape, params)
    if starts is None:
        starts = jax.tree.map(lambda _: 0, specs, is_leaf=is_spec)
    batch, batch_spec, local = _step_batch(layout, batch)
    compressed = layout.grad_exchange == "bf16_a2a"
    distributed = layout.zero == 2

    synced = jax.tree.map(lambda _: False, specs, is_leaf=is_spec) if synced is None else synced
    in_backward = any(jax.tree.leaves(synced))

    def reduce(spec, g, shape, start, synced):
        if synced:  # reduced in the backward (`BackwardSync`)
            return g
        if distributed:
            return distributed_optimizer.reduce_gradient(sizes, g, spec, shape, compressed, start)
        if compressed:
            return grad_exchange.exchange(sizes, g, spec, shape)
        return jax.lax.psum(g, summed_axes(spec)) if summed_axes(spec) else g

    def body(params, biases, batch):
        def varying(spec, p, shape, start):
            if distributed:
                p = distributed_optimizer.compute_weights(sizes, p, spec, shape, dtype, start)
            axes = tuple(a for a in summed_axes(spec) if a not in varying_axes(p))
            return jax.lax.pcast(p, axes, to="varying") if axes else p

        masters = params
        params = jax.tree.map(varying, specs, params, shapes, starts, is_leaf=is_spec)
        sync = BackwardSync(sizes, specs, shapes, synced, masters, compressed, distributed)
        sync = sync if in_backward else None
        metrics, grads = gradients(params, biases, local(batch), mean_over_devices, sync)
        trees = specs, grads, shapes, starts, synced
        return metrics, jax.tree.map(reduce, *trees, is_leaf=is_spec)

    bias_specs = jax.tree.map(lambda _: P(), biases)
    reduced = grad_exchange.reduced_specs(sizes, specs, shapes, starts)
    param_specs = reduced if distributed else specs
    grad_specs = reduced if compressed or distributed else specs
    if compressed and not distributed:  # summed whole in the backward: as the parameter
        whole = lambda spec, cut, synced: spec if synced else cut
        grad_specs = jax.tree.map(whole, specs, grad_specs, synced, is_leaf=is_spec)
    return jax.shard_map(
        body,
        mesh=layout.mesh,
        in_specs=(param_specs, bias_specs, jax.tree.map(lambda _: batch_spec, batch)),
        out_specs=(P(), grad_specs),
    )(params, biases, batch)


@dataclasses.dataclass(frozen=True)
class BackwardSync:
    """What the loss differentiates when its backward sums some gradients itself: the
    master of each `synced` weight (the distributed optimizer's float32 shard, whose
    layer's backward reduces its gradient; else the parameter as stored, summed by a
    float32 all-reduce over the devices sharing it) and the compute copy of every other."""

    sizes: dict
    specs: object  # each parameter's spec (as the layout places its compute copy)
    shapes: object  # each parameter's global shape
    synced: object  # True for a weight whose gradient the backward sums
    masters: object  # this device's parameters as stored (float32 master shards)
    compressed: bool  # `grad_exchange='bf16_a2a'`
    distributed: bool  # `parallel.zero=2`

    def variables(self, compute):
        """The tree to differentiate, given the compute copies."""
        pick = lambda spec, synced, master, weight: master if synced else weight
        trees = self.specs, self.synced, self.masters, compute
        return jax.tree.map(pick, *trees, is_leaf=is_spec)

    def params(self, variables, compute):
        """The parameters the loss reads: each synced weight a `Synced` of its master
        (from `variables`) and compute copy."""

        def param(spec, shape, synced, variable, weight):
            if not synced:
                return variable
            if not self.distributed:  # any part of it: the bf16 exchange or an all-reduce
                if self.compressed:
                    return Synced(variable, weight, partial(grad_exchange.summed_whole, spec=spec))
                return Synced(variable, weight, partial(_summed, axes=summed_axes(spec)))
            reduce = partial(  # of one layer's slice
                distributed_optimizer.reduce_gradient,
                self.sizes,
                spec=P(*tuple(spec)[1:]),
                shape=shape[1:],
                compressed=self.compressed,
            )
            return Synced(variable, weight, reduce)

        trees = self.specs, self.shapes, self.synced, variables, compute
        return jax.tree.map(param, *trees, is_leaf=is_spec)


def _summed(g: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """`g` summed over the devices of `axes` (itself where there are none)."""
    return jax.lax.psum(g, axes) if axes else g
