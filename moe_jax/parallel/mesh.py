"""From the plan (`config.parallel`) to a device mesh, a `Layout`, and shardings.

One mesh with axes ('data', 'expert', 'tensor'): `data` data-parallel groups
of an intra group of n = expert * tensor devices. Attention and dense blocks
use the intra group as one axis; expert blocks split experts over 'expert'
and expert width over 'tensor'. Parameters are placed by logical-axis rules
that come with the layout.
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
from moe_jax.parallel.fsdp import fsdp_attention, fsdp_mlp
from moe_jax.parallel.layout import (
    DATA,
    EXPERT,
    INTRA,
    MESH_AXES,
    TENSOR,
    Layout,
    local_attention_block,
    local_mlp,
)
from moe_jax.parallel.ragged_exchange import ragged_alltoall_moe
from moe_jax.parallel.tensor_parallel import tp_attention, tp_mlp
from moe_jax.parallel.ulysses import ulysses_attention
from moe_jax.plan import hardware

ALL = (DATA, *INTRA)
ATTENTION = {
    # name: (attention block, dense MLP block, batch mesh axes, sequence mesh axes)
    "dp": (local_attention_block, local_mlp, ALL, ()),
    "fsdp": (fsdp_attention, fsdp_mlp, ALL, ()),
    "tp": (tp_attention, tp_mlp, (DATA,), INTRA),
    "sp": (ulysses_attention, local_mlp, (DATA,), INTRA),
}
EXPERTS = {
    # name: expert block; the mesh's (expert, tensor) split comes from `expert_split`
    "ep_ag": allgather_moe,
    "ep_a2a": alltoall_moe,
    "ep_a2a_ragged": ragged_alltoall_moe,  # GPU only: XLA:CPU lacks ragged_all_to_all
    "etp": allgather_moe,
    "ep_etp": allgather_moe,
}
# Expert weights are always placed this way; the mesh shape decides the split.
EXPERT_RULES = (("experts", EXPERT), ("expert_mlp", TENSOR))


def expert_layout(config: Config) -> str:
    """`parallel.experts`, with `auto` decided by the paper's rule: the all-gather form
    once top-k is large relative to the group (ring collectives talk to neighbours
    only; the all-to-all's volume grows with k), the all-to-all form otherwise."""
    p = config.parallel
    if p.experts != "auto":
        return p.experts
    return "ep_ag" if config.moe.top_k / p.intra > p.ag_threshold else "ep_a2a"


def _planner_gpu(config: Config) -> str:
    """`parallel.gpu`, else the preset named in this device's kind, else H800."""
    if config.parallel.gpu:
        return config.parallel.gpu
    kind = jax.devices()[0].device_kind.lower()
    # Longest names first: an "H200" must not read as "h20".
    for name in sorted(hardware.GPUS, key=len, reverse=True):
        if name in kind:
            return name
    return "h800"


def resolve(config: Config, num_devices: int) -> Config:
    """The plan made concrete: `parallel.layout='auto'` becomes the planner's choice for
    these devices, `parallel.data=0` the devices left over by `intra`, and
    `parallel.experts='auto'` the layout the paper's rule picks."""
    if config.parallel.layout == "auto":
        from moe_jax.plan.planner import choose_plan  # the planner imports this module

        manual = dataclasses.replace(config.parallel, layout="manual")
        config = dataclasses.replace(config, parallel=manual)
        chosen = choose_plan(config, num_devices, _planner_gpu(config))
        config = dataclasses.replace(config, parallel=dataclasses.replace(manual, **chosen))
    p = dataclasses.replace(config.parallel, experts=expert_layout(config))
    if not p.data:
        if num_devices % p.intra:
            raise ValueError(
                f"parallel.intra={p.intra} must divide the {num_devices} devices "
                "(or set parallel.data explicitly)"
            )
        p = dataclasses.replace(p, data=num_devices // p.intra)
    return dataclasses.replace(config, parallel=p)


def expert_split(config: Config) -> tuple[int, int]:
    """(expert, tensor) sizes of the intra group for the resolved expert layout."""
    p = config.parallel
    return {
        "ep_ag": (p.intra, 1),
        "ep_a2a": (p.intra, 1),
        "ep_a2a_ragged": (p.intra, 1),
        "etp": (1, p.intra),
        "ep_etp": (p.intra // p.etp, p.etp),
    }[expert_layout(config)]


def _dense_widths(config: Config) -> dict[str, int]:
    """Hidden widths of the dense MLPs the model has (split by tp and fsdp)."""
    m, e = config.model, config.moe
    widths = {}
    if m.first_k_dense or m.moe_every > 1 or not m.num_moe_layers:
        widths["model.mlp_dim"] = m.mlp_dim
    if e.num_shared_experts:
        widths["moe.num_shared_experts * moe.shared_mlp_dim"] = (
            e.num_shared_experts * e.shared_mlp_dim
        )
    return widths


def _split_heads_problems(config: Config, size: int, what: str, splits_sequence: bool):
    """Heads split `size` ways (and the sequence too, unless the batch carries the split).

    Fewer kv heads than devices works when the sequence is split (each device
    takes, or receives, the kv head its query heads use), not for weight shards.
    """
    m, t = config.model, config.train
    kv = m.num_kv_heads
    problems = [
        (m.num_heads % size == 0, f"model.num_heads={m.num_heads} must be divisible by {what}")
    ]
    if splits_sequence:
        problems += [
            (t.seq_len % size == 0, f"train.seq_len={t.seq_len} must be divisible by {what}"),
            (
                kv % size == 0 or size % kv == 0,
                f"model.num_kv_heads={kv} and {what} must divide one another",
            ),
        ]
    else:
        problems.append((kv % size == 0, f"model.num_kv_heads={kv} must be divisible by {what}"))
    return problems


def check_plan(config: Config, num_devices: int) -> None:
    """One-line errors for plans that cannot run, before anything is compiled."""
    config = resolve(config, num_devices)
    p, e, t = config.parallel, config.moe, config.train
    experts = p.experts
    problems = [
        (
            p.data * p.intra == num_devices,
            f"parallel.data * parallel.intra = {p.data} * {p.intra} must equal the "
            f"{num_devices} devices",
        ),
        (
            e.impl != "capacity" or p.intra == 1,
            "moe.impl='capacity' runs on one device only for now; use 'auto' with parallel.intra>1",
        ),
    ]
    if experts == "ep_a2a_ragged":
        problems.append(
            (
                jax.default_backend() != "cpu",
                "parallel.experts='ep_a2a_ragged' needs a GPU (XLA:CPU does not implement "
                "ragged_all_to_all); use 'ep_a2a' on CPU",
            )
        )
    if experts == "ep_etp":
        problems.append(
            (
                1 < p.etp < p.intra and p.intra % p.etp == 0,
                f"parallel.etp={p.etp} must divide parallel.intra={p.intra} and lie strictly "
                "between 1 and it for parallel.experts='ep_etp' (use 'ep_*' or 'etp' otherwise)",
            )
        )
    else:
        ep, tp = expert_split(config)
        problems += [
            (
                e.num_experts % ep == 0,
                f"moe.num_experts={e.num_experts} must be divisible by the {ep} expert-parallel "
                f"devices of parallel.experts={experts!r}",
            ),
            (
                e.expert_mlp_dim % tp == 0,
                f"moe.expert_mlp_dim={e.expert_mlp_dim} must be divisible by the {tp} "
                f"expert-tensor-parallel devices of parallel.experts={experts!r}",
            ),
        ]
    batch_split = p.data * (p.intra if p.attention in ("dp", "fsdp") else 1)
    problems.append(
        (
            t.batch_size % (batch_split * t.grad_accum) == 0,
            f"train.batch_size={t.batch_size} must be divisible by {batch_split * t.grad_accum} "
            f"(the batch split of parallel.attention={p.attention!r} times train.grad_accum)",
        )
    )
    split = {"sp": p.intra, "tp": p.intra, "fsdp": p.data}.get(p.attention)
    if split:
        name = "parallel.data" if p.attention == "fsdp" else "parallel.intra"
        what = f"{name}={split} for parallel.attention={p.attention!r}"
        problems += _split_heads_problems(config, split, what, p.attention != "fsdp")
        if p.attention != "sp":
            problems += [
                (width % split == 0, f"{key}={width} must be divisible by {what}")
                for key, width in _dense_widths(config).items()
            ]
    for ok, message in problems:
        if not ok:
            raise ValueError(message)


def param_rules(config: Config) -> tuple:
    """Logical parameter axes -> mesh axes for the plan (unnamed axes are replicated)."""
    p, kv = config.parallel, config.model.num_kv_heads
    attention = {
        "tp": (("heads", INTRA), ("mlp", INTRA))
        + ((("kv_heads", INTRA),) if kv % p.intra == 0 else ()),
        "fsdp": (("heads", DATA), ("kv_heads", DATA), ("mlp", DATA)),
    }.get(p.attention, ())
    return attention + EXPERT_RULES


def make_mesh(config: Config, devices=None) -> Mesh:
    devices = np.asarray(devices if devices is not None else jax.devices())
    config = resolve(config, devices.size)
    expert, tensor = expert_split(config)
    return Mesh(devices.reshape(config.parallel.data, expert, tensor), MESH_AXES)


def make_layout(config: Config, mesh: Mesh) -> Layout:
    attention, mlp, batch_axes, seq_axes = ATTENTION[config.parallel.attention]
    return Layout(
        mesh=mesh,
        attention_fn=attention,
        mlp_fn=mlp,
        moe_fn=EXPERTS[expert_layout(config)],
        batch_axes=batch_axes,
        seq_axes=seq_axes,
        param_rules=param_rules(config),
    )


def batch_sharding(layout: Layout) -> NamedSharding:
    """Token batches [batch, seq] as the attention layout splits them."""
    return NamedSharding(layout.mesh, layout.activation_spec(rank=2))


def state_shardings(state, layout: Layout):
    """Shardings for any tree holding model variables (params, optimizer moments, ...).

    A variable is placed by its logical axis names and the layout's rules;
    anything else is replicated.
    """

    return _shardings(state, layout, over_data=False)


def train_state_shardings(state, layout: Layout, zero: int):
    """Shardings of a `TrainState`; with ZeRO stage 1 the optimizer's moments are also
    split over the 'data' axis (each data group updates its slice, then the new
    parameters are all-gathered)."""
    shardings = _shardings(state, layout, over_data=False)
    if zero:
        opt_state = _shardings(state.opt_state, layout, over_data=True)
        shardings = dataclasses.replace(shardings, opt_state=opt_state)
    return shardings


def _shardings(state, layout: Layout, over_data: bool):
    data = layout.mesh.shape[DATA]

    def spec(leaf):
        if not isinstance(leaf, nnx.Variable):
            return NamedSharding(layout.mesh, P())
        spec = list(layout.param_spec(leaf.get_metadata().get("out_sharding") or ()))
        shape = leaf.get_value().shape
        if over_data and data > 1 and DATA not in spec:
            spec += [None] * (len(shape) - len(spec))
            free = [i for i, axis in enumerate(spec) if axis is None and shape[i] % data == 0]
            if free:
                spec[free[0]] = DATA
        return leaf.replace(NamedSharding(layout.mesh, P(*spec)))

    return jax.tree.map(spec, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
