"""Collective matmul: an exchange of the intra group cut into its n-1 point-to-point
steps, each overlapping the GEMM on the block at hand (`parallel.collective_matmul`).

Three shapes cover every layout that has one (inside `shard_map`, over the intra group
as one axis, with this device's index `me`):

* `ring_gather(f, x)`: all-gather + GEMM. The block of source (me - i) mod n is at hand
  at step i; `f` runs on it while it travels one device on (the last step sends
  nothing). Returns f of every source's block, in step order.
* `ring_reduce_scatter(part)`: GEMM + reduce-scatter. A travelling accumulator: at step
  i this device adds its contribution to the block of target (me - 1 - i) mod n, then
  passes the sum on; after n-1 sends each device holds the sum for its own block.
  `part(j)` is this device's contribution to target (me - j) mod n; it is asked for in
  the order the ring needs it, so step i's GEMM runs while step i-1's sum travels.
* `pairwise_all_to_all(send)`: all-to-all + GEMM. Step k sends the block for
  device (me + k) mod n and receives the one from (me - k) mod n (k = 0 stays here), so
  the GEMM that makes or consumes one block overlaps the next block's transfer.

Each step i runs under the name scope `ring_scope(i)`, so the compiled program says which
ring step a collective-permute belongs to. The backward of a ring is a ring: JAX
transposes every `ppermute` into one that runs the other way.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp

from moe_jax.parallel.layout import INTRA
from moe_jax.parallel.scopes import TOKEN_EXCHANGE, ring_scope


def shift(x, n: int, by: int = 1):
    """Every device's `x` to device (me + by) mod n of the intra group."""
    with jax.named_scope(TOKEN_EXCHANGE):
        perm = [(j, (j + by) % n) for j in range(n)]
        return jax.tree.map(lambda a: jax.lax.ppermute(a, INTRA, perm), x)


def me() -> jax.Array:
    return jax.lax.axis_index(INTRA)


def ring_gather(f: Callable, x, n: int, move: Callable | None = None) -> list:
    """[f(block of source (me - i) mod n) for i in range(n)]: x travels the ring, one
    device on per step by `move` (default `shift`; an FP8 form compresses it)."""
    move = move or (lambda x: shift(x, n))
    outs = []
    for i in range(n):
        with jax.named_scope(ring_scope(i)):
            outs.append(f(x))
            if i < n - 1:
                x = move(x)
    return outs


def ring_reduce_scatter(part: Callable[[int], jax.Array], n: int) -> jax.Array:
    """The sum over the group's devices of their `part` for this device's block, where
    `part(j)` is this device's contribution to target (me - j) mod n."""
    if n == 1:
        return part(0)
    with jax.named_scope(ring_scope(0)):
        acc = part(1)
    for i in range(1, n):
        with jax.named_scope(ring_scope(i)):
            j = (i + 1) % n  # the last step adds this device's own block
            acc = shift(acc, n) + part(j)
    return acc


def pairwise_all_to_all(
    send: Callable[[jax.Array], object], n: int, wrap: Callable = lambda move: move
) -> list[tuple]:
    """[(source, block)] for k in 0..n-1: the block (or tuple of blocks) `send(dest)`
    made for this device on device source = (me - k) mod n (where dest = (me + k) mod
    n). `wrap` turns each step's move into the one to run (an FP8 form compresses it)."""
    got = []
    for k in range(n):
        with jax.named_scope(ring_scope(k)):
            block = send((me() + k) % n)
            move = wrap(partial(shift, n=n, by=k))
            moved = jax.tree.map(move, block) if k else block  # each buffer of the step
            got.append(((me() - k) % n, moved))
    return got


def place(blocks: list[jax.Array], sources: list[jax.Array], axis: int) -> jax.Array:
    """The blocks concatenated along `axis` in source order (sources[i] of blocks[i])."""
    size = blocks[0].shape[axis]
    shape = list(blocks[0].shape)
    shape[axis] = size * len(blocks)
    full = jnp.zeros(shape, blocks[0].dtype)
    for block, source in zip(blocks, sources, strict=True):
        full = jax.lax.dynamic_update_slice_in_dim(full, block, source * size, axis)
    return full


def ring_sources(n: int) -> list[jax.Array]:
    """The source of each step of `ring_gather`: (me - i) mod n."""
    return [(me() - i) % n for i in range(n)]


def block_of(x: jax.Array, target: jax.Array, n: int, axis: int) -> jax.Array:
    """Block `target` of n equal blocks of `x` along `axis`."""
    size = x.shape[axis] // n
    return jax.lax.dynamic_slice_in_dim(x, target * size, size, axis)
