"""Expert parallelism inside the intra group: each device owns E/n whole experts.

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
experts on the tokens routed to them, and a reduce-scatter sums the experts'
partial outputs and returns each device its own tokens. Router statistics of
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
from moe_jax.moe.experts import ExpertWeights
from moe_jax.moe.losses import router_stats
from moe_jax.moe.routing import Routing, route

INTRA, DATA = "intra", "data"


def allgather_moe(layout, forward, x: jax.Array, params, cfg):
    """x [b, s, d] split over the mesh as the attention layout left it."""
    mesh = layout.mesh
    axis = 1 if INTRA in layout.seq_axes else 0  # where the intra group splits tokens
    x_spec, param_spec = _specs(layout, params)
    local_experts = params.experts.gate.shape[0] // mesh.shape[INTRA]

    def body(x, params):
        group = jax.lax.all_gather(x, INTRA, axis=axis, tiled=True)
        batch, seq, dim = group.shape
        first = jax.lax.axis_index(INTRA) * local_experts
        y, stats = forward(group.reshape(batch * seq, dim), params, cfg, batch, first)
        y = jax.lax.psum_scatter(y.reshape(group.shape), INTRA, scatter_dimension=axis, tiled=True)
        # Every intra device routed the same (gathered) tokens: they are copies.
        return y, stats.combine(batch_axes=(DATA,), copy_axes=(INTRA,))

    return jax.shard_map(body, mesh=mesh, in_specs=(x_spec, param_spec), out_specs=(x_spec, P()))(
        x, params
    )


def _specs(layout, params):
    x_spec = P(layout.batch_axes or None, layout.seq_axes or None, None)
    experts = P(INTRA, None, None)
    return x_spec, type(params)(P(), P(), ExpertWeights(experts, experts, experts))


def _exchange(rows: jax.Array) -> jax.Array:
    """Block j of `rows` goes to device j; block j of the result came from device j."""
    return jax.lax.all_to_all(rows, INTRA, split_axis=0, concat_axis=0, tiled=True)


def alltoall_moe(layout, forward, x: jax.Array, params, cfg):
    """x [b, s, d] split over the mesh as the attention layout left it."""
    del forward  # this layout composes route, exchange and expert compute itself
    mesh = layout.mesh
    n = mesh.shape[INTRA]
    local_experts = cfg.num_experts // n
    x_spec, param_spec = _specs(layout, params)
    compute_cfg = dataclasses.replace(cfg, num_experts=local_experts, capacity_factor=0.0)
    impl = expert_impls.IMPLS[expert_impls.resolve_impl(compute_cfg)]

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
        present = expert < local_experts
        received = Routing(
            expert_index=jnp.where(present, expert, 0),
            weights=present.astype(jnp.float32),
            keep=present,
            logits=jnp.zeros((rows.shape[0], 1), jnp.float32),
            probs=jnp.zeros((rows.shape[0], 1), jnp.float32),
        )
        results = _exchange(impl(rows, received, params.experts, compute_cfg))
        y = dsp.combine(results, layout_out, routing).reshape(x.shape)
        stats = router_stats(routing, batch)
        return y, stats.combine(batch_axes=layout.batch_axes, seq_axes=layout.seq_axes)

    return jax.shard_map(body, mesh=mesh, in_specs=(x_spec, param_spec), out_specs=(x_spec, P()))(
        x, params
    )
