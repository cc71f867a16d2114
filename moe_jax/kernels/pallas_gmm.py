"""Grouped GEMM kernels in Pallas (Triton backend) with the MoE row maps fused in.

Rows are sorted by expert without padding: group g owns rows
[offsets[g], offsets[g+1]) of the sorted order, and rows past the last group are
empty. Two kernels cover the three products a MoE layer needs:

* `grouped_matmul`: [M, K] x [E, K, N] -> [M, N] by groups (the forward, and with
  `transpose_rhs` the input gradient). A program computes one (block of rows,
  group) work item against one block of columns; a block of rows that straddles
  a group boundary is visited once per group it touches, each visit loading and
  storing only its group's rows, so no group is padded to a block in memory.
  The prologue can read row r from `lhs[lhs_rows[r]]` (the dispatch gather,
  fused), and the epilogue can add `out_scale[r] *` row r into `out[out_rows[r]]`
  (the weighted combine, fused: atomic float32 adds into token order).
* `transposed_grouped_matmul`: [M, K]^T x [M, N] -> [E, K, N], the weight
  gradient. A program owns one expert's (K, N) block and accumulates it in one
  pass over that expert's rows, with the same fused row maps on both sides.

Why Triton rather than Mosaic GPU: the fused maps are gathers and scattered adds
of whole rows, which Triton expresses as masked pointer loads and atomics on every
GPU generation and jax version this project supports, and `interpret=True` runs
the same kernels on CPU through public API, which is how they are tested.

Interpreted or compiled by Triton is decided per lowering platform
(`lax.platform_dependent`), not from the process's default backend: a program
lowered for a GPU it does not run on (an abstract H100 in the CPU tests,
`tests/test_pallas_lowering.py`) gets the Triton kernels and the GPU tiles, and only
a program lowered for CPU runs them interpreted (slowly; for tests only).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from moe_jax.kernels.varying import unchecked


@dataclasses.dataclass(frozen=True)
class Blocks:
    """Tile sizes: rows (m), contraction (k) and output columns (n)."""

    m: int = 64
    k: int = 64
    n: int = 128
    warps: int = 4
    stages: int = 3


GPU_BLOCKS = Blocks(m=64, k=64, n=128, warps=4, stages=3)  # H100/H200 bf16 tiles
INTERPRET_BLOCKS = Blocks(m=16, k=16, n=16, warps=4, stages=1)  # small: fast CPU tests


def default_blocks(platform: str | None = None) -> Blocks:
    """The tiles used on `platform` (default: this process's backend): GPU tiles on a
    GPU, small ones where the kernels are interpreted (CPU)."""
    platform = platform or jax.default_backend()
    return GPU_BLOCKS if platform in ("gpu", "cuda", "rocm") else INTERPRET_BLOCKS


def per_platform(run, blocks: Blocks | None, *args: jax.Array) -> jax.Array:
    """`run(interpret, blocks, *args)`, chosen when the program is lowered: Triton with
    the GPU tiles for an NVIDIA or AMD GPU, interpreted with the small tiles anywhere
    else (CPU, and TPU, which has no Triton). `blocks` given: those tiles everywhere."""
    triton = functools.partial(run, False, blocks or GPU_BLOCKS)
    return jax.lax.platform_dependent(
        *args,
        cuda=triton,
        rocm=triton,
        default=functools.partial(run, True, blocks or INTERPRET_BLOCKS),
    )


def fit(size: int, preferred: int) -> int:
    """A power-of-two block for a dimension of `size`: `preferred`, or less for a small
    dimension, never under 16 (Triton's smallest dot). Edges are masked."""
    block = 16
    while block < min(size, preferred):
        block *= 2
    return block


def group_offsets(group_sizes: jax.Array) -> jax.Array:
    """[E] sizes -> [E + 1] offsets of each group's first row in the sorted order."""
    sizes = group_sizes.astype(jnp.int32)
    return jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(sizes)])


def work_items(offsets: jax.Array, rows: int, block_m: int) -> tuple[jax.Array, jax.Array]:
    """(group, row block) of every forward work item, and a static count of them.

    Group g touches row blocks lo//bm .. (hi-1)//bm; empty groups touch none. There
    are at most cdiv(rows, bm) + E - 1 items (each boundary adds one); unused items
    carry group E, which their program skips."""
    num_groups = offsets.shape[0] - 1
    lo, hi = offsets[:-1], offsets[1:]
    first = lo // block_m
    count = jnp.where(hi > lo, (hi - 1) // block_m - first + 1, 0)
    ends = jnp.cumsum(count)
    capacity = pl.cdiv(rows, block_m) + num_groups - 1
    item = jnp.arange(capacity, dtype=jnp.int32)
    group = jnp.searchsorted(ends, item, side="right").astype(jnp.int32)
    safe = jnp.minimum(group, num_groups - 1)
    block = first[safe] + item - (ends[safe] - count[safe])
    return group, block.astype(jnp.int32)


def _rows_of(indices_ref, r: jax.Array, size: int, limit: int) -> tuple[jax.Array, jax.Array]:
    """Rows `r` through an index map (or the identity), clamped, and which are real."""
    if indices_ref is None:
        return jnp.minimum(r, size - 1), r < size
    mapped = indices_ref[jnp.minimum(r, size - 1)]
    return jnp.minimum(mapped, limit - 1), mapped < limit


def _grouped_kernel(
    offsets_ref,
    group_ref,
    block_ref,
    lhs_ref,
    rhs_ref,
    lhs_rows_ref,
    out_rows_ref,
    out_scale_ref,
    zeros_ref,
    out_ref,
    *,
    blocks: Blocks,
    rows: int,
    transpose_rhs: bool,
):
    del zeros_ref  # aliased to out_ref: rows no group owns stay zero
    item, col = pl.program_id(0), pl.program_id(1)
    num_groups = offsets_ref.shape[0] - 1
    group = group_ref[item]

    @pl.when(group < num_groups)
    def _():
        lo, hi = offsets_ref[group], offsets_ref[group + 1]
        r = block_ref[item] * blocks.m + jnp.arange(blocks.m)
        mine = (r >= lo) & (r < hi)
        src, real = _rows_of(lhs_rows_ref, r, rows, lhs_ref.shape[0])
        load = mine & real
        contraction = lhs_ref.shape[1]
        n = rhs_ref.shape[1] if transpose_rhs else rhs_ref.shape[2]
        cols = col * blocks.n + jnp.arange(blocks.n)
        cols_in = cols < n

        def step(kb, acc):
            ks = kb * blocks.k + jnp.arange(blocks.k)
            ks_in = ks < contraction
            ks_c, cols_c = jnp.minimum(ks, contraction - 1), jnp.minimum(cols, n - 1)
            a_mask = load[:, None] & ks_in[None, :]
            a = plt.load(lhs_ref.at[src[:, None], ks_c[None, :]], mask=a_mask, other=0)
            if transpose_rhs:  # rhs is [E, N, K]
                b_at, b_mask = (cols_c[:, None], ks_c[None, :]), cols_in[:, None] & ks_in[None, :]
            else:
                b_at, b_mask = (ks_c[:, None], cols_c[None, :]), ks_in[:, None] & cols_in[None, :]
            b = plt.load(rhs_ref.at[(group, *b_at)], mask=b_mask, other=0)
            return acc + plt.dot(a, b, trans_b=transpose_rhs)

        acc = jax.lax.fori_loop(
            0, pl.cdiv(contraction, blocks.k), step, jnp.zeros((blocks.m, blocks.n), jnp.float32)
        )
        if out_rows_ref is None:
            # Masked-off lanes point at the last row of `out`: in interpret mode a masked
            # store writes the old value back, so that row is a spare one there.
            dest = jnp.where(mine, r, out_ref.shape[0] - 1)
            out = out_ref.at[dest[:, None], cols[None, :]]
            plt.store(out, acc.astype(out_ref.dtype), mask=mine[:, None])
        else:
            dest, keep = _rows_of(out_rows_ref, r, rows, out_ref.shape[0] - 1)
            keep = keep & mine
            if out_scale_ref is not None:
                acc = acc * out_scale_ref[jnp.minimum(r, rows - 1)].astype(jnp.float32)[:, None]
            # Rows that are not this item's land, zeroed, on the spare last row. A group
            # sends a token at most one row, so one program never adds twice to a row
            # (interpret mode's atomics would lose the second add).
            dest = jnp.where(keep, dest, out_ref.shape[0] - 1)
            value = jnp.where(keep[:, None], acc, 0.0)
            plt.atomic_add(out_ref, (dest[:, None], cols[None, :]), value)


def grouped_matmul(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    rows: int | None = None,
    lhs_rows: jax.Array | None = None,
    out_rows: jax.Array | None = None,
    out_scale: jax.Array | None = None,
    num_out_rows: int | None = None,
    transpose_rhs: bool = False,
    blocks: Blocks | None = None,
) -> jax.Array:
    """Sorted row r (of `rows`) times its group's `rhs[g]` ([K, N], or [N, K] with
    `transpose_rhs`).

    `lhs_rows` [rows]: row r reads `lhs[lhs_rows[r]]` (an index >= len(lhs) reads
    zeros); else `lhs` is the sorted rows themselves. Without `out_rows` the result
    is [rows, N] in sorted order, zero on rows no group owns, in `lhs`'s dtype. With
    `out_rows` [rows] (and optionally `out_scale` [rows]) it is [num_out_rows, N]
    float32: out[out_rows[r]] += out_scale[r] * row r (an index >= num_out_rows is
    dropped); within one group the `out_rows` must be distinct, as a MoE's are."""
    rows = rows if rows is not None else (lhs.shape[0] if lhs_rows is None else lhs_rows.shape[0])
    optional = [a for a in (lhs_rows, out_rows, out_scale) if a is not None]
    names = (lhs_rows is not None, out_rows is not None, out_scale is not None)

    def run(interpret: bool, blocks: Blocks, lhs, rhs, group_sizes, *optional):
        n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
        contraction = rhs.shape[2] if transpose_rhs else rhs.shape[1]
        blocks = dataclasses.replace(blocks, k=fit(contraction, blocks.k), n=fit(n, blocks.n))
        offsets = group_offsets(group_sizes)
        group, block = work_items(offsets, rows, blocks.m)
        width = pl.cdiv(n, blocks.n) * blocks.n  # whole column blocks: no two lanes share a cell
        if out_rows is None:  # + a spare row for masked-off lanes when interpreted
            zeros = jnp.zeros((rows + interpret, width), lhs.dtype)
        else:
            zeros = jnp.zeros((num_out_rows + 1, width), jnp.float32)  # + a spare row for misses
        kernel = functools.partial(
            _grouped_kernel, blocks=blocks, rows=rows, transpose_rhs=transpose_rhs
        )

        def bound(*refs):
            offsets_ref, group_ref, block_ref, lhs_ref, rhs_ref, *rest = refs
            extra = iter(rest[: len(optional)])
            maps = [next(extra) if present else None for present in names]
            zeros_ref, out_ref = rest[len(optional) :]
            kernel(offsets_ref, group_ref, block_ref, lhs_ref, rhs_ref, *maps, zeros_ref, out_ref)

        inputs = [offsets, group, block, lhs, rhs, *optional, zeros]
        out = pl.pallas_call(
            bound,
            out_shape=jax.ShapeDtypeStruct(zeros.shape, zeros.dtype),
            grid=(group.shape[0], width // blocks.n),
            input_output_aliases={len(inputs) - 1: 0},
            interpret=interpret,
            compiler_params=plt.CompilerParams(num_warps=blocks.warps, num_stages=blocks.stages),
            name="moe_grouped_matmul",
        )(*inputs)
        return out[:rows, :n] if out_rows is None else out[:-1, :n]

    call = functools.partial(per_platform, run, blocks)
    return unchecked(call, lhs, rhs, group_sizes, *optional)


def _transposed_kernel(
    offsets_ref,
    lhs_ref,
    rhs_ref,
    lhs_rows_ref,
    rhs_rows_ref,
    rhs_scale_ref,
    out_ref,
    *,
    blocks: Blocks,
    rows: int,
):
    group, kb, nb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    lo, hi = offsets_ref[group], offsets_ref[group + 1]
    k, n = lhs_ref.shape[1], rhs_ref.shape[1]
    ks = kb * blocks.k + jnp.arange(blocks.k)
    ns = nb * blocks.n + jnp.arange(blocks.n)
    ks_in, ns_in = ks < k, ns < n
    ks, ns = jnp.minimum(ks, k - 1), jnp.minimum(ns, n - 1)

    def step(i, acc):
        r = lo + i * blocks.m + jnp.arange(blocks.m)
        mine = r < hi
        a_src, a_real = _rows_of(lhs_rows_ref, r, rows, lhs_ref.shape[0])
        b_src, b_real = _rows_of(rhs_rows_ref, r, rows, rhs_ref.shape[0])
        a_ok, b_ok = mine & a_real, mine & b_real
        a_mask, b_mask = a_ok[:, None] & ks_in[None, :], b_ok[:, None] & ns_in[None, :]
        a = plt.load(lhs_ref.at[a_src[:, None], ks[None, :]], mask=a_mask, other=0)
        b = plt.load(rhs_ref.at[b_src[:, None], ns[None, :]], mask=b_mask, other=0)
        if rhs_scale_ref is not None:
            scale = rhs_scale_ref[jnp.minimum(r, rows - 1)]
            b = (b.astype(jnp.float32) * jnp.where(b_ok, scale, 0)[:, None]).astype(b.dtype)
        return acc + plt.dot(a, b, trans_a=True)

    steps = pl.cdiv(hi - lo, blocks.m)
    acc = jax.lax.fori_loop(0, steps, step, jnp.zeros((blocks.k, blocks.n), jnp.float32))
    out_ref[group, pl.ds(kb * blocks.k, blocks.k), pl.ds(nb * blocks.n, blocks.n)] = acc


def transposed_grouped_matmul(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    rows: int,
    lhs_rows: jax.Array | None = None,
    rhs_rows: jax.Array | None = None,
    rhs_scale: jax.Array | None = None,
    blocks: Blocks | None = None,
) -> jax.Array:
    """[E, K, N] float32: out[g] = sum over group g's rows r of a_r^T b_r, where
    a_r = lhs[lhs_rows[r]] (or lhs[r]) and b_r = rhs_scale[r] * rhs[rhs_rows[r]]
    (or rhs[r]); indices past the end read zeros. One pass over each group's rows."""
    k, n = lhs.shape[1], rhs.shape[1]
    num_groups = group_sizes.shape[0]
    optional = [a for a in (lhs_rows, rhs_rows, rhs_scale) if a is not None]
    names = (lhs_rows is not None, rhs_rows is not None, rhs_scale is not None)

    def run(interpret: bool, blocks: Blocks, group_sizes, lhs, rhs, *optional):
        blocks = dataclasses.replace(blocks, k=fit(k, blocks.k), n=fit(n, blocks.n))
        k_pad, n_pad = pl.cdiv(k, blocks.k) * blocks.k, pl.cdiv(n, blocks.n) * blocks.n
        kernel = functools.partial(_transposed_kernel, blocks=blocks, rows=rows)

        def bound(offsets_ref, lhs_ref, rhs_ref, *rest):
            extra = iter(rest[: len(optional)])
            maps = [next(extra) if present else None for present in names]
            kernel(offsets_ref, lhs_ref, rhs_ref, *maps, rest[-1])

        out = pl.pallas_call(
            bound,
            out_shape=jax.ShapeDtypeStruct((num_groups, k_pad, n_pad), jnp.float32),
            grid=(num_groups, k_pad // blocks.k, n_pad // blocks.n),
            interpret=interpret,
            compiler_params=plt.CompilerParams(num_warps=blocks.warps, num_stages=blocks.stages),
            name="moe_transposed_grouped_matmul",
        )(group_offsets(group_sizes), lhs, rhs, *optional)
        return out[:, :k, :n]

    call = functools.partial(per_platform, run, blocks)
    return unchecked(call, group_sizes, lhs, rhs, *optional)
