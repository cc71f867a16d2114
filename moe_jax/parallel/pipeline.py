"""Pipeline parallelism over the 'stage' mesh axis: GPipe with circular repeats.

The MoE layer stack of U units is cut into R * S groups of U / (R S) units; group
g = r S + s lives on stage s, so each stage holds R non-adjacent groups (`repeats`,
the circular or interleaved schedule; R = 1 is plain GPipe). The model builds the
stack as [U, ...] and runs it through `Layout.stack`; `hold` then puts a finished
model's stack in the form the pipeline runs, [R, U / R, ...] with the second axis split
over 'stage' (`PIPELINED`; with R = 1 the [U, ...] itself, renamed), a reshape of the
canonical [U, ...] it is checkpointed as (`canonical`, `staged`). The model itself
reads no pipeline setting.

Everything else (embedding, dense prefix, final norm, head and loss) runs outside the
pipeline with 'stage' folded into the batch: stage s embeds and scores micro-batches
s K .. (s + 1) K - 1 of its data group (K = M / S). One SPMD program, run per device
inside the step's `shard_map` (`moe_jax.parallel.per_device_step`):

1. every stage sends its K embedded micro-batches to stage 0 (S - 1 collective-permutes),
2. M R + S - 1 ticks: at tick t stage s runs iteration i = t - s (micro-batch i mod M,
   repeat i // M) through its group of that repeat and sends the result to stage
   s + 1 mod S by `ppermute`; stage 0 keeps the results coming back from stage S - 1
   in the micro-batch's slot of its buffer, read again M - S ticks later (M >= S) for
   the next repeat, or as the final output after the last,
3. stage 0 sends each stage its K final outputs back (S - 1 collective-permutes).

A tick whose iteration is outside [0, M R) is a bubble: it computes on zeros, never on
what its buffers hold, so nothing it produces reaches an output, a weight gradient
(zeros in, zero cotangents out) or the router statistics (masked out). Each tick is
rematerialised: the forward keeps only the M R + S - 1 tick inputs (GPipe's memory:
every micro-batch's stage input stays alive until the backward), and the backward
re-runs one tick at a time under the model's own `model.remat` policy.

Router statistics are kept per canonical layer: each stage adds its groups' statistics
of every valid tick into a [U, ...] total at those layers' indices, summed over stages
at the end; the pipeline returns their mean over the M micro-batches, as `grad_accum`
would (each micro-batch's aux, sequence and z losses are those of that micro-batch,
computed over the whole data group; capacity applies per micro-batch).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moe_jax.kernels.varying import varying_like
from moe_jax.parallel.layout import STAGE, Layout
from moe_jax.parallel.peaks import map_stats, maximum
from moe_jax.parallel.scopes import DOCUMENT_POSITIONS, PIPELINE, STAGE_SEND

# The held stack's leading logical axes: [repeats, layers / repeats, ...], the second
# split over stages (the layout's rules map 'stage_layers' to 'stage').
PIPELINED = ("repeats", "stage_layers")


def hold(model, layout: Layout):
    """`model` (a finished `Transformer`) with its MoE stack's parameters in the form
    this layout's pipeline runs (see the module docstring); unchanged without one."""
    if layout.pipelined and model.moe is not None:
        for _, variable in nnx.iter_graph(model.moe):
            if isinstance(variable, nnx.Param):
                _to_held(variable, layout.repeats)
    return model


def _to_held(variable: nnx.Param, repeats: int) -> None:
    """[layers, ...] -> [repeats, layers / repeats, ...] named `PIPELINED` (with one
    repeat, the same array named ('stage_layers', ...))."""
    value = variable.get_value()
    names = variable.get_metadata().get("out_sharding") or ("layers",)
    if repeats == 1:
        variable.set_metadata("out_sharding", (*PIPELINED[1:], *names[1:]))
        return
    variable.set_value(value.reshape(repeats, value.shape[0] // repeats, *value.shape[1:]))
    variable.set_metadata("out_sharding", (*PIPELINED, *names[1:]))


def ticks(layout: Layout) -> int:
    """Length of the tick loop: M R + S - 1."""
    return layout.microbatches * layout.repeats + layout.stages - 1


def valid_fraction(stages: int, microbatches: int, repeats: int) -> float:
    """Share of (stage, tick) pairs that run a micro-batch: M R / (M R + S - 1)."""
    work = microbatches * repeats
    return work / (work + stages - 1)


def run(layout: Layout, run_group, params, rest, x, positions, bubble: float = 0.0):
    """`_run` under the pipeline's name scope, which marks its loops and sends in the
    compiled program."""
    with jax.named_scope(PIPELINE):
        return _run(layout, run_group, params, rest, x, positions, bubble)


def _run(layout: Layout, run_group, params, rest, x, positions, bubble: float):
    """The pipelined stack on one device: `x` [K * mb, seq, h] holds this stage's K
    micro-batches, `params` this stage's [R, U / (R S), ...] groups, `rest` (the routers'
    biases) the canonical [U, ...]. Returns (y like x, stats [U, ...] averaged over the
    micro-batches). `bubble` fills the buffers before anything is written into them
    (tests poison them with NaN)."""
    stages, m, repeats = layout.stages, layout.microbatches, layout.repeats
    k = m // stages
    me = jax.lax.axis_index(STAGE)
    first = me == 0
    xs = x.reshape(k, x.shape[0] // k, *x.shape[1:])
    if layout.documents:  # every micro-batch's own, on every stage: one gather a step
        with jax.named_scope(DOCUMENT_POSITIONS):
            every = jax.lax.all_gather(positions.reshape(k, -1, positions.shape[-1]), STAGE)
        every = every.reshape(m, *every.shape[2:])  # micro-batch j K + i: stage j's i-th
    else:  # the same 0, 1, 2, ... in every row
        positions = positions[: xs.shape[1]]
    if repeats == 1:  # held as [U / S, ...] per stage: the one repeat's group
        params = jax.tree.map(lambda p: p[None], params)
    buffer = _gather_to_first(xs, stages, bubble)

    def stage_fn(params, rest, x, t):
        i = t - me
        r = jnp.clip(i // m, 0, repeats - 1)
        local = jax.tree.map(lambda p: p[r], params)
        here = jax.tree.map(lambda b: stage_rows(b, repeats, stages)[r, me], rest)
        if not layout.documents:
            return run_group(local, here, x, positions)
        mine = jax.lax.dynamic_index_in_dim(every, jnp.mod(i, m), keepdims=False)
        return run_group(local, here, x, mine)

    stage_fn = jax.checkpoint(stage_fn)
    stats_shape = jax.eval_shape(stage_fn, params, rest, xs[0], 0)[1]
    per_stage = jax.tree.leaves(params)[0].shape[1]
    like = (xs, jnp.asarray(me), *jax.tree.leaves(params))
    total = empty_stats(stats_shape, repeats * stages * per_stage, like)
    ring = [(j, (j + 1) % stages) for j in range(stages)]

    def tick(carry, t):
        buffer, received, total = carry
        buffer = _keep_returned(buffer, received, first & (t >= stages), (t - stages) % m)
        i = t - me
        valid = (i >= 0) & (i < m * repeats)
        slot = jax.lax.dynamic_index_in_dim(buffer, t % m, keepdims=False)
        x_in = jnp.where(first, slot, received)
        x_in = jnp.where(valid, x_in, jnp.zeros_like(x_in))
        y, stats = stage_fn(params, rest, x_in, t)
        r = jnp.clip(i // m, 0, repeats - 1)
        total = add_stats(total, stats, (r * stages + me) * per_stage, valid)
        with jax.named_scope(STAGE_SEND):
            sent = jax.lax.ppermute(y, STAGE, ring)
        return (buffer, sent, total), None

    received = jnp.full_like(xs[0], bubble)
    (buffer, received, total), _ = jax.lax.scan(
        tick, (buffer, received, total), jnp.arange(ticks(layout))
    )
    buffer = _keep_returned(buffer, received, first, m - 1)
    y = _scatter_from_first(buffer, stages, k, me)
    return y.reshape(x.shape), mean_stats(total, m)


def empty_stats(shape, rows: int | None, like: tuple):
    """Accumulators [rows, ...] for statistics of `shape` ([U / (R S), ...] per
    statistic; `rows` None: of `shape` itself): zeros, and -inf for attention's peaks
    (`moe_jax.parallel.peaks`), varying like the arrays `like`."""
    size = lambda s: s.shape if rows is None else (rows, *s.shape[1:])
    empty = lambda fill: lambda s: jnp.full(size(s), fill, s.dtype)
    return varying_like(map_stats(empty(0), empty(-jnp.inf), shape), *like)


def add_stats(total, stats, start, valid):
    """`total` ([U, ...] per statistic) with a group's `stats` ([U / (R S), ...]) added
    at rows `start` onwards where `valid` (a bubble's are left out); peaks by their
    maximum."""

    def into(combine, nothing):
        def put(acc, s):
            rows = jax.lax.dynamic_slice_in_dim(acc, start, s.shape[0])
            rows = combine(rows, jnp.where(valid, s, jnp.full_like(s, nothing)))
            return jax.lax.dynamic_update_slice_in_dim(acc, rows, start, axis=0)

        return put

    return map_stats(into(jnp.add, 0), into(jnp.maximum, -jnp.inf), total, stats)


def mean_stats(total, m: int):
    """Statistics summed over a stage's micro-batches as every stage has them: their
    mean over the `m` micro-batches, the peaks' maximum (`moe_jax.parallel.peaks`)."""
    return map_stats(
        lambda s: jax.lax.psum(s, STAGE) / m,
        lambda s: maximum(s, {STAGE}),
        total,
    )


def stage_rows(b: jax.Array, repeats: int, stages: int) -> jax.Array:
    """A canonical [U, ...] array as [R, S, U / (R S), ...]: [r, s] is group r S + s."""
    return b.reshape(repeats, stages, b.shape[0] // (repeats * stages), *b.shape[1:])


def _keep_returned(buffer, received, keep, slot):
    """Stage 0 stores what came back from the last stage in micro-batch `slot`."""
    old = jax.lax.dynamic_index_in_dim(buffer, slot, keepdims=False)
    return jax.lax.dynamic_update_index_in_dim(buffer, jnp.where(keep, received, old), slot, 0)


def _gather_to_first(xs: jax.Array, stages: int, bubble: float) -> jax.Array:
    """[M, ...] on stage 0: micro-batch j K + i is stage j's xs[i]."""
    with jax.named_scope(STAGE_SEND):
        parts = [xs] + [jax.lax.ppermute(xs, STAGE, [(j, 0)]) for j in range(1, stages)]
    buffer = jnp.concatenate(parts)
    return buffer if bubble == 0 else jnp.where(jax.lax.axis_index(STAGE) == 0, buffer, bubble)


def _scatter_from_first(buffer: jax.Array, stages: int, k: int, me) -> jax.Array:
    """Stage s's K final outputs, micro-batches s K .. (s + 1) K - 1, from stage 0."""
    mine = buffer[:k]
    for j in range(1, stages):
        with jax.named_scope(STAGE_SEND):
            got = jax.lax.ppermute(buffer[j * k : (j + 1) * k], STAGE, [(0, j)])
        mine = jnp.where(me == j, got, mine)
    return mine


def microbatch_major(batch: dict, layout: Layout) -> tuple[dict, P]:
    """Token arrays [B, seq] as [S, K, B / M, seq] and their spec: micro-batch m holds
    rows m, m + M, ... (as `grad_accum`'s micro-batches), and stage s gets micro-batches
    s K .. (s + 1) K - 1, each split over its data group as the attention layout splits
    a batch. Only token ids move (a few bytes per token)."""
    stages, m = layout.stages, layout.microbatches

    def reorder(x):
        rows = x.reshape(x.shape[0] // m, m, *x.shape[1:]).swapaxes(0, 1)
        return rows.reshape(stages, m // stages, *rows.shape[1:])

    spec = P(STAGE, None, layout.batch_axes or None, layout.seq_axes or None)
    return jax.tree.map(reorder, batch), spec


def local_batch(batch: dict) -> dict:
    """One device's [1, K, mb, seq] pieces as the [K * mb, seq] batch it runs."""
    return jax.tree.map(lambda x: x.reshape(x.shape[1] * x.shape[2], *x.shape[3:]), batch)


def _is_pipelined(leaf) -> bool:
    if not isinstance(leaf, nnx.Variable):
        return False
    names = tuple(leaf.get_metadata().get("out_sharding") or ())
    return names[:1] == PIPELINED[1:] or names[:2] == PIPELINED


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def _merged_names(names) -> tuple:
    return ("layers", *names[(2 if tuple(names[:2]) == PIPELINED else 1) :])


def canonical(tree):
    """A state tree with every pipelined variable in its checkpoint form [U, ...] named
    ('layers', ...): exact (a reshape); arrays, or `jax.ShapeDtypeStruct`s with
    shardings (the canonical form's: split over 'stage' in contiguous blocks)."""

    def merge(leaf):
        if not _is_pipelined(leaf):
            return leaf
        value, names = leaf.get_value(), leaf.get_metadata()["out_sharding"]
        repeats = value.shape[0] if tuple(names[:2]) == PIPELINED else 1
        shape = (value.shape[0] * value.shape[1], *value.shape[2:]) if repeats > 1 else None
        if isinstance(value, jax.ShapeDtypeStruct):
            sharding = value.sharding
            if repeats > 1 and isinstance(sharding, NamedSharding):
                sharding = NamedSharding(sharding.mesh, P(*sharding.spec[1:]))
            value = jax.ShapeDtypeStruct(shape or value.shape, value.dtype, sharding=sharding)
        elif shape is not None:
            value = value.reshape(shape)
        return leaf.replace(value, out_sharding=_merged_names(names))

    return jax.tree.map(merge, tree, is_leaf=_is_variable)


def staged(canonical_tree, like):
    """`canonical_tree` back in the form of `like` (a tree of arrays or shardings-carrying
    `jax.ShapeDtypeStruct`s as the run holds it)."""

    def split(leaf, target):
        if not _is_pipelined(target):
            return leaf
        want = target.get_value()
        value = leaf.get_value().reshape(want.shape)
        if getattr(want, "sharding", None) is not None:
            value = jax.device_put(value, want.sharding)
        return leaf.replace(value, out_sharding=target.get_metadata()["out_sharding"])

    return jax.tree.map(split, canonical_tree, like, is_leaf=_is_variable)
