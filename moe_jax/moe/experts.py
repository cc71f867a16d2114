"""Expert compute: E SwiGLU experts applied to routed tokens, one function per `moe.impl`.

Every implementation maps (tokens [T, d], routing, weights) to the combined
expert output [T, d]; they differ only in how rows reach their expert's
weights. `dense` is the per-expert reference (every expert on every token,
masked), kept for tests and tiny debugging runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp

from moe_jax.config import MoEConfig
from moe_jax.kernels.grouped_matmul import ragged_gmm, tiled_gmm
from moe_jax.kernels.routed_gmm import gather_gmm, gmm_scatter
from moe_jax.kernels.tokamax_gmm import tokamax_gmm
from moe_jax.model import remat
from moe_jax.model.layers import cast_like
from moe_jax.moe import dispatch as dsp
from moe_jax.moe.routing import Routing


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ExpertWeights:
    gate: jax.Array  # [E, d, f]
    up: jax.Array  # [E, d, f]
    down: jax.Array  # [E, f, d]


AXES = ExpertWeights(
    gate=("experts", "embed", "expert_mlp"),
    up=("experts", "embed", "expert_mlp"),
    down=("experts", "expert_mlp", "embed"),
)

Gmm = Callable[[jax.Array, jax.Array], jax.Array]


def _swiglu(x: jax.Array, w: ExpertWeights, gmm: Gmm) -> jax.Array:
    """fc2(SiLU(fc1(x)) * fc3(x)); the projections' outputs are named for selective
    recomputation, which rebuilds the product from them."""
    gate, up = remat.tag((gmm(x, w.gate), gmm(x, w.up)), remat.FC1_FC3)
    return remat.tag(gmm(jax.nn.silu(gate) * up, w.down), remat.FC2)


def _sorted(
    x: jax.Array,
    routing: Routing,
    w: ExpertWeights,
    cfg: MoEConfig,
    grouped,
    tile: int = 1,
    capacity: int | None = None,
):
    """Dispatch into rows sorted by expert (groups padded to `tile`, at most `capacity`
    rows each), the SwiGLU with `grouped(rows, weight, group_sizes)` as its matmul,
    combine."""
    rows = dsp.sorted_layout(routing, cfg.num_experts, tile, capacity)
    gmm = lambda r, weight: grouped(r, weight, rows.group_sizes)
    return dsp.combine(_swiglu(dsp.dispatch(x, rows), w, gmm), rows, routing)


def tiled(
    x: jax.Array, routing: Routing, w: ExpertWeights, cfg: MoEConfig, capacity: int | None = None
) -> jax.Array:
    """Sorted, tile-padded rows, each group multiplied in runs of whole tiles (CPU)."""
    tile = cfg.tile(x.shape[0])
    return _sorted(x, routing, w, cfg, partial(tiled_gmm, tile=tile), tile, capacity)


def ragged_dot(
    x: jax.Array, routing: Routing, w: ExpertWeights, cfg: MoEConfig, capacity: int | None = None
) -> jax.Array:
    """Sorted rows and XLA's `ragged_dot` (the GPU/TPU path)."""
    return _sorted(x, routing, w, cfg, ragged_gmm, capacity=capacity)


def tokamax(x: jax.Array, routing: Routing, w: ExpertWeights, cfg: MoEConfig) -> jax.Array:
    """Sorted rows and the optional tokamax package's `ragged_dot` (its GPU kernels;
    XLA's ragged_dot where it has none): `moe_jax.kernels.tokamax_gmm`."""
    return _sorted(x, routing, w, cfg, tokamax_gmm)


def pallas(x: jax.Array, routing: Routing, w: ExpertWeights, cfg: MoEConfig) -> jax.Array:
    """The Pallas grouped GEMM with dispatch fused into the up-projections' prologue
    and the weighted combine into the down-projection's epilogue (GPU; interpreted,
    slowly, on CPU)."""
    rows = dsp.sorted_layout(routing, cfg.num_experts)
    token, sizes = rows.source, rows.group_sizes
    gmm = lambda weight: gather_gmm(x, weight, token, sizes)
    gate, up = remat.tag((gmm(w.gate), gmm(w.up)), remat.FC1_FC3)
    weight = dsp.row_weights(rows, routing).astype(x.dtype)
    out = gmm_scatter(jax.nn.silu(gate) * up, w.down, token, weight, sizes, x.shape[0])
    return remat.tag(out, remat.FC2)


def capacity(
    x: jax.Array, routing: Routing, w: ExpertWeights, cfg: MoEConfig, slots: int | None = None
) -> jax.Array:
    """Capacity mode: at most C kept assignments per expert (routing dropped the rest),
    C being `cfg.capacity` of these tokens, or `slots` when the drops were decided over
    more experts than the `cfg.num_experts` computed here (an expert-parallel group).
    The kept rows, sorted by expert in a buffer no larger than [E, C] buckets, go
    through the platform's grouped kernel (`tiled` on CPU, `ragged_dot` elsewhere), so
    only kept rows are multiplied: the capacity factor bounds buffers and drops tokens
    without adding the padded buckets' FLOPs."""
    kernel = tiled if capacity_kernel() == "tiled" else ragged_dot
    return kernel(x, routing, w, cfg, capacity=slots or cfg.capacity(x.shape[0]))


def dense(x: jax.Array, routing: Routing, w: ExpertWeights, cfg: MoEConfig) -> jax.Array:
    """Reference: every expert on every token, weighted by its (possibly zero) gate."""
    out = jnp.zeros(x.shape, jnp.float32)
    for e in range(cfg.num_experts):
        gate = jnp.sum(jnp.where(routing.expert_index == e, routing.weights, 0.0), axis=-1)
        y = _swiglu(x, jax.tree.map(lambda a, e=e: a[e], w), jnp.matmul)
        out = out + gate[:, None] * y.astype(jnp.float32)
    return out.astype(x.dtype)


IMPLS = {
    "tiled": tiled,
    "ragged_dot": ragged_dot,
    "pallas": pallas,
    "tokamax": tokamax,
    "capacity": capacity,
    "dense": dense,
}


def compute(
    x: jax.Array, routing: Routing, w: ExpertWeights, cfg: MoEConfig, slots: int | None = None
) -> jax.Array:
    """The expert output of `moe.impl` (weights cast to the rows' dtype here, inside any
    layout, so that their gradients are reduced as stored: float32). `slots`: see
    `capacity`; the dropless implementations need none."""
    w = cast_like(w, x)
    name = resolve_impl(cfg)
    if slots is not None and name == "capacity":
        return capacity(x, routing, w, cfg, slots)
    return IMPLS[name](x, routing, w, cfg)


def capacity_kernel(platform: str | None = None) -> str:
    """The grouped kernel that multiplies capacity mode's kept rows on `platform`."""
    return "tiled" if (platform or jax.default_backend()) == "cpu" else "ragged_dot"


def kernel_of(cfg: MoEConfig, platform: str | None = None) -> str:
    """The kernel that multiplies the rows: `resolve_impl`'s, with capacity mode's
    grouped kernel for `capacity` (what the memory model sizes)."""
    impl = resolve_impl(cfg, platform)
    return capacity_kernel(platform) if impl == "capacity" else impl


def resolve_impl(cfg: MoEConfig, platform: str | None = None) -> str:
    """The implementation `moe.impl` names, with `auto` chosen per platform and mode."""
    if cfg.impl != "auto":
        return cfg.impl
    if not cfg.dropless:
        return "capacity"
    return capacity_kernel(platform)  # the same per-platform kernel as capacity mode
