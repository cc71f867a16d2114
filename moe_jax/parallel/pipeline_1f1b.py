"""The 1F1B pipeline schedule, circular repeats included, in one SPMD program.

`jax.grad` of a forward loop reverses the whole loop: every forward tick runs before
any backward tick, so GPipe (`moe_jax.parallel.pipeline`) keeps an input per tick,
M R + S - 1 of them, until the backward starts. 1F1B runs a micro-batch's backward as
soon as its loss is known, so a stage holds only the items between their forward and
their backward. Here the backward is therefore written out in the one tick loop: each
tick a stage runs its forward item (`run_group` on the kept input), on the last virtual
stage the head and loss of the micro-batch and their gradient, and its backward item
(`jax.vjp` of `run_group` on the kept input: the forward recomputed, as GPipe's
backward recomputes each tick, then its gradient), as `moe_jax.parallel.
pipeline_schedule` tabulates; activations go to stage s + 1 and input gradients to
stage s - 1 by one `ppermute` each per tick, outside any branch. A part of the tick no
stage needs (the tables are static, so every device agrees) is skipped by `lax.cond`,
so forward work costs M R + S - 1 ticks and backward work as many, as GPipe's.

So the loop computes the gradients during the forward pass of the step. It is wrapped
as a `jax.custom_vjp` whose forward is the loop and whose backward scales the gradients
it kept by the loss's cotangent: the rest of the model (embedding, dense prefix) and
the step's gradient exchange see an ordinary differentiable function. Without a
gradient (evaluation) the same objective comes from GPipe's forward, which has no
backward to interleave.

The tail (final norm, head and loss; with multi-token prediction the MTP modules, which
embed the tokens ahead and read the shared head) runs on the last stage for every
micro-batch (the micro-batches' targets and MTP inputs are gathered there: token ids
and loss weights only), as Megatron's last stage runs them. The objective each device
returns is S / M times its share (the last stage's loss sums, each stage's MoE terms
over its layers), so that the mean over all devices is the mean loss over the
micro-batches, as GPipe's.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from moe_jax.kernels.varying import varying_axes, varying_like, varying_zeros
from moe_jax.parallel import pipeline
from moe_jax.parallel.layout import STAGE, Layout, Parts
from moe_jax.parallel.pipeline_schedule import NONE, ROWS, Table, one_f_one_b
from moe_jax.parallel.scopes import DOCUMENT_POSITIONS, PIPELINE, STAGE_SEND


def table(layout: Layout) -> Table:
    return one_f_one_b(layout.stages, layout.microbatches, layout.repeats)


def run_loss(
    layout: Layout,
    parts: Parts,
    params,
    rest,
    x: jax.Array,
    positions: jax.Array,
    tail_params,
    data,
    bubble: float = 0.0,
):
    """(objective, metrics, stats) of the pipelined stack followed by the tail, on one
    device: `params`, `rest`, `x`, `positions` as `pipeline.run` takes them; `data` a
    tree of what the tail reads ([K mb, ...] leaves, this stage's micro-batches' as
    `x`). `metrics` (the tail's, their mean over the micro-batches) and `stats` are the
    same on every stage and carry no gradient; `objective` is S / M times this device's
    share of the loss (see the module docstring). `bubble` fills the buffers before
    anything is written into them (tests poison them with NaN)."""
    with jax.named_scope(PIPELINE):
        return _objective(layout, parts, bubble)(params, tail_params, x, rest, positions, data)


def _objective(layout: Layout, parts: Parts, bubble: float):
    @jax.custom_vjp
    def objective(*args):
        return _forward_only(layout, parts, *args)

    def fwd(*args):
        out, grads = _one_f_one_b(layout, parts, bubble, *args)
        return out, (grads, args[:3])  # the primals for their types only

    def bwd(kept, cotangents):
        (grads, primals), ct = kept, cotangents[0]
        scale = lambda g, p: _typed_like((g * ct.astype(g.dtype)).astype(g.dtype), p)
        return (*jax.tree.map(scale, grads, primals), None, None, None)

    objective.defvjp(fwd, bwd)
    return objective


def _forward_only(layout, parts, params, tail_params, x, rest, positions, data):
    """The same objective by GPipe's forward and the tail on each stage's own
    micro-batches, one at a time (its mean over all devices equals the loop's)."""
    y, stats = pipeline.run(layout, parts.run_group, params, rest, x, positions)
    k = layout.microbatches // layout.stages
    per_micro = lambda a: a.reshape(k, a.shape[0] // k, *a.shape[1:])
    items = (per_micro(y), jax.tree.map(per_micro, data))
    loss, metrics = jax.lax.map(lambda a: parts.tail(tail_params, *a), items)
    metrics = jax.tree.map(lambda m: jax.lax.pmean(m.mean(0), STAGE), metrics)
    return loss.mean() + parts.stats_loss(stats), metrics, stats


def _one_f_one_b(layout, parts, bubble, params, tail_params, x, rest, positions, data):
    """((objective, metrics, stats), gradients of the objective for (params,
    tail_params, x)) by the 1F1B tick loop."""
    run_group, tail, stats_loss = parts
    stages, m, repeats = layout.stages, layout.microbatches, layout.repeats
    sched = table(layout)
    k = m // stages
    me = jax.lax.axis_index(STAGE)
    xs = x.reshape(k, x.shape[0] // k, *x.shape[1:])
    per_micro = lambda a: a.reshape(k, a.shape[0] // k, *a.shape[1:])
    gather = lambda a: jax.lax.all_gather(per_micro(a), STAGE, tiled=True)  # [M, mb, ...]
    data = jax.tree.map(gather, data)
    if layout.documents:
        with jax.named_scope(DOCUMENT_POSITIONS):
            every = gather(positions)
    else:
        every = None
        positions = positions[: xs.shape[1]]
    held = params if repeats > 1 else jax.tree.map(lambda p: p[None], params)
    scale = stages / m

    def stage_fn(local, x, i, r):
        here = jax.tree.map(lambda b: pipeline.stage_rows(b, repeats, stages)[r, me], rest)
        mine = positions if every is None else jax.lax.dynamic_index_in_dim(every, i, 0, False)
        return run_group(local, here, x, mine)

    def repeat_of(r):
        return jax.tree.map(lambda p: jax.lax.dynamic_index_in_dim(p, r, 0, False), held)

    stats_shape = jax.eval_shape(lambda p, x: stage_fn(p, x, 0, 0)[1], repeat_of(0), xs[0])
    per_stage = jax.tree.leaves(held)[0].shape[1]
    like = (xs, jnp.asarray(me), *jax.tree.leaves(held))
    zeros = jax.tree.map(
        lambda s: jnp.zeros((repeats * stages * per_stage, *s.shape[1:]), s.dtype), stats_shape
    )
    total = varying_like(zeros, *like)

    def stats_seed(stats):
        """The objective's gradient for one item's statistics, as autodiff of their
        sum into `total` gives it (summed over the devices they are shared by)."""
        out, pull = jax.vjp(lambda s: scale * stats_loss(varying_like(s, *like)), stats)
        return pull(varying_like(jnp.ones((), out.dtype), out))[0]

    buffer = pipeline.gather_to_first(xs, stages, bubble)
    inbox = jnp.full((sched.slots, *xs.shape[1:]), bubble, xs.dtype)
    gbox = jnp.full((sched.gradient_slots, *xs.shape[1:]), bubble, xs.dtype)
    zeros_x = varying_zeros(xs.shape[1:], xs.dtype, *like)
    inbox, gbox = varying_like(inbox, *like), varying_like(gbox, *like)
    g_params = varying_like(jax.tree.map(jnp.zeros_like, held), *like)
    g_tail = varying_like(jax.tree.map(jnp.zeros_like, tail_params), *like)
    item = lambda a, i: jax.lax.dynamic_index_in_dim(a, i, 0, False)
    y_shape = jax.eval_shape(lambda p, x: stage_fn(p, x, 0, 0)[0], repeat_of(0), xs[0])
    _, metrics_shape = jax.eval_shape(
        lambda y, d: tail(tail_params, y, jax.tree.map(lambda a: item(a, 0), d)), y_shape, data
    )
    sums = varying_like(jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), metrics_shape), *like)
    loss_sum = varying_zeros((), jnp.float32, *like)
    ring = [(j, (j + 1) % stages) for j in range(stages)]
    back = [(j, (j - 1) % stages) for j in range(stages)]
    rows = {name: jnp.asarray(getattr(sched, name)) for name in ROWS}

    def tick(carry, row):
        inbox, gbox, buffer, received, returned, g_params, g_tail, total, sums, loss_sum = carry
        at = {name: row[name][me] for name in ROWS}
        inbox = _put(inbox, at["arrive_slot"], received)
        gbox = _put(gbox, at["gradient_arrive_slot"], returned)

        # forward item (and, on the last virtual stage, the loss and its gradient)
        f_on, i, r = at["forward"] != NONE, jnp.maximum(at["forward"], 0), at["forward_repeat"]
        r = jnp.maximum(r, 0)

        def forward(total):
            x_in = _take(inbox, buffer, at["forward_slot"], i)
            x_in = jnp.where(f_on, x_in, zeros_x)
            y, stats = stage_fn(repeat_of(r), x_in, i, r)
            return pipeline.add_stats(total, stats, (r * stages + me) * per_stage, f_on), y

        total, y = jax.lax.cond(
            (row["forward"] != NONE).any(), forward, lambda t: (t, zeros_x), total
        )
        on_loss = at["loss"] > 0

        def loss(args):
            gbox, g_tail, sums, loss_sum = args
            mine = jax.tree.map(lambda a: item(a, i), data)
            run = lambda tp, y: tail(tp, y, mine)
            lm, pull, metrics = jax.vjp(run, tail_params, y, has_aux=True)
            d_tail, dy = pull(varying_like(jnp.where(on_loss, scale, 0.0).astype(lm.dtype), lm))
            gbox = _put(gbox, jnp.where(on_loss, at["loss_slot"], NONE), dy.astype(xs.dtype))
            g_tail = jax.tree.map(jnp.add, g_tail, d_tail)
            add = lambda acc, v: acc + jnp.where(on_loss, v, jnp.zeros_like(v)).astype(acc.dtype)
            sums = jax.tree.map(add, sums, varying_like(metrics, *like))
            return gbox, g_tail, sums, loss_sum + jnp.where(on_loss, lm, 0.0)

        gbox, g_tail, sums, loss_sum = jax.lax.cond(
            (row["loss"] > 0).any(), loss, lambda a: a, (gbox, g_tail, sums, loss_sum)
        )

        # backward item
        b_on, j = at["backward"] != NONE, jnp.maximum(at["backward"], 0)
        rb = jnp.maximum(at["backward_repeat"], 0)

        def backward(args):
            buffer, g_params = args
            x_in = jnp.where(b_on, _take(inbox, buffer, at["backward_slot"], j), zeros_x)
            dy = jax.lax.dynamic_index_in_dim(gbox, at["gradient_slot"], 0, False)
            dy = jnp.where(b_on, dy, zeros_x)
            (y, stats), pull = jax.vjp(lambda p, x: stage_fn(p, x, j, rb), repeat_of(rb), x_in)
            seed = jax.tree.map(partial(_masked, b_on), stats_seed(stats))
            d_local, dx = pull((varying_like(dy, y), seed))
            # a scatter-add, in place (a read-modify-write of the slice copied a repeat)
            g_params = jax.tree.map(lambda acc, d: acc.at[rb].add(d), g_params, d_local)
            into = jnp.where(b_on & (at["backward_slot"] == NONE), j, NONE)
            return _put(buffer, into, dx), g_params, dx

        buffer, g_params, dx = jax.lax.cond(
            (row["backward"] != NONE).any(),
            backward,
            lambda a: (*a, zeros_x),
            (buffer, g_params),
        )
        with jax.named_scope(STAGE_SEND):
            sent = jax.lax.ppermute(y, STAGE, ring)
            sent_back = jax.lax.ppermute(dx, STAGE, back)
        carry = (inbox, gbox, buffer, sent, sent_back, g_params, g_tail, total, sums, loss_sum)
        return carry, None

    carry = (inbox, gbox, buffer, zeros_x, zeros_x, g_params, g_tail, total, sums, loss_sum)
    carry, _ = jax.lax.scan(tick, carry, rows)
    _, _, buffer, _, _, g_params, g_tail, total, sums, loss_sum = carry
    g_x = pipeline.scatter_from_first(buffer, stages, k, me).reshape(x.shape)
    if repeats == 1:
        g_params = jax.tree.map(lambda g: g[0], g_params)
    stats, metrics = (jax.tree.map(lambda s: jax.lax.psum(s, STAGE) / m, t) for t in (total, sums))
    objective = scale * (loss_sum + stats_loss(total))
    return (objective, metrics, stats), (g_params, g_tail, g_x)


def _typed_like(g, primal):
    """`g`, the gradient of `primal`, summed over the mesh axes it varies over and
    `primal` does not (a state the tail reads the same on every device, as the MTP
    modules' router biases: their gradient is dropped, its type must still match)."""
    extra = tuple(sorted(varying_axes(g) - varying_axes(primal)))
    return jax.lax.psum(g, extra) if extra else g


def _masked(on, g):
    """`g` where `on`, else zeros; a statistic the same on every stage (a constant, of
    zero gradient) keeps its seed, as its cotangent cannot vary over stages."""
    if STAGE not in varying_axes(g):
        return g
    return jnp.where(on, g, jnp.zeros_like(g))


def _take(inbox, buffer, slot, i):
    """A kept input: from the inbox's `slot`, or (NONE: v = 0) micro-batch i's embedded."""
    kept = jax.lax.dynamic_index_in_dim(inbox, jnp.maximum(slot, 0), 0, False)
    first = jax.lax.dynamic_index_in_dim(buffer, i, 0, False)
    return jnp.where(slot == NONE, first, kept)


def _put(box, slot, value):
    """`box` with `value` in `slot`; unchanged where `slot` is NONE."""
    at = jnp.maximum(slot, 0)
    old = jax.lax.dynamic_index_in_dim(box, at, 0, False)
    new = jnp.where(slot == NONE, old, value.astype(box.dtype))
    return jax.lax.dynamic_update_index_in_dim(box, new, at, 0)
