"""The 1F1B pipeline schedule, circular repeats included, in one SPMD program.

`jax.grad` of a forward loop reverses the whole loop: every forward tick runs before
any backward tick, so GPipe (`moe_jax.parallel.pipeline`) keeps an input per tick,
M R + S - 1 of them, until the backward starts. 1F1B runs a micro-batch's backward as
soon as its loss is known, so a stage holds only the items between their forward and
their backward. Here the backward is therefore written out in the one tick loop: each
tick a stage runs its forward item (`run_group` on the kept input; on virtual stage 0
on the micro-batch's prefix, its embedding and dense layers), on the last virtual
stage the head and loss of the micro-batch and their gradient, and its backward item
(`jax.vjp` of `run_group` on the kept input: the forward recomputed, as GPipe's
backward recomputes each tick, then its gradient), as `moe_jax.parallel.
pipeline_schedule` tabulates; activations go to stage s + 1 and input gradients to
stage s - 1 by one `ppermute` each per tick, outside any branch. A part of the tick no
stage needs (the tables are static, so every device agrees) is skipped by `lax.cond`,
so forward work costs M R + S - 1 ticks and backward work as many, as GPipe's.

Zero-bubble (`parallel.schedule=zero_bubble`, `pipeline_schedule.zero_bubble`) runs the
same items with each backward cut in two (`backward_halves.split`): the tick's B item
computes the input gradient and keeps what the weights' gradients need in a stash slot;
its W item, at the tick the table gives every stage's k-th W, computes and adds them.

So the loop computes the gradients during the forward pass of the step. It is wrapped
as a `jax.custom_vjp` whose forward is the loop and whose backward scales the gradients
it kept by the loss's cotangent: the step's gradient exchange sees an ordinary
differentiable function of every weight. Without a
gradient (evaluation) the same objective comes from GPipe's forward, which has no
backward to interleave.

The tail (final norm, head and loss; with multi-token prediction the MTP modules, which
embed the tokens ahead and read the shared head) runs on the last stage for every
micro-batch (the micro-batches' targets and MTP inputs are gathered there: token ids
and loss weights only), as Megatron's last stage runs them. The objective each device
returns is S / M times its share (the last stage's loss sums, each stage's MoE terms
over its layers), so that the mean over all devices is the mean loss over the
micro-batches, as GPipe's.

Where the step marks the stack's weights `layer_sync.Synced` (ZeRO 0 and 1, float32 sums
or the bf16 exchange's: `sums_in_loop`), the loop also sums their gradients over the
devices that share them: a repeat's as soon as every stage has run its last backward of
it, a part per tick through the drain (`pipeline_schedule.loop_sums`), so the sums cross
the network while the drain's backward computes; only the first repeats' (repeat 0's at
least) wait until after the loop. The gradients leave already summed, as the masters'
cotangents.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from moe_jax.kernels.varying import typed_as_summed, varying_axes, varying_like, varying_zeros
from moe_jax.parallel import backward_halves, pipeline
from moe_jax.parallel.layer_sync import Synced, is_synced
from moe_jax.parallel.layout import STAGE, Layout, Parts
from moe_jax.parallel.peaks import WithPeaks, map_stats, maximum, split_peaks
from moe_jax.parallel.pipeline_schedule import (
    NONE,
    ROWS,
    ZERO_BUBBLE_ROWS,
    Table,
    loop_sums,
    tick_table,
)
from moe_jax.parallel.scopes import DOCUMENT_POSITIONS, GRAD_EXCHANGE, PIPELINE, STAGE_SEND


def table(layout: Layout) -> Table:
    return tick_table(
        layout.schedule, layout.stages, layout.microbatches, layout.repeats, layout.stash_depth
    )


def sums_in_loop(schedule: str, zero: int) -> bool:
    """Whether the step has the 1F1B (or zero-bubble) loop sum the stack's gradients
    (ZeRO 0 and 1, in float32 or by the bf16 exchange, either of which sums a part as
    well as the whole; the distributed optimizer sums after the loop). The trainer and
    the planner both ask here."""
    return schedule != "gpipe" and zero < 2


def run_loss(
    layout: Layout,
    parts: Parts,
    params,
    rest,
    tokens: jax.Array,
    positions: jax.Array,
    prefix_params,
    tail_params,
    data,
    bubble: float = 0.0,
):
    """(objective, metrics, stats) of the prefix (embedding and dense layers), the
    pipelined stack and the tail, on one device: `params`, `rest`, `positions` as
    `pipeline.run` takes them, `tokens` [K mb, seq] this stage's micro-batches; `data` a
    tree of what the tail reads ([K mb, ...] leaves, as `tokens`). `metrics` (the
    tail's, their mean over the micro-batches) and `stats` are the same on every stage
    and carry no gradient; `objective` is S / M times this device's share of the loss
    (see the module docstring). `bubble` fills the buffers before anything is written
    into them (tests poison them with NaN)."""
    args = (params, tail_params, prefix_params, rest, tokens, positions, data)
    with jax.named_scope(PIPELINE):
        return _objective(layout, parts, bubble)(*args)


def _objective(layout: Layout, parts: Parts, bubble: float):
    @jax.custom_vjp
    def objective(*args):
        return _forward_only(layout, parts, *args)

    def fwd(*args):
        out, grads = _one_f_one_b(layout, parts, bubble, *args)
        return out, (grads, args[:3])  # the primals for their types only

    def bwd(kept, cotangents):
        (grads, primals), ct = kept, cotangents[0]

        def scale(g, p):
            if not is_synced(p):
                return _typed_like((g * ct.astype(g.dtype)).astype(g.dtype), p)
            # summed in the loop, so the same on the devices that share the weight; the
            # objective's cotangent is too (the loss is their mean)
            master = typed_as_summed((g * ct.astype(g.dtype)).astype(p.master.dtype), p.master)
            return Synced(master, varying_like(jnp.zeros_like(p.compute), p.compute), p.reduce)

        return (*jax.tree.map(scale, grads, primals), None, None, None, None)

    objective.defvjp(fwd, bwd)
    return objective


def _forward_only(layout, parts, params, tail_params, prefix_params, rest, tokens, positions, data):
    """The same objective by the prefix on the stage's own micro-batches, GPipe's forward
    and the tail on each of them, one at a time (its mean over all devices equals the
    loop's)."""
    params = _compute(params)
    x, prefix_peaks = parts.prefix(prefix_params, tokens, positions)
    y, stats = pipeline.run(layout, parts.run_group, params, rest, x, positions)
    stats = _with_prefix(stats, prefix_peaks)
    k = layout.microbatches // layout.stages
    per_micro = lambda a: a.reshape(k, a.shape[0] // k, *a.shape[1:])
    items = (per_micro(y), jax.tree.map(per_micro, data))
    loss, metrics = jax.lax.map(lambda a: parts.tail(tail_params, *a), items)
    top = lambda m: maximum(m.max(0), {STAGE})
    metrics = map_stats(lambda m: jax.lax.pmean(m.mean(0), STAGE), top, metrics)
    return loss.mean() + parts.stats_loss(stats), metrics, stats


def _one_f_one_b(
    layout, parts, bubble, params, tail_params, prefix_params, rest, tokens, positions, data
):
    """((objective, metrics, stats), gradients of the objective for (params,
    tail_params, prefix_params)) by the 1F1B tick loop."""
    run_group, tail, stats_loss, prefix = parts
    stages, m, repeats = layout.stages, layout.microbatches, layout.repeats
    sched = table(layout)
    leaves = jax.tree.leaves(params, is_leaf=is_synced)
    reduces = [x.reduce for x in leaves if is_synced(x)]
    assert len(reduces) in (0, len(leaves)), "the step syncs all of the stack or none"
    in_loop = loop_sums(sched) if reduces else None
    params = _compute(params)
    k = m // stages
    me = jax.lax.axis_index(STAGE)
    per_micro = lambda a: a.reshape(k, a.shape[0] // k, *a.shape[1:])
    gather = lambda a: jax.lax.all_gather(per_micro(a), STAGE, tiled=True)  # [M, mb, ...]
    item = lambda a, i: jax.lax.dynamic_index_in_dim(a, i, 0, False)
    every_token, data = gather(tokens), jax.tree.map(gather, data)
    if layout.documents:
        with jax.named_scope(DOCUMENT_POSITIONS):
            every = gather(positions)
    else:
        every = None
        positions = positions[: tokens.shape[0] // k]
    held = params if repeats > 1 else jax.tree.map(lambda p: p[None], params)
    scale = stages / m

    def positions_of(i):
        return positions if every is None else item(every, i)

    def first(hp, i):
        """Micro-batch i's input to virtual stage 0, its embedding and dense prefix, and
        the prefix's attention peaks (None where they are not tracked)."""
        return prefix(hp, item(every_token, i), positions_of(i))

    def stage_fn(local, x, i, r):
        here = jax.tree.map(lambda b: pipeline.stage_rows(b, repeats, stages)[r, me], rest)
        return run_group(local, here, x, positions_of(i))

    def repeat_of(r):
        return jax.tree.map(lambda p: jax.lax.dynamic_index_in_dim(p, r, 0, False), held)

    x_shape, peaks_shape = jax.eval_shape(first, prefix_params, 0)
    stats_shape = jax.eval_shape(lambda p, x: stage_fn(p, x, 0, 0)[1], repeat_of(0), x_shape)
    per_stage = jax.tree.leaves(held)[0].shape[1]
    like = (tokens, jnp.asarray(me), *jax.tree.leaves(held))
    no_peaks = jax.tree.map(lambda s: jnp.full(s.shape, -jnp.inf, s.dtype), peaks_shape)
    prefix_peaks = no_peaks = varying_like(no_peaks, *like)
    total = pipeline.empty_stats(stats_shape, repeats * stages * per_stage, like)

    def stats_seed(stats):
        """The objective's gradient for one item's statistics, as autodiff of their
        sum into `total` gives it (summed over the devices they are shared by)."""
        out, pull = jax.vjp(lambda s: scale * stats_loss(varying_like(s, *like)), stats)
        return pull(varying_like(jnp.ones((), out.dtype), out))[0]

    inbox = jnp.full((sched.slots, *x_shape.shape), bubble, x_shape.dtype)
    gbox = jnp.full((sched.gradient_slots, *x_shape.shape), bubble, x_shape.dtype)
    zeros_x = varying_zeros(x_shape.shape, x_shape.dtype, *like)
    inbox, gbox = varying_like(inbox, *like), varying_like(gbox, *like)
    g_params = varying_like(jax.tree.map(jnp.zeros_like, held), *like)
    g_tail = varying_like(jax.tree.map(jnp.zeros_like, tail_params), *like)
    g_prefix = varying_like(jax.tree.map(jnp.zeros_like, prefix_params), *like)
    y_shape = jax.eval_shape(lambda p, x: stage_fn(p, x, 0, 0)[0], repeat_of(0), x_shape)
    _, metrics_shape = jax.eval_shape(
        lambda y, d: tail(tail_params, y, jax.tree.map(lambda a: item(a, 0), d)), y_shape, data
    )
    sums = pipeline.empty_stats(metrics_shape, None, like)
    loss_sum = varying_zeros((), jnp.float32, *like)
    ring = [(j, (j + 1) % stages) for j in range(stages)]
    back = [(j, (j - 1) % stages) for j in range(stages)]
    names = ROWS + (ZERO_BUBBLE_ROWS if sched.weight is not None else ())
    rows = {name: jnp.asarray(getattr(sched, name)) for name in names}

    def stage_grads(p, x, dy, j, rb, b_on):
        """(the stage's weight gradients, its input gradient) for output gradient `dy`."""
        (y, stats), pull = jax.vjp(lambda p, x: stage_fn(p, x, j, rb), p, x)
        seed = jax.tree.map(partial(_masked, b_on), stats_seed(stats))
        return pull((varying_like(dy, y), seed))

    split = sched.weight is not None  # zero-bubble: B and W run as separate items
    if split:  # W's stash: a buffer of what B keeps, typed as B makes it
        b_half, _ = backward_halves.split(
            lambda p, x, dy: stage_grads(p, x, dy, 0, 0, True), repeat_of(0), zeros_x, zeros_x
        )
        _, kept = b_half(repeat_of(0), zeros_x, zeros_x)  # for its types only (dead code)
        fill = lambda a: varying_like(jnp.full((sched.stash_slots, *a.shape), bubble, a.dtype), a)
        sbox = jax.tree.map(fill, kept)

    def tick(carry, row, forwards: bool = True):
        """One tick; without `forwards` (the drain, `_ticks_then_drain`) its backward only."""
        fields, sbox = carry[:10], (carry[10] if split else None)  # zero-bubble: the stash
        inbox, gbox, received, returned, g_params, g_tail, g_prefix, totals, sums, loss_sum = fields
        at = {name: row[name][me] for name in names}
        inbox = _put(inbox, at["arrive_slot"], received)
        gbox = _put(gbox, at["gradient_arrive_slot"], returned)
        # whether stage 0 runs virtual stage 0 this tick (the same on every device)
        starts = lambda way: ((row[way] != NONE) & (row[f"{way}_slot"] == NONE)).any()

        # forward item (and, on the last virtual stage, the loss and its gradient)
        f_on, i, r = at["forward"] != NONE, jnp.maximum(at["forward"], 0), at["forward_repeat"]
        r = jnp.maximum(r, 0)

        def forward(totals):
            total, prefix_peaks = totals
            x_in = _kept(inbox, at["forward_slot"])
            embedded, peaks = jax.lax.cond(
                starts("forward"),
                lambda: varying_like(first(prefix_params, i), *like),
                lambda: (zeros_x, no_peaks),
            )
            opens = f_on & (at["forward_slot"] == NONE)  # this device ran the prefix
            keep = lambda acc, p: jnp.maximum(acc, jnp.where(opens, p, -jnp.inf))
            prefix_peaks = jax.tree.map(keep, prefix_peaks, peaks)
            x_in = jnp.where(f_on, jnp.where(at["forward_slot"] == NONE, embedded, x_in), zeros_x)
            y, stats = stage_fn(repeat_of(r), x_in, i, r)
            total = pipeline.add_stats(total, stats, (r * stages + me) * per_stage, f_on)
            return (total, prefix_peaks), y

        if forwards:
            totals, y = jax.lax.cond(
                (row["forward"] != NONE).any(), forward, lambda t: (t, zeros_x), totals
            )
        on_loss = at["loss"] > 0

        def loss(args):
            gbox, g_tail, sums, loss_sum = args
            mine = jax.tree.map(lambda a: item(a, i), data)
            run = lambda tp, y: tail(tp, y, mine)
            lm, pull, metrics = jax.vjp(run, tail_params, y, has_aux=True)
            d_tail, dy = pull(varying_like(jnp.where(on_loss, scale, 0.0).astype(lm.dtype), lm))
            gbox = _put(gbox, jnp.where(on_loss, at["loss_slot"], NONE), dy)
            g_tail = jax.tree.map(jnp.add, g_tail, d_tail)
            add = lambda acc, v: acc + jnp.where(on_loss, v, jnp.zeros_like(v)).astype(acc.dtype)
            top = lambda acc, v: jnp.maximum(acc, jnp.where(on_loss, v, -jnp.inf))
            sums = map_stats(add, top, sums, varying_like(metrics, *like))
            return gbox, g_tail, sums, loss_sum + jnp.where(on_loss, lm, 0.0)

        if forwards:
            gbox, g_tail, sums, loss_sum = jax.lax.cond(
                (row["loss"] > 0).any(), loss, lambda a: a, (gbox, g_tail, sums, loss_sum)
            )

        # backward item (on virtual stage 0 through the prefix too)
        b_on, j = at["backward"] != NONE, jnp.maximum(at["backward"], 0)
        rb = jnp.maximum(at["backward_repeat"], 0)
        is_first = b_on & (at["backward_slot"] == NONE)

        if split:  # the backward cut for this tick's item: B here, W when the table says
            b_half, w_half = backward_halves.split(
                partial(stage_grads, j=j, rb=rb, b_on=b_on), repeat_of(rb), zeros_x, zeros_x
            )

        def backward(args):
            g_params, g_prefix, sbox = args
            x_in = _kept(inbox, at["backward_slot"])
            dy = jnp.where(b_on, item(gbox, at["gradient_slot"]), zeros_x)

            def pulled(p, x):
                if not split:
                    return stage_grads(p, x, dy, j, rb, b_on)
                dx, kept = b_half(p, x, dy)
                return kept, dx

            def through_prefix(g_prefix):
                x, pull_prefix = jax.vjp(lambda hp: first(hp, j)[0], prefix_params)
                x = jnp.where(is_first, x, x_in)
                d_local, dx = pulled(repeat_of(rb), jnp.where(b_on, x, zeros_x))
                mask = lambda d: jnp.where(is_first, d, jnp.zeros_like(d))
                (d_prefix,) = pull_prefix(mask(dx).astype(x.dtype))
                return d_local, dx, jax.tree.map(jnp.add, g_prefix, d_prefix)

            def stack_only(g_prefix):
                return (*pulled(repeat_of(rb), jnp.where(b_on, x_in, zeros_x)), g_prefix)

            d_local, dx, g_prefix = jax.lax.cond(
                starts("backward"), through_prefix, stack_only, g_prefix
            )
            if split:  # d_local is what W will read
                put = lambda box, v: _put(box, jnp.where(b_on, at["stash_slot"], NONE), v)
                return g_params, g_prefix, jax.tree.map(put, sbox, d_local), dx
            return _added(g_params, d_local, rb), g_prefix, sbox, dx

        g_params, g_prefix, sbox, dx = jax.lax.cond(
            (row["backward"] != NONE).any(),
            backward,
            lambda a: (*a, zeros_x),
            (g_params, g_prefix, sbox),
        )
        if split:
            w_on, rw = at["weight"] != NONE, jnp.maximum(at["weight_repeat"], 0)

            def weight(g_params):
                kept = jax.tree.map(lambda box: _kept(box, at["weight_slot"]), sbox)
                d_local = w_half(repeat_of(rw), kept)
                d_local = jax.tree.map(lambda d: jnp.where(w_on, d, jnp.zeros_like(d)), d_local)
                return _added(g_params, d_local, rw)

            g_params = jax.lax.cond((row["weight"] != NONE).any(), weight, lambda g: g, g_params)
        with jax.named_scope(STAGE_SEND):
            sent = jax.lax.ppermute(y, STAGE, ring) if forwards else zeros_x
            sent_back = jax.lax.ppermute(dx, STAGE, back)
        carry = (inbox, gbox, sent, sent_back, g_params, g_tail, g_prefix, totals, sums, loss_sum)
        return (*carry, sbox) if split else carry, None

    totals = (total, prefix_peaks)
    if reduces:  # each repeat's gradients one row, summed a part at a time
        g_params = jax.tree.map(lambda g: g.reshape(g.shape[0], -1), g_params)
    carry = (inbox, gbox, zeros_x, zeros_x, g_params, g_tail, g_prefix, totals, sums, loss_sum)
    carry = (*carry, sbox) if split else carry
    if in_loop is None:
        carry, _ = jax.lax.scan(tick, carry, rows)
    else:
        carry = _ticks_then_drain(tick, carry, rows, in_loop, reduces, sched.ticks)
    _, _, _, _, g_params, g_tail, g_prefix, (total, prefix_peaks), sums, loss_sum = carry[:10]
    if reduces:  # the repeats not summed in the loop, then each gradient in its shape
        first = repeats if in_loop is None else in_loop.after
        accs, tree = jax.tree.flatten(g_params)
        with jax.named_scope(GRAD_EXCHANGE):
            accs = [a.at[:first].set(f(a[:first])) for a, f in zip(accs, reduces, strict=True)]
        shape = lambda acc, p: acc.reshape(p.shape)
        g_params = jax.tree.map(shape, jax.tree.unflatten(tree, accs), held)
    if repeats == 1:
        g_params = jax.tree.map(lambda g: g[0], g_params)
    stats = _with_prefix(pipeline.mean_stats(total, m), prefix_peaks)
    metrics = pipeline.mean_stats(sums, m)  # the tail's MTP peaks by their maximum
    objective = scale * (loss_sum + stats_loss(total))
    return (objective, metrics, stats), (g_params, g_tail, g_prefix)


def _with_prefix(stats, prefix_peaks):
    """The stack's statistics with attention's peaks (`moe_jax.parallel.peaks`) as the
    pair (the stack's, the prefix's over every stage); without peaks `stats`."""
    moe, peak = split_peaks(stats)
    if peak is None:
        return stats
    top = lambda p: maximum(p, {STAGE})
    return WithPeaks(moe, (peak, jax.tree.map(top, prefix_peaks)))


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


GRADS = 4  # the tick loop's carry: where the stack's gradient accumulators are


def _ticks_then_drain(tick, carry, rows, in_loop, reduces, ticks: int):
    """The tick loop as two scans: the ticks before the drain, then the drain's (no
    forward work is left there: `pipeline_schedule.loop_sums`), each its backward and
    the sum of its part of a final repeat's gradients (`pipeline_schedule.LoopSums`) by
    `reduces`, one per accumulator of `carry[GRADS]`."""
    head = jax.tree.map(lambda a: a[: in_loop.start], rows)
    drain = jax.tree.map(lambda a: a[in_loop.start :], rows)
    carry, _ = jax.lax.scan(tick, carry, head)
    with_grads = lambda carry, g: (*carry[:GRADS], g, *carry[GRADS + 1 :])

    def tick_and_sum(carry, xs):
        row, r, c = xs
        parts = [_part(acc, r, c, in_loop.chunks) for acc in jax.tree.leaves(carry[GRADS])]
        # the parts read before the tick adds into the accumulators in place (else XLA
        # keeps a copy of them all for the reads)
        grads, parts = jax.lax.optimization_barrier((carry[GRADS], parts))
        with jax.named_scope(GRAD_EXCHANGE):  # needs nothing of this tick's backward
            summed = [f(part) for f, (part, _, _) in zip(reduces, parts, strict=True)]
        carry, _ = tick(with_grads(carry, grads), row, forwards=False)  # other repeats' rows
        accs, tree = jax.tree.flatten(carry[GRADS])
        new = [_put_part(a, r, s, *p) for a, s, p in zip(accs, summed, parts, strict=True)]
        return with_grads(carry, jax.tree.unflatten(tree, new)), None

    r, c = (jnp.asarray(a) for a in in_loop.rows(ticks))
    carry, _ = jax.lax.scan(tick_and_sum, carry, (drain, r, c))
    return carry


def _compute(params):
    """The stack's weights as the layers read them: each `Synced` its compute copy."""
    return jax.tree.map(lambda x: x.compute if is_synced(x) else x, params, is_leaf=is_synced)


def _part(acc: jax.Array, r, c, chunks: int):
    """(part c of `chunks` of row r of a flat [R, n] accumulator, where it begins, which
    of its elements are part c's): parts of ceil(n / chunks) elements, the last moved
    back to end at n (its elements the part before summed already are not its own)."""
    n = acc.shape[1]
    size = -(-n // chunks)
    begin = jnp.minimum(c * size, n - size)
    fresh = begin + jnp.arange(size) >= c * size
    return jax.lax.dynamic_slice(acc, (r, begin), (1, size)), begin, fresh


def _put_part(acc: jax.Array, r, summed, part, begin, fresh) -> jax.Array:
    """`acc` with its `part` (`_part`) in row r replaced by the part's sum `summed`."""
    new = jnp.where(fresh, summed.astype(acc.dtype), part)
    return jax.lax.dynamic_update_slice(acc, new, (r, begin))


def _added(g_params, d_local, r):
    """The accumulators with repeat r's gradients added: a scatter-add, in place (a
    read-modify-write of the slice copied a repeat); where the loop sums them, into the
    repeat's row of the flat accumulators."""
    return jax.tree.map(lambda acc, d: acc.at[r].add(d.reshape(acc.shape[1:])), g_params, d_local)


def _kept(inbox, slot):
    """The input kept in the inbox's `slot` (NONE: virtual stage 0's, made by the prefix)."""
    return jax.lax.dynamic_index_in_dim(inbox, jnp.maximum(slot, 0), 0, False)


def _put(box, slot, value):
    """`box` with `value` in `slot`; unchanged where `slot` is NONE."""
    at = jnp.maximum(slot, 0)
    old = jax.lax.dynamic_index_in_dim(box, at, 0, False)
    new = jnp.where(slot == NONE, old, value.astype(box.dtype))
    return jax.lax.dynamic_update_index_in_dim(box, new, at, 0)
