"""All-to-all expert parallelism that sends only the rows each destination needs.

`alltoall_moe` exchanges static per-destination buffers padded to the worst
case (dropless: every assignment of the device's tokens, for every
destination), so every row of those buffers crosses the wire whatever the
routing. Here each device sorts its assignments by expert, which groups them
by destination (device j owns experts [j*L, (j+1)*L)), and
`jax.lax.ragged_all_to_all` moves just those rows:

1. One small all-to-all of int32 "headers": for each destination, the rows
   this device sends to each of its L experts and where they start in this
   device's sorted buffer (needed to address the way back).
2. `ragged_all_to_all` of the sorted rows. Source s writes into region
   [s*B, s*B + rows) of the receiver's buffer, so the senders' output
   offsets are known without exchanging receivers' prefix sums.
3. The local experts run on the received buffer (the existing `IMPLS`), each
   row's expert recovered from the header counts (rows arrive sorted by
   expert inside each source's region).
4. A second `ragged_all_to_all` writes each result back at the position its
   row held in the source's sorted buffer, and the source combines.

Static receive bound. Shapes must be static, so each source gets a region of
B = T * min(k, L) rows (T tokens per device, top-k, L = E/n local experts):
top-k picks k distinct experts, so one token sends at most min(k, L) rows to
one device. Capacity mode also caps it at L * capacity. Memory: the receive
and expert-output buffers hold n*B rows, the send and return buffers T*k.
The padded exchange holds n*T*k rows in each of its four buffers (E *
capacity in capacity mode), so in dropless mode this form never needs more
memory (with capacity_factor < 1 its T*k send buffer can exceed E *
capacity). Bytes on the wire: the padded form sends (n-1)*T*k rows per
device whatever the routing; this form sends only the routed rows that leave
the device, at most T*k (about (n-1)/n * T*k when balanced). The experts
still compute on the whole static receive buffer (empty rows are masked), as
in the padded form. `parallel.a2a_buffer_factor` > 0 bounds B as it bounds the
padded form's buffers (`buffer_slots`): each source first drops, as the padded
form does, the assignments past B rows for one destination, so no region
overflows and the receive and compute buffers hold n*B rows.

`ragged_all_to_all` takes a tuple of axis names; it runs over the intra
group `INTRA`, as the padded form does ('tensor' has size 1 for this
layout). XLA:CPU does not implement it, so this layout runs on GPU/TPU only;
the index arithmetic below is pure and tested on CPU. Gradients use JAX's
transpose rule for the op (present since jax 0.10): the backward pass is the
same exchange in reverse.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction
from functools import partial

import jax
import jax.numpy as jnp

from moe_jax.config import MoEConfig
from moe_jax.kernels.varying import varying_zeros
from moe_jax.moe import dispatch as dsp
from moe_jax.moe.dispatcher import Dispatched
from moe_jax.moe.routing import Routing
from moe_jax.parallel.expert_parallel import (
    EP_A2A,
    AllToAllDispatcher,
    buffer_bytes,
    buffer_slots,
    fit,
    padded_bytes,
    received_routing,
)
from moe_jax.parallel.fp8_exchange import indexed_token_collective
from moe_jax.parallel.layout import INTRA
from moe_jax.parallel.scopes import TOKEN_EXCHANGE
from moe_jax.parallel.spec import Sizes

NAME = "ep_a2a_ragged"  # the `parallel.experts` name this layout is registered under


def receive_bound(num_tokens: int, cfg: MoEConfig, local_experts: int, factor: float = 0.0) -> int:
    """Rows one source can send one destination: the size B of its receive region
    (bounded by `factor`, see `buffer_slots`)."""
    bound = num_tokens * min(cfg.top_k, local_experts)
    if not cfg.dropless:
        bound = min(bound, local_experts * cfg.capacity(num_tokens))
    return buffer_slots(bound, num_tokens, cfg, local_experts, factor)


def send_header(group_sizes: jax.Array, n: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """From rows per expert [E] of the sorted send buffer, what goes to each of n devices.

    Returns send_sizes [n], input_offsets [n] (where each destination's rows start)
    and the header [n, L + 1] sent to each destination: its experts' row counts,
    then the offset of its rows here.
    """
    counts = group_sizes.astype(jnp.int32).reshape(n, -1)
    sizes = counts.sum(1)
    offsets = jnp.cumsum(sizes) - sizes
    return sizes, offsets, jnp.concatenate([counts, offsets[:, None]], axis=1)


def received_experts(counts: jax.Array, bound: int) -> tuple[jax.Array, jax.Array]:
    """Local expert and presence of each row of a receive buffer [n * bound].

    `counts` [n, L]: rows source s sent to each local expert, sorted by expert
    and written from row s * bound. Rows past a source's count are empty
    (expert 0, absent).
    """
    ends = jnp.cumsum(counts, axis=1)  # [n, L]
    position = jnp.arange(bound, dtype=counts.dtype)
    expert = (position[None, :, None] >= ends[:, None, :]).sum(-1, dtype=jnp.int32).reshape(-1)
    present = expert < counts.shape[1]
    return jnp.where(present, expert, 0), present


def _ragged(rows, input_offsets, send_sizes, output_offsets, recv_sizes, *, out_rows: int):
    """`ragged_all_to_all` of `rows` over the intra group into a fresh zero buffer."""
    # `ragged_all_to_all`'s result takes its type from the buffer it writes into.
    output = varying_zeros((out_rows, *rows.shape[1:]), rows.dtype, rows)
    with jax.named_scope(TOKEN_EXCHANGE):
        return jax.lax.ragged_all_to_all(
            rows, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name=INTRA
        )


class RaggedAllToAllDispatcher(AllToAllDispatcher):
    """Only the routed rows cross the wire (`ragged_all_to_all`), there and back; with
    `parallel.token_dtype='fp8'` the dispatch sends them as E4M3 beside their scales,
    both with the same offsets and sizes."""

    def __init__(self, cfg, layout):
        super().__init__(cfg, layout)
        self.token_dtype = layout.token_dtype

    def dispatch(self, tokens: jax.Array, routing: Routing) -> Dispatched:
        n, local = self.n, self.local
        bound = receive_bound(tokens.shape[0], self.cfg, local, self.factor)
        _, routing = fit(routing, local, n, bound)  # at most `bound` rows per destination
        send = dsp.sorted_layout(routing, self.cfg.num_experts)  # by expert, so by destination
        sizes, offsets, header = send_header(send.group_sizes, n)
        with jax.named_scope(TOKEN_EXCHANGE):
            header = jax.lax.all_to_all(header, INTRA, 0, 0, tiled=True)  # row s: from s
        counts, their_offsets = header[:, :local], header[:, local]
        recv_sizes = counts.sum(1)
        mine = jnp.full(n, jax.lax.axis_index(INTRA) * bound, jnp.int32)
        move = indexed_token_collective(partial(_ragged, out_rows=n * bound), self.token_dtype)
        rows = move(dsp.dispatch(tokens, send), offsets, sizes, mine, recv_sizes)
        expert, present = received_experts(counts, bound)
        back = (send, routing, bound, recv_sizes, their_offsets, sizes)
        return Dispatched(rows, received_routing(expert[:, None], present[:, None]), state=back)

    def combine(self, out: jax.Array, sent: Dispatched) -> jax.Array:
        send, routing, bound, recv_sizes, their_offsets, sizes = sent.state
        regions = jnp.arange(self.n, dtype=jnp.int32) * bound  # source s wrote from s * bound
        rows = send.source.shape[0]
        back = _ragged(out, regions, recv_sizes, their_offsets, sizes, out_rows=rows)
        return dsp.combine(back, send, routing)


def _ragged_bytes(config, s: Sizes) -> Fraction:
    """Dropless, only the routed rows move: t·k per device (balanced routing), at most
    what the bounded buffers hold; with capacity the buffers are the bound."""
    padded = padded_bytes(config, s)
    routed = buffer_bytes(s, s.t * config.moe.top_k / s.n)
    return min(routed, padded) if config.moe.dropless else padded


EP_A2A_RAGGED = dataclasses.replace(
    EP_A2A,
    name=NAME,
    dispatcher=RaggedAllToAllDispatcher,
    platforms_without=("cpu",),
    platform_reason="does not implement ragged_all_to_all; use 'ep_a2a' on CPU",
    receive_slots=receive_bound,
    token_bytes=_ragged_bytes,
)
