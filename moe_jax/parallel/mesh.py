"""From the plan (`config.parallel`) to a device mesh, a `Layout`, and shardings.

One mesh with axes ('data', 'intra'): `data` data-parallel groups of `intra`
devices. Attention and the MoE block each map their tensors onto it their
own way (the layout); parameters are placed by logical-axis rules.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from moe_jax.config import Config
from moe_jax.parallel.expert_parallel import allgather_moe, alltoall_moe
from moe_jax.parallel.layout import Layout, local_attention
from moe_jax.parallel.ulysses import ulysses_attention

ATTENTION = {
    # name: (attention function, batch mesh axes, sequence mesh axes)
    "dp": (local_attention, ("data", "intra"), ()),
    "sp": (ulysses_attention, ("data",), ("intra",)),
}
EXPERTS = {"ep_ag": allgather_moe, "ep_a2a": alltoall_moe}
# Logical parameter axes -> mesh axes (everything else is replicated).
PARAM_RULES = {"experts": "intra"}


def expert_layout(config: Config) -> str:
    """`parallel.experts`, with `auto` decided by the paper's rule: the all-gather form
    once top-k is large relative to the group (ring collectives talk to neighbours
    only; the all-to-all's volume grows with k), the all-to-all form otherwise."""
    p = config.parallel
    if p.experts != "auto":
        return p.experts
    return "ep_ag" if config.moe.top_k / p.intra > p.ag_threshold else "ep_a2a"


def resolve(config: Config, num_devices: int) -> Config:
    """The plan made concrete: `parallel.data=0` becomes the devices left over by
    `intra`, and `parallel.experts='auto'` the layout the rule picks."""
    p = dataclasses.replace(config.parallel, experts=expert_layout(config))
    if not p.data:
        if num_devices % p.intra:
            raise ValueError(
                f"parallel.intra={p.intra} must divide the {num_devices} devices "
                "(or set parallel.data explicitly)"
            )
        p = dataclasses.replace(p, data=num_devices // p.intra)
    return dataclasses.replace(config, parallel=p)


def check_plan(config: Config, num_devices: int) -> None:
    """One-line errors for plans that cannot run, before anything is compiled."""
    config = resolve(config, num_devices)
    p, m, e, t = config.parallel, config.model, config.moe, config.train
    problems = [
        (
            p.data * p.intra == num_devices,
            f"parallel.data * parallel.intra = {p.data} * {p.intra} must equal the "
            f"{num_devices} devices",
        ),
        (
            e.num_experts % p.intra == 0,
            f"moe.num_experts={e.num_experts} must be divisible by parallel.intra={p.intra} "
            "(experts are split over the intra group)",
        ),
        (
            e.impl != "capacity" or p.intra == 1,
            "moe.impl='capacity' runs on one device only for now; use 'auto' with parallel.intra>1",
        ),
    ]
    batch_split = p.data * (p.intra if p.attention == "dp" else 1)
    problems.append(
        (
            t.batch_size % (batch_split * t.grad_accum) == 0,
            f"train.batch_size={t.batch_size} must be divisible by {batch_split * t.grad_accum} "
            f"(the batch split of parallel.attention={p.attention!r} times train.grad_accum)",
        )
    )
    if p.attention == "sp":
        kv = m.num_kv_heads
        problems += [
            (
                t.seq_len % p.intra == 0,
                f"train.seq_len={t.seq_len} must be divisible by parallel.intra={p.intra} "
                "for parallel.attention='sp'",
            ),
            (
                m.num_heads % p.intra == 0,
                f"model.num_heads={m.num_heads} must be divisible by parallel.intra={p.intra} "
                "for parallel.attention='sp'",
            ),
            (
                kv % p.intra == 0 or p.intra % kv == 0,
                f"model.num_kv_heads={kv} and parallel.intra={p.intra} must divide one another "
                "for parallel.attention='sp'",
            ),
        ]
    for ok, message in problems:
        if not ok:
            raise ValueError(message)


def make_mesh(config: Config, devices=None) -> Mesh:
    devices = np.asarray(devices if devices is not None else jax.devices())
    p = resolve(config, devices.size).parallel
    return Mesh(devices.reshape(p.data, p.intra), ("data", "intra"))


def make_layout(config: Config, mesh: Mesh) -> Layout:
    attention, batch_axes, seq_axes = ATTENTION[config.parallel.attention]
    return Layout(
        mesh=mesh,
        attention_fn=attention,
        moe_fn=EXPERTS[expert_layout(config)],
        batch_axes=batch_axes,
        seq_axes=seq_axes,
    )


def batch_sharding(layout: Layout) -> NamedSharding:
    """Token batches [batch, seq] as the attention layout splits them."""
    return NamedSharding(layout.mesh, P(layout.batch_axes or None, layout.seq_axes or None))


def state_shardings(state, mesh: Mesh):
    """Shardings for any tree holding model variables (params, optimizer moments, ...).

    A variable is placed by its logical axis names; anything else is replicated.
    """

    def spec(leaf):
        if isinstance(leaf, nnx.Variable):
            names = leaf.get_metadata().get("out_sharding") or ()
            mesh_axes = [PARAM_RULES.get(name) for name in names]
            return leaf.replace(NamedSharding(mesh, P(*mesh_axes)))
        return NamedSharding(mesh, P())

    return jax.tree.map(spec, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
