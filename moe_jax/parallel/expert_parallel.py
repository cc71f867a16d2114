"""Expert parallelism inside the intra group.

Experts are split over the mesh's 'expert' axis and each expert's width over
its 'tensor' axis: (n, 1) is plain expert parallelism (each device owns E/n
whole experts), (1, n) expert tensor parallelism (every device holds all
experts, 1/n of each one's width), anything between both.

`alltoall_moe` is the usual form: each device routes its own tokens, sends
each assignment to the device owning its expert (all-to-all), the owners run
their experts, and a second all-to-all brings the results back to be
combined. Buffers have static shapes: per destination, room for every
assignment of the device's tokens in dropless mode, or E/n experts times the
per-device capacity in capacity mode (drops are decided per device, as in the
paper).

`allgather_moe` is the paper's all-gather form of the token exchange: every
device all-gathers the group's tokens, routes them all (the router is
replicated, so every device reaches the same decisions), runs only its own
experts (or its slice of their width) on the tokens routed to them, and a
reduce-scatter sums the partial outputs and returns each device its own
tokens. It serves `ep_ag`, `etp` and `ep_etp` alike. Router statistics of
the data-parallel groups are combined so that the losses equal those of the
whole batch on one device.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from moe_jax.moe import dispatch as dsp
from moe_jax.moe import experts as expert_impls
from moe_jax.moe.losses import router_stats
from moe_jax.moe.routing import Routing, route
from moe_jax.parallel.layout import DATA, EXPERT, INTRA, ROUTER_STATS, TOKEN_EXCHANGE


def allgather_moe(layout, forward, x: jax.Array, params, cfg):
    """x [b, s, d] split over the mesh as the attention layout left it."""
    axis = 1 if EXPERT in layout.seq_axes else 0  # where the intra group splits tokens
    local_experts = params.experts.gate.shape[0] // layout.size(EXPERT)

    def body(x, params):
        with jax.named_scope(TOKEN_EXCHANGE):
            group = jax.lax.all_gather(x, INTRA, axis=axis, tiled=True)
        batch, seq, dim = group.shape
        first = jax.lax.axis_index(EXPERT) * local_experts
        y, stats = forward(group.reshape(batch * seq, dim), params, cfg, batch, first)
        with jax.named_scope(TOKEN_EXCHANGE):
            y = jax.lax.psum_scatter(
                y.reshape(group.shape), INTRA, scatter_dimension=axis, tiled=True
            )
        with jax.named_scope(ROUTER_STATS):
            # Every intra device routed the same (gathered) tokens: they are copies.
            stats = stats.combine(batch_axes=(DATA,), copy_axes=INTRA)
        return y, stats

    return run_block(layout, body, x, params)


def block_specs(layout, params):
    """Specs of an expert block's (tokens, MoEParams) under `layout`."""
    experts = layout.weight_specs(expert_impls.AXES)
    return layout.activation_spec(), type(params)(P(), P(), experts)


def _exchange(rows: jax.Array) -> jax.Array:
    """Block j of `rows` goes to device j; block j of the result came from device j."""
    with jax.named_scope(TOKEN_EXCHANGE):
        return jax.lax.all_to_all(rows, INTRA, split_axis=0, concat_axis=0, tiled=True)


def local_compute(cfg, n: int):
    """(experts per device, their config, the expert impl) of an all-to-all layout: the
    owners compute dropless on what they receive (drops were decided by the senders)."""
    local_experts = cfg.num_experts // n
    compute_cfg = dataclasses.replace(cfg, num_experts=local_experts, capacity_factor=0.0)
    return local_experts, compute_cfg, expert_impls.IMPLS[expert_impls.resolve_impl(compute_cfg)]


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


def run_block(layout, body, x: jax.Array, params):
    """`body(x, params) -> (y, stats)` per device, tokens as the attention layout left them."""
    x_spec, param_spec = block_specs(layout, params)
    return jax.shard_map(
        body, mesh=layout.mesh, in_specs=(x_spec, param_spec), out_specs=(x_spec, P())
    )(x, params)


def alltoall_moe(layout, forward, x: jax.Array, params, cfg):
    """x [b, s, d] split over the mesh as the attention layout left it."""
    del forward  # this layout composes route, exchange and expert compute itself
    n = layout.size(INTRA)  # the mesh's 'tensor' axis has size 1 for this layout
    local_experts, compute_cfg, impl = local_compute(cfg, n)

    def body(x, params):
        batch, seq, dim = x.shape
        tokens = x.reshape(batch * seq, dim)
        routing = route(tokens, params.router, params.bias, cfg)
        if cfg.dropless:
            slots = tokens.shape[0] * cfg.top_k
        else:
            slots = local_experts * cfg.capacity(tokens.shape[0])
        owner = dataclasses.replace(routing, expert_index=routing.expert_index // local_experts)
        layout_out = dsp.capacity_layout(owner, n, slots)
        expert_of_row = jnp.full(n * slots, local_experts, jnp.int32)
        expert_of_row = expert_of_row.at[layout_out.row.reshape(-1)].set(
            (routing.expert_index % local_experts).reshape(-1), mode="drop"
        )
        rows = _exchange(dsp.dispatch(tokens, layout_out))
        expert = _exchange(expert_of_row)[:, None]
        received = received_routing(expert, expert < local_experts)
        results = _exchange(impl(rows, received, params.experts, compute_cfg))
        y = dsp.combine(results, layout_out, routing).reshape(x.shape)
        with jax.named_scope(ROUTER_STATS):
            stats = router_stats(routing, batch).combine(layout.batch_axes, layout.seq_axes)
        return y, stats

    return run_block(layout, body, x, params)
