"""What `train.optimizer=muon` adds to a plan's step (a part of
`moe_jax.plan.cost_model.CostModel`): Newton-Schulz on each device's share of whole
matrices, and the exchanges that move each Muon matrix there and back
(`moe_jax.parallel.muon_placement`), read off the same state arrays and placements as
the memory model.

Both run twice per step: `train_step.apply_gradients` computes the update once to check
the new parameters are finite and once more in the donated buffers (inside a
`lax.cond`), and XLA keeps both.
"""

from __future__ import annotations

import dataclasses
import functools
import math

from jax.sharding import PartitionSpec as P
from optax.contrib import MuonDimensionNumbers

from moe_jax import optimizer
from moe_jax.config import Config
from moe_jax.parallel import registry
from moe_jax.parallel.layout import DATA, STAGE, axes_of
from moe_jax.parallel.muon_placement import batch_dims, whole_matrix_moves
from moe_jax.plan import state_arrays
from moe_jax.plan.op_costs import collective_time

# apply_gradients's two computations of the update (the finiteness check, the update).
UPDATES_PER_STEP = 2
# Newton-Schulz's float32 working precision; the momentum is widened to it.
NS_ITEMSIZE = 4


@dataclasses.dataclass(frozen=True)
class MuonWork:
    """One device's Muon work per update: Newton-Schulz FLOPs, the exchanges' bytes
    sent, as (bytes, mesh axis) per collective, and the bytes of its blocks of whole
    matrices (float32, every Muon weight's)."""

    flops: float
    sent: tuple[tuple[float, str], ...]
    whole: float = 0.0


def newton_schulz_flops(m: int, n: int, steps: int) -> float:
    """FLOPs of `steps` quintic iterations on one m x n matrix (m <= n after optax's
    transpose): A = X X^T (2 m^2 n), A A (2 m^3), (b A + c A A) X (2 m^2 n)."""
    m, n = sorted((m, n))
    return steps * (4 * m * m * n + 2 * m**3)


def exchange_sent(
    sizes: dict[str, int], spec, shape: tuple[int, ...], batch: int, itemsize: int = NS_ITEMSIZE
) -> list[tuple[float, str]]:
    """(bytes one device sends, mesh axis) of each collective that moves one matrix's
    momentum to its whole-matrix placement and its update back, per update, by
    `hlo_collectives`' convention: an all-to-all S (g-1)/g of its operand, an
    all-gather S (g-1)/g of its result (the way back of a gather is a slice)."""
    _, moves = whole_matrix_moves(sizes, P(*spec), shape, batch)
    local = itemsize * math.prod(
        dim // math.prod(sizes[a] for a in axes_of(entry))
        for dim, entry in zip(shape, (*spec, *[None] * (len(shape) - len(spec))), strict=True)
    )
    out = []
    for move in moves:
        g = sizes[move.axis]
        if move.stack is None:
            local *= g
        out.append((local * (g - 1) / g, move.axis))
    out += [
        (sent, axis)
        for (sent, axis), move in zip(out, moves, strict=True)
        if move.stack is not None
    ]
    return out


def muon_work(config: Config) -> MuonWork:
    """One device's Newton-Schulz FLOPs and exchanges per update under `config`'s
    placement (none under AdamW): each Muon matrix's stack of matrices divided as its
    whole-matrix placement divides it (an axis that divides no stacking dimension
    leaves each of its devices all the matrices)."""
    return _muon_work(state_arrays.placement_key(config))


@functools.lru_cache(maxsize=1024)
def _muon_work(config: Config) -> MuonWork:
    if config.train.optimizer != "muon":
        return MuonWork(0.0, ())
    sizes = state_arrays.mesh_sizes(config)
    flops, sent, whole_bytes = 0.0, [], 0.0
    for array in state_arrays.state_arrays(config):
        axes = optimizer.MUON_MATRICES.get(state_arrays.param_name(array))
        if array.part != "params" or axes is None or len(array.shape) < 2:
            continue
        shape, reduction = array.shape, axes[0]
        batch = batch_dims(shape, MuonDimensionNumbers(*axes))
        spec = state_arrays.placement(config, array)
        whole, _ = whole_matrix_moves(sizes, P(*spec), shape, batch)
        stack = math.prod(shape[:batch]) // math.prod(
            sizes[a] for entry in whole[:batch] for a in axes_of(entry)
        )
        fan_in = math.prod(shape[a] for a in reduction)
        matrix = newton_schulz_flops(fan_in, math.prod(shape[batch:]) // fan_in, optimizer.NS_STEPS)
        flops += stack * matrix
        whole_bytes += NS_ITEMSIZE * stack * math.prod(shape[batch:])
        sent += exchange_sent(sizes, spec, shape, batch)
    return MuonWork(flops, tuple(sent), whole_bytes)


def update_bytes(config: Config) -> float:
    """XLA's temporaries for the step's updates under Muon, per device: (NS_STEPS + 3)
    blocks of whole matrices for every Muon weight, as read off the compiled
    `apply_gradients` (XLA:CPU, tiny Mixtral shapes under tp+etp, tp+ep_etp,
    fsdp+ep_ag with expert_fsdp and sp+ep_a2a with ZeRO-2: 7.9 to 8.6 blocks at 5
    steps; 4.0 to 4.1 at 1 under tp+etp, where one update alone keeps NS_STEPS + 2): the weights'
    Newton-Schulz iterations are scheduled side by side, each iteration's result a
    block of its own. Held after the backward has freed the activations."""
    return (optimizer.NS_STEPS + 3) * muon_work(config).whole


def exchange_bytes_per_step(config: Config) -> float:
    """Bytes one device sends per step in Muon's exchanges (`comm_report`'s row)."""
    return UPDATES_PER_STEP * sum(sent for sent, _ in muon_work(config).sent)


def moments_per_param(config: Config) -> float:
    """Optimizer moment elements per parameter element of the whole model: AdamW's 2;
    under Muon 1 for its matrices and 2 for the rest."""
    if config.train.optimizer != "muon":
        return 2.0  # not traced: the planner ranks AdamW plans of models never built
    return _moments_per_param(state_arrays.placement_key(config))


@functools.lru_cache(maxsize=1024)
def _moments_per_param(config: Config) -> float:
    arrays = state_arrays.state_arrays(config)
    params = sum(math.prod(a.shape) for a in arrays if a.part == "params")
    moments = sum(math.prod(a.shape) for a in arrays if a.moment and len(a.shape) >= 1)
    return moments / params


class MuonCost:
    """Muon's Newton-Schulz and exchanges (a part of `CostModel`)."""

    def muon_s(self) -> dict[str, float]:
        """The step breakdown's Muon keys ("newton_schulz", "muon_exchange"); none
        under AdamW."""
        if self.sized.train.optimizer != "muon":
            return {}
        return {"newton_schulz": self.newton_schulz_s(), "muon_exchange": self.muon_exchange_s()}

    def newton_schulz_s(self) -> float:
        """Newton-Schulz per step on one device, at the dense GEMM rate (float32 matmuls
        on the GPU's TF32 or BF16 path; the efficiency is `Efficiency.gemm`'s)."""
        flops = UPDATES_PER_STEP * muon_work(self.sized).flops
        return flops / (self.gpu.peak_flops * self.eff.gemm)

    def muon_exchange_s(self) -> float:
        """The exchanges to and from the whole-matrix placement per step, each over the
        link its mesh axis crosses ('data' between nodes where the plan spans them,
        'stage' likewise, the intra axes over NVLink)."""
        sizes = registry.mesh_sizes(self.sized)
        links = {DATA: self.data_link, STAGE: self.stage_link}
        total = sum(
            collective_time(sent, sizes[axis], links.get(axis, self.intra))
            for sent, axis in muon_work(self.sized).sent
        )
        return UPDATES_PER_STEP * total
