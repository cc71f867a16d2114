"""Zeros typed like the values written into them, for loop carries and output buffers.

Inside `shard_map` every value carries the mesh axes it varies over, and a loop's carry
(or a buffer a collective writes into) must vary over the same ones as what is written
into it. A zero taken from each of the values it will meet gives it that type exactly;
outside `shard_map` it changes nothing. A buffer typed as replicated would also make JAX
sum its cotangent over devices in the backward pass.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _zero(dtype, like: tuple[jax.Array, ...]) -> jax.Array:
    return sum((jnp.zeros_like(x.reshape(-1)[0], dtype) for x in like), jnp.zeros((), dtype))


def varying_zeros(shape: tuple[int, ...], dtype, *like: jax.Array) -> jax.Array:
    """Zeros of `shape` and `dtype`, varying over the mesh axes any of `like` varies over."""
    return jnp.zeros(shape, dtype) + _zero(dtype, like)


def varying_like(init, *like: jax.Array):
    """`init` (a tree), each leaf varying over the mesh axes any of `like` varies over."""
    return jax.tree.map(lambda a: a + _zero(a.dtype, like), init)


def vary_like(x: jax.Array, *like: jax.Array) -> jax.Array:
    """`x` retyped to vary over the mesh axes any of `like` varies over as well: no copy
    (outside `shard_map`, or when it already does, `x` itself), and in the backward
    pass its cotangent is summed over the axes it gained."""
    missing = frozenset().union(*(varying_axes(a) for a in like)) - varying_axes(x)
    return jax.lax.pcast(x, tuple(sorted(missing)), to="varying") if missing else x


def varying_axes(x: jax.Array) -> frozenset[str]:
    """The mesh axes `x` varies over inside `shard_map` (jax 0.11 spells it `vma`)."""
    aval = jax.typeof(x)
    if hasattr(aval, "vma"):
        return frozenset(aval.vma)
    return frozenset(aval.manual_axis_type.varying)


def _untyped(fn, *args: jax.Array) -> jax.Array:
    """`fn(*args)` in an empty nested `shard_map` without the varying-type checks: its
    result carries no varying type (the caller gives it one)."""
    spec = jax.sharding.PartitionSpec()
    # Arithmetic inside the unchecked region drops the types, so the operands' copies
    # (and everything made from them) are uniformly untyped there.
    untyped = lambda *a: fn(*(x + jnp.zeros((), x.dtype) for x in a))
    inner = jax.shard_map(
        untyped,
        in_specs=(spec,) * len(args),
        out_specs=spec,
        axis_names=frozenset(),
        check_vma=False,
    )
    return inner(*args)


def unchecked(fn, *args: jax.Array) -> jax.Array:
    """`fn(*args)` typed as varying over every mesh axis any of `args` varies over, with
    the varying-type checks off inside. Pallas kernels (and their interpreter, which
    slices varying operands with unvarying indices) do not type-check under
    `shard_map`; this wraps one in an empty nested `shard_map` that turns the checks
    off, and types its result as what it is: per-device data."""
    axes = tuple(sorted(frozenset().union(*(varying_axes(a) for a in args))))
    if not axes:
        return fn(*args)
    return jax.lax.pcast(_untyped(fn, *args), axes, to="varying")


def typed_as_summed(x: jax.Array, like: jax.Array) -> jax.Array:
    """`x`, equal on every device of the mesh axes `like` does not vary over (it was
    summed over them, a part at a time, into a buffer typed varying), typed as `like`:
    invariant there. No communication: retyped as `unchecked` types a kernel's result."""
    return vary_like(_untyped(lambda a: a, x), like)
