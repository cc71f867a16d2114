"""Expert parallelism inside the intra group: the token dispatchers and their specs.

Experts are split over the mesh's 'expert' axis and each expert's width over
its 'tensor' axis: (n, 1) is plain expert parallelism (each device owns E/n
whole experts), (1, n) expert tensor parallelism (every device holds all
experts, 1/n of each one's width), anything between both. Every layout runs the
one MoE forward (`moe_jax.moe.block.moe_forward`) inside one `shard_map`
(`exchange_block`) with its own `TokenDispatcher`:

`AllToAllDispatcher` (`ep_a2a`) is the usual form: each device routes its own
tokens, sends each assignment to the device owning its expert (all-to-all),
the owners run their experts, and a second all-to-all brings the results back
to be combined. Buffers have static shapes: per destination, room for every
assignment of the device's tokens in dropless mode, or E/n experts times the
per-device capacity in capacity mode. Drops are decided per device, over the
tokens it holds, as in the paper. `parallel.a2a_buffer_factor` > 0 bounds each
buffer to that multiple of a balanced share (`buffer_slots`); what does not fit
is dropped like a capacity drop and counted in the router statistics.

`AllGatherDispatcher` (`ep_ag`, `etp`, `ep_etp`) is the paper's all-gather form:
every device all-gathers the group's tokens, routes them all (the router is
replicated, so every device reaches the same decisions), runs only its own
experts (or its slice of their width) on the tokens routed to them, and a
reduce-scatter sums the partial outputs and returns each device its own tokens.
Drops are decided per intra group, over the gathered tokens, with the capacity
of all E experts; each device computes its E/n experts' share of those slots.

`RingDispatcher` (`parallel.collective_matmul`) runs the all-gather form as the
paper's ring: n-1 point-to-point steps, each routing and computing one source's tokens
while the next source's travel, the partial outputs joining a travelling accumulator.
With `parallel.token_dtype='fp8'` every dispatch movement (all-to-all, all-gather, ring
step) sends E4M3 with scales (`moe_jax.parallel.fp8_exchange`); combines stay in the
model's dtype.

Router statistics of all devices are combined so that the losses equal those of
the whole batch on one device.
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from moe_jax.moe import dispatch as dsp
from moe_jax.moe import experts as expert_impls
from moe_jax.moe.dispatcher import Dispatched, TokenDispatcher
from moe_jax.moe.losses import RouterStats, merge_chunks
from moe_jax.moe.routing import Routing, restrict
from moe_jax.parallel import collective_matmul as cm
from moe_jax.parallel.fp8_exchange import token_collective, wire_bytes
from moe_jax.parallel.fsdp import gather_weights
from moe_jax.parallel.layout import DATA, EXPERT, INTRA
from moe_jax.parallel.scopes import ROUTER_STATS, TOKEN_EXCHANGE
from moe_jax.parallel.spec import ExpertSpec, Sizes


def block_specs(layout, params):
    """Specs of an expert block's (tokens, MoEParams) under `layout`."""
    experts = layout.weight_specs(expert_impls.AXES)
    return layout.activation_spec(), type(params)(P(), P(), experts)


def run_block(layout, body, x: jax.Array, params):
    """`body(x, params) -> (y, stats)` per device, tokens as the attention layout left them.
    Expert weights split over 'data' (`parallel.expert_fsdp`) are gathered first; the
    gather's transpose reduce-scatters their gradients."""
    x_spec, param_spec = block_specs(layout, params)

    def gathered(x, params):
        weights = gather_weights(layout, params.experts, expert_impls.AXES)
        return body(x, dataclasses.replace(params, experts=weights))

    return layout.block_map(gathered, (x_spec, param_spec), (x_spec, P()))(x, params)


def exchange_block(layout, forward, x: jax.Array, params, cfg):
    """The MoE forward with the layout's dispatcher, per device inside one `shard_map`."""
    spec = layout.expert_spec
    ring = layout.collective_matmul and spec.ring_dispatcher is not None
    dispatcher = (spec.ring_dispatcher if ring else spec.dispatcher)(cfg, layout)
    chunks = layout.overlap_chunks

    def body(x, params):
        return forward(x, params, cfg, dispatcher, chunks=chunks)

    return run_block(layout, body, x, params)


class AllGatherDispatcher(TokenDispatcher):
    """All-gather the group's tokens, compute the local experts, reduce-scatter."""

    def __init__(self, cfg, layout):
        super().__init__(cfg)
        self.axis = 1 if EXPERT in layout.seq_axes else 0  # where the intra group splits tokens
        self.local = cfg.num_experts // layout.size(EXPERT)
        gather = lambda x: jax.lax.all_gather(x, INTRA, axis=self.axis, tiled=True)
        self.plain_gather = gather
        self.all_gather = token_collective(gather, layout.token_dtype)
        self.compressed = layout.token_dtype != "native"

    def run(self, routed, x, logits_of):
        if not self.compressed:
            return super().run(routed, x, logits_of)
        with jax.named_scope(TOKEN_EXCHANGE):
            logits = self.plain_gather(logits_of(x))  # E floats a token, beside the payload
        y, stats, rows = routed(self.gather(x), logits)
        return self.scatter(y), self.reduce(stats), rows

    @property
    def compute_cfg(self):
        return dataclasses.replace(self.cfg, num_experts=self.local)

    def gather(self, x: jax.Array) -> jax.Array:
        with jax.named_scope(TOKEN_EXCHANGE):
            return self.all_gather(x)

    def dispatch(self, tokens: jax.Array, routing: Routing) -> Dispatched:
        first = jax.lax.axis_index(EXPERT) * self.local
        slots = None if self.cfg.dropless else self.cfg.capacity(tokens.shape[0])
        return Dispatched(tokens, restrict(routing, first, self.local), slots)

    def scatter(self, y: jax.Array) -> jax.Array:
        with jax.named_scope(TOKEN_EXCHANGE):
            return jax.lax.psum_scatter(y, INTRA, scatter_dimension=self.axis, tiled=True)

    def reduce(self, stats: RouterStats) -> RouterStats:
        with jax.named_scope(ROUTER_STATS):
            # Every intra device routed the same (gathered) tokens: they are copies.
            return stats.combine(batch_axes=(DATA,), copy_axes=INTRA)


class RingDispatcher(AllGatherDispatcher):
    """The all-gather form as the paper's ring (`parallel.collective_matmul`): at step i
    each device routes and runs its experts on the tokens of source (me - i) mod n while
    the next source's tokens travel, and each source's partial output joins a travelling
    accumulator that ends on the source (GEMM + reduce-scatter). Routing is per token, so
    each step's rows are one source's, contiguous inside each expert; the drops of
    capacity mode are decided over the whole group and are not defined per step."""

    def __init__(self, cfg, layout):
        super().__init__(cfg, layout)
        self.n = layout.size(INTRA)
        self.move = token_collective(lambda x: cm.shift(x, self.n), layout.token_dtype)

    def run(self, routed, x, logits_of):
        if self.compressed:  # the logits travel beside the compressed tokens
            move = lambda pair: (self.move(pair[0]), cm.shift(pair[1], self.n))
            steps = cm.ring_gather(lambda pair: routed(*pair), (x, logits_of(x)), self.n, move)
        else:
            steps = cm.ring_gather(routed, x, self.n)
        y = cm.ring_reduce_scatter(lambda j: steps[j][0], self.n)
        stats = merge_chunks([s for _, s, _ in steps])
        if self.axis == 0:  # the steps held different sequences: theirs, in source order
            sources = cm.ring_sources(self.n)
            place = lambda name: cm.place([getattr(s, name) for _, s, _ in steps], sources, 0)
            stats = dataclasses.replace(
                stats, seq_fraction=place("seq_fraction"), seq_prob=place("seq_prob")
            )
        return y, self.reduce(stats), steps[-1][2]


def exchange(rows: jax.Array) -> jax.Array:
    """Block j of `rows` goes to device j; block j of the result came from device j."""
    with jax.named_scope(TOKEN_EXCHANGE):
        return jax.lax.all_to_all(rows, INTRA, split_axis=0, concat_axis=0, tiled=True)


def received_routing(expert: jax.Array, present: jax.Array) -> Routing:
    """Routing of received rows [R, 1]: each row to its local expert, weight 1, empty
    rows absent."""
    rows = expert.shape[0]
    return Routing(
        expert_index=jnp.where(present, expert, 0),
        weights=present.astype(jnp.float32),
        keep=present,
        logits=jnp.zeros((rows, 1), jnp.float32),
        probs=jnp.zeros((rows, 1), jnp.float32),
    )


BUFFER_ALIGN = 8  # rows; bounded buffers are rounded up to this (sublane multiple)
Rows = int | Fraction  # exact in the dispatchers, fractional in the planning models


def buffer_slots(worst: Rows, tokens: Rows, cfg, local_experts: int, factor: float) -> Rows:
    """Rows of one per-destination buffer: `worst` (what can never overflow) when
    `factor` is 0, else `factor` times a balanced share T·k/n of the device's
    assignments, rounded up to `BUFFER_ALIGN` rows and never above `worst`. The one
    rule every all-to-all dispatcher and its models size their buffers by."""
    if not factor:
        return worst
    n = cfg.num_experts // local_experts
    share = math.ceil(factor * tokens * cfg.top_k / n)
    return min(worst, -(-share // BUFFER_ALIGN) * BUFFER_ALIGN)


def send_slots(tokens: Rows, cfg, local_experts: int, factor: float = 0.0) -> Rows:
    """Rows of the static buffer for each destination: every assignment of the device's
    tokens (dropless), or the destination's experts times the per-device capacity;
    bounded by `factor` (see `buffer_slots`)."""
    worst = tokens * cfg.top_k if cfg.dropless else local_experts * cfg.capacity(int(tokens))
    return buffer_slots(worst, tokens, cfg, local_experts, factor)


def fit(routing: Routing, local: int, n: int, slots: int) -> tuple[dsp.RowMap, Routing]:
    """Buffers of `slots` rows for each of `n` destinations (owners of `local` experts
    each) and the routing they deliver: an assignment past its destination's buffer
    is dropped like a capacity drop (weight 0, not kept, so the token keeps only its
    residual and the drop is counted), the best-weighted first, ties to the earlier
    token."""
    owner = dataclasses.replace(routing, expert_index=routing.expert_index // local)
    send = dsp.capacity_layout(owner, n, slots)
    kept = send.row < n * slots
    weights = jnp.where(kept, routing.weights, 0.0)
    return send, dataclasses.replace(routing, keep=kept, weights=weights)


class AllToAllDispatcher(TokenDispatcher):
    """Static per-destination buffers exchanged by all-to-all, there and back."""

    def __init__(self, cfg, layout):
        super().__init__(cfg)
        self.n = layout.size(INTRA)  # the mesh's 'tensor' axis has size 1 for this layout
        self.local = cfg.num_experts // self.n
        self.batch_axes, self.seq_axes = layout.batch_axes, layout.seq_axes
        self.factor = layout.a2a_buffer_factor
        self.send = token_collective(exchange, layout.token_dtype)  # the rows; ids stay int32

    @property
    def compute_cfg(self):
        """The owners compute dropless on what they receive (the senders dropped)."""
        return dataclasses.replace(self.cfg, num_experts=self.local, capacity_factor=0.0)

    def dispatch(self, tokens: jax.Array, routing: Routing) -> Dispatched:
        slots = send_slots(tokens.shape[0], self.cfg, self.local, self.factor)
        send, routing = fit(routing, self.local, self.n, slots)
        expert_of_row = jnp.full(self.n * slots, self.local, jnp.int32)
        expert_of_row = expert_of_row.at[send.row.reshape(-1)].set(
            (routing.expert_index % self.local).reshape(-1), mode="drop"
        )
        with jax.named_scope(TOKEN_EXCHANGE):
            rows = self.send(dsp.dispatch(tokens, send))
        expert = exchange(expert_of_row)[:, None]
        return Dispatched(
            rows, received_routing(expert, expert < self.local), state=(send, routing)
        )

    def delivered(self, routing: Routing, sent: Dispatched) -> Routing:
        return sent.state[1]  # `fit`'s routing (the ragged form keeps it there too)

    def combine(self, out: jax.Array, sent: Dispatched) -> jax.Array:
        send, routing = sent.state
        return dsp.combine(exchange(out), send, routing)

    def reduce(self, stats: RouterStats) -> RouterStats:
        with jax.named_scope(ROUTER_STATS):
            return stats.combine(self.batch_axes, self.seq_axes)


def _dispatch_bytes(config, s: Sizes) -> Fraction:
    """Bytes per element of the dispatch direction (`parallel.token_dtype`)."""
    return wire_bytes(s.h, config.parallel.token_dtype, s.B)


def gathered_bytes(config, s: Sizes) -> Fraction:
    """All-gather of the group's tokens in, reduce-scatter of the outputs: 2·T·h·B·(n-1)/n;
    with FP8 tokens the gather at 1 byte plus scales, and each token's E float32 router
    logits beside it."""
    gather = s.T * s.h * _dispatch_bytes(config, s) * s.f
    if config.parallel.token_dtype == "fp8":
        gather += s.T * config.moe.num_experts * 4 * s.f
    return gather + s.T * s.h * s.B * s.f


def buffer_bytes(s: Sizes, slots: Rows, dispatch: Fraction | None = None) -> Fraction:
    """n buffers of `slots` rows there (at `dispatch` bytes an element, default the
    model's) and back, and their int32 expert ids."""
    rows = s.n * slots
    there = s.B if dispatch is None else dispatch
    return s.f * rows * s.h * (there + s.B) + s.f * rows * 4


def padded_bytes(config, s: Sizes) -> Fraction:
    """The static buffers of `send_slots` rows (parallel.a2a_buffer_factor included)."""
    moe = config.moe
    local = moe.num_experts // s.n
    slots = send_slots(s.t, moe, local, config.parallel.a2a_buffer_factor)
    return buffer_bytes(s, slots, _dispatch_bytes(config, s))


def _a2a_paper(config, s: Sizes) -> Fraction:
    """Eq. 3 as written: 2k/n × b·s·h·(n-1)/n."""
    return 2 * config.moe.top_k * s.T * s.h * s.f / s.n * s.B


def _ep_etp_problems(config) -> list[str]:
    p = config.parallel
    if 1 < p.etp < p.intra and p.intra % p.etp == 0:
        return []
    return [
        f"parallel.etp={p.etp} must divide parallel.intra={p.intra} and lie strictly "
        "between 1 and it for parallel.experts='ep_etp' (use 'ep_*' or 'etp' otherwise)"
    ]


EP_AG = ExpertSpec(
    name="ep_ag",
    block=exchange_block,
    dispatcher=AllGatherDispatcher,
    ring_dispatcher=RingDispatcher,
    gathers_tokens=True,
    token_bytes=gathered_bytes,
    paper_bytes=gathered_bytes,
    paper_equation="Eq. 3 (all-gather)",
)
EP_A2A = ExpertSpec(
    name="ep_a2a",
    block=exchange_block,
    dispatcher=AllToAllDispatcher,
    receive_slots=send_slots,
    token_bytes=padded_bytes,
    paper_bytes=_a2a_paper,
    paper_equation="Eq. 3 (all-to-all)",
)
ETP = dataclasses.replace(
    EP_AG, name="etp", split=lambda parallel: (1, parallel.intra), paper_equation="Eq. 4"
)
EP_ETP = dataclasses.replace(
    EP_AG,
    name="ep_etp",
    split=lambda parallel: (parallel.intra // parallel.etp, parallel.etp),
    problems=_ep_etp_problems,
    uses_etp=True,
    etp_choices=lambda n: [s for s in (2, 4) if s < n and n % s == 0],
    paper_equation="Eq. 4",
)
