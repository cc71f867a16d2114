"""FP8 token exchange (`parallel.token_dtype='fp8'`): a collective that moves its
payload as E4M3 with float32 scales, one per token and block of up to 128 channels.

Forward: quantise (scale = the block's amax / 448, E4M3's largest finite value), move
the 1-byte payload (as uint8, which every backend moves as raw bytes) and the scales
through the same collective, dequantise on arrival. Backward: the transposed collective
on the cotangent in the model's own dtype (bf16 in training), not FP8: gradients are
heavy-tailed per channel and their errors compound over the layers, and the dispatch's
forward halving is where the bytes are (the paper sends its backward per-channel, an
extra quantisation kernel this project does not have yet). Everything is one
`jax.custom_vjp`, so JAX never differentiates through the casts and never sends an
unscaled FP8 cotangent.

Only movements of tokens go through it (dispatch all-to-alls and all-gathers, the
Ulysses all-to-alls, a ring's steps); combines and every reduction stay in the model's
dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from fractions import Fraction
from functools import partial

import jax
import jax.numpy as jnp

E4M3 = jnp.float8_e4m3fn
E4M3_MAX = 448.0  # largest finite E4M3 value
BLOCK = 128  # channels per scale (DeepSeek-V3's and DeepEP's 1x128 blocks)


def block_size(channels: int) -> int:
    """Channels per scale: 128, or all of them when fewer (one scale per token)."""
    return BLOCK if channels % BLOCK == 0 else channels


def quantize(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., c] -> (payload uint8 [..., c], scales float32 [..., c / block])."""
    block = block_size(x.shape[-1])
    blocks = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, block)
    amax = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True)
    scale = jnp.where(amax > 0, amax / E4M3_MAX, 1.0)
    payload = (blocks / scale).astype(E4M3).reshape(x.shape)
    return jax.lax.bitcast_convert_type(payload, jnp.uint8), scale[..., 0]


def dequantize(payload: jax.Array, scales: jax.Array, dtype) -> jax.Array:
    values = jax.lax.bitcast_convert_type(payload, E4M3).astype(jnp.float32)
    blocks = values.reshape(*scales.shape, -1) * scales[..., None]
    return blocks.reshape(payload.shape).astype(dtype)


def fp8_collective(collective: Callable[[jax.Array], jax.Array], x: jax.Array) -> jax.Array:
    """`collective(x)` (a linear movement of whole tokens along the leading axes, the
    same for any trailing channel count) with the payload sent as E4M3."""
    return _fp8_collective(collective, x.shape, x)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _fp8_collective(collective, shape, x):
    payload, scales = quantize(x)
    return dequantize(collective(payload), collective(scales), x.dtype)


def _forward(collective, shape, x):
    # A scalar zero typed like x (the mesh axes it varies over): the backward rebuilds
    # the primal's type from it, nothing of x's size is kept.
    return _fp8_collective(collective, shape, x), jnp.zeros_like(x.reshape(-1)[0])


def _backward(collective, shape, zero, cotangent):
    primal = jnp.broadcast_to(zero, shape)
    (grad,) = jax.linear_transpose(collective, primal)(cotangent.astype(zero.dtype))
    return (grad,)


_fp8_collective.defvjp(_forward, _backward)


def fp8_indexed(collective: Callable, x: jax.Array, *indices: jax.Array) -> jax.Array:
    """`collective(x, *indices)` with the payload sent as E4M3, for a movement whose rows
    and destinations are traced integer arrays (`ragged_all_to_all`'s offsets and sizes);
    `indices` are not differentiated."""
    return _fp8_indexed(collective, x, *indices)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fp8_indexed(collective, x, *indices):
    payload, scales = quantize(x)
    return dequantize(collective(payload, *indices), collective(scales, *indices), x.dtype)


def _indexed_forward(collective, x, *indices):
    # x without its channels: its rows and its type (the mesh axes it varies over), for
    # the backward to rebuild the primal from; nothing of x's size is kept.
    return _fp8_indexed(collective, x, *indices), (x[..., :0], indices)


def _indexed_backward(collective, residuals, cotangent):
    edge, indices = residuals
    zero = edge.sum()  # typed like x
    primal = jnp.broadcast_to(zero, (*edge.shape[:-1], cotangent.shape[-1]))
    move = lambda x: collective(x, *indices)
    (grad,) = jax.linear_transpose(move, primal)(cotangent.astype(edge.dtype))
    return (grad, *(None for _ in indices))


_fp8_indexed.defvjp(_indexed_forward, _indexed_backward)


def wire_bytes(channels: int, token_dtype: str, native: int) -> Fraction:
    """Bytes per element a token movement of `channels`-wide rows sends: the model's
    `native` bytes, or with 'fp8' one byte plus a float32 scale per block."""
    if token_dtype != "fp8":
        return Fraction(native)
    return 1 + Fraction(4, block_size(channels))


def token_collective(collective: Callable, token_dtype: str) -> Callable:
    """`collective`, compressed as `parallel.token_dtype` says ('native': unchanged)."""
    return partial(fp8_collective, collective) if token_dtype == "fp8" else collective


def indexed_token_collective(collective: Callable, token_dtype: str) -> Callable:
    """`collective(x, *indices)`, compressed as `parallel.token_dtype` says."""
    return partial(fp8_indexed, collective) if token_dtype == "fp8" else collective
