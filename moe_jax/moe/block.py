"""The MoE feed-forward block: route -> dispatch -> expert compute -> combine.

Each step is a replaceable function (`routing.route`, `experts.IMPLS[...]`,
which use `dispatch`); `moe_forward` wires them once for every layout, and the
block's `Layout` decides where it runs and with which token dispatcher (one
device, or inside an expert-parallel exchange in `moe_jax.parallel`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from moe_jax.config import MoEConfig
from moe_jax.model import remat
from moe_jax.model.axes import param
from moe_jax.model.layers import MLP
from moe_jax.moe import experts, losses
from moe_jax.moe.dispatcher import TokenDispatcher
from moe_jax.moe.routing import route, router_logits
from moe_jax.parallel.layout import SINGLE_DEVICE, Layout
from moe_jax.parallel.scopes import chunk_scope


class RouterBias(nnx.Variable):
    """Aux-loss-free balancing bias: steers selection, updated outside the optimizer."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MoEStats:
    """What one MoE layer reports; stacked over layers by the model's scan."""

    aux_loss: jax.Array
    seq_aux_loss: jax.Array
    z_loss: jax.Array
    load: jax.Array  # [E] assignments per expert, before drops
    dropped_fraction: jax.Array

    def max_over_mean(self) -> jax.Array:
        """Load of the busiest expert over the mean load (1.0 = perfectly balanced)."""
        return self.load.max(-1) / jnp.maximum(self.load.mean(-1), 1e-9)

    def loss(self, cfg: MoEConfig) -> jax.Array:
        """The loss's MoE terms: the aux, sequence-aux and z losses summed over the
        layers, each times its coefficient (linear in the statistics)."""
        return (
            cfg.aux_loss_coef * self.aux_loss.sum()
            + cfg.seq_aux_loss_coef * self.seq_aux_loss.sum()
            + cfg.z_loss_coef * self.z_loss.sum()
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MoEParams:
    router: jax.Array  # [d, E]
    bias: jax.Array  # [E]
    experts: experts.ExpertWeights  # [E_local, ...]: this device's experts, float32


def moe_forward(
    x: jax.Array,
    params: MoEParams,
    cfg: MoEConfig,
    dispatcher: TokenDispatcher,
    chunks: int = 1,
) -> tuple[jax.Array, losses.RouterStats]:
    """Routed experts for `x` [b, s, d] (whole sequences, or this device's part of them),
    the same for every layout: `dispatcher` moves the tokens (see
    `moe_jax.moe.dispatcher`). Returns the output like `x` and the router statistics
    of the whole batch.

    With `chunks` > 1 (`parallel.overlap_chunks`) the tokens run as that many
    independent chunks along the sequence, each routed, exchanged, computed and
    combined on its own, so that the scheduler can run one chunk's exchanges while
    another computes (inter-operator overlap). A barrier ties each chunk's first
    exchange to the previous chunk's delivered rows: the exchanges keep their order
    and are never merged back into one, while each chunk's compute stays free to
    overlap the next chunk's exchange."""
    if chunks == 1:
        y, stats, _ = _chunk(x, params, cfg, dispatcher)
        return y, stats
    outs, previous = [], None
    for c, part in enumerate(jnp.split(x, chunks, axis=1)):
        with jax.named_scope(chunk_scope(c)):  # names each chunk's ops in the program
            if previous is not None:
                part, _ = jax.lax.optimization_barrier((part, previous))
            y, stats, previous = _chunk(part, params, cfg, dispatcher)
        outs.append((y, stats))
    y = jnp.concatenate([y for y, _ in outs], axis=1)
    return y, losses.merge_chunks([stats for _, stats in outs])


def _chunk(x, params: MoEParams, cfg: MoEConfig, dispatcher: TokenDispatcher):
    """(y, router statistics, the rows dispatch delivered) for the tokens of `x`."""

    def routed(group: jax.Array, logits: jax.Array | None = None):
        batch, seq, dim = group.shape
        tokens = group.reshape(batch * seq, dim)
        logits = None if logits is None else logits.reshape(batch * seq, -1)
        routing = route(tokens, params.router, params.bias, cfg, logits)
        sent = dispatcher.dispatch(tokens, routing)
        rows = remat.tag(sent.rows, remat.EXPERT_ROWS)
        cfg_here = dispatcher.compute_cfg
        out = experts.compute(rows, sent.routing, params.experts, cfg_here, sent.slots)
        y = dispatcher.combine(out, sent).reshape(group.shape)
        stats = losses.router_stats(dispatcher.delivered(routing, sent), batch)
        return y, stats, sent.rows

    return dispatcher.run(routed, x, lambda x: router_logits(x, params.router))


class MoE(nnx.Module):
    """E routed SwiGLU experts (+ optional always-on shared experts)."""

    def __init__(self, dim: int, cfg: MoEConfig, *, rngs: nnx.Rngs, layout: Layout = SINGLE_DEVICE):
        e, f = cfg.num_experts, cfg.expert_mlp_dim
        self.cfg = cfg
        self.layout = layout
        self.router = param(rngs, (dim, e), ("embed", None))
        self.bias = RouterBias(jnp.zeros((e,), jnp.float32))
        self.gate = param(rngs, (e, dim, f), experts.AXES.gate, fan_in=dim)
        self.up = param(rngs, (e, dim, f), experts.AXES.up, fan_in=dim)
        self.down = param(rngs, (e, f, dim), experts.AXES.down, fan_in=f)
        shared = cfg.num_shared_experts * cfg.shared_mlp_dim
        gated = cfg.shared_expert_gate
        self.shared = (
            MLP(dim, shared, rngs=rngs, layout=layout, output_gate=gated) if shared else None
        )

    def __call__(self, x: jax.Array) -> tuple[jax.Array, MoEStats]:
        weights = experts.ExpertWeights(self.gate[...], self.up[...], self.down[...])
        params = MoEParams(self.router[...], self.bias[...], weights)  # float32, as stored
        y, router_stats = self.layout.moe(moe_forward, x, params, self.cfg)
        if self.shared is not None:
            y = y + self.shared(x)
        stats = MoEStats(
            aux_loss=router_stats.aux_loss(),
            seq_aux_loss=router_stats.seq_aux_loss(),
            z_loss=router_stats.z_loss,
            load=router_stats.load.astype(jnp.float32),
            dropped_fraction=router_stats.dropped_fraction,
        )
        return y, stats
