"""Expert parallelism inside the intra group: each device owns E/n whole experts.

`allgather_moe` is the paper's all-gather form of the token exchange: every
device all-gathers the group's tokens, routes them all (the router is
replicated, so every device reaches the same decisions), runs only its own
experts on the tokens routed to them, and a reduce-scatter sums the experts'
partial outputs and returns each device its own tokens. Router statistics of
the data-parallel groups are combined so that the losses equal those of the
whole batch on one device.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from moe_jax.moe.experts import ExpertWeights

INTRA, DATA = "intra", "data"


def allgather_moe(layout, forward, x: jax.Array, params, cfg):
    """x [b, s, d] split over the mesh as the attention layout left it."""
    mesh = layout.mesh
    axis = 1 if INTRA in layout.seq_axes else 0  # where the intra group splits tokens
    x_spec = P(layout.batch_axes or None, layout.seq_axes or None, None)
    experts = P(INTRA, None, None)
    param_spec = type(params)(P(), P(), ExpertWeights(experts, experts, experts))
    local_experts = params.experts.gate.shape[0] // mesh.shape[INTRA]

    def body(x, params):
        group = jax.lax.all_gather(x, INTRA, axis=axis, tiled=True)
        batch, seq, dim = group.shape
        first = jax.lax.axis_index(INTRA) * local_experts
        y, stats = forward(group.reshape(batch * seq, dim), params, cfg, batch, first)
        y = jax.lax.psum_scatter(y.reshape(group.shape), INTRA, scatter_dimension=axis, tiled=True)
        # Every intra device routed the same tokens: averaging over the group marks the
        # statistics as replicated and spreads their gradient evenly over the copies.
        stats = jax.tree.map(lambda a: jax.lax.pmean(a, INTRA), stats.combine(DATA))
        return y, stats

    return jax.shard_map(body, mesh=mesh, in_specs=(x_spec, param_spec), out_specs=(x_spec, P()))(
        x, params
    )
