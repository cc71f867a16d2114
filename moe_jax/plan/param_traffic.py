"""Parameter and gradient traffic of a plan, in bytes one device sends per step.

Why: under sp the attention weights are replicated over the intra group, so
their gradients cost what tp saves in activations; the planner weighs both.

Convention (as `moe_jax.tools.comm_report`): a device's buffer of S bytes over
g devices sends S·(g-1)/g for an all-gather, reduce-scatter or all-to-all and
2·S·(g-1)/g for an all-reduce.

`gradient_bytes_per_step` follows what XLA compiles today, per parameter and
per micro-batch (the reductions sit inside the backward of each one):

  * blocks inside `shard_map` (sp and tp attention, the router, experts, tp and
    fsdp MLPs): one all-reduce of the device's shard over every mesh axis the
    weight is replicated on (the router and sp attention: all d·n devices;
    experts and tp-split weights: 'data');
  * weights GSPMD differentiates (embedding, head, norms, dp attention, dp/sp
    dense MLPs): one all-reduce over all devices when the batch is split over
    all of them (dp, fsdp), else one over the intra group and one over 'data';
  * fsdp weights: all-gather forward (again in the recompute when model.remat is
    not 'none') and reduce-scatter of the gathered weight over 'data', plus an
    all-reduce of the whole gathered gradient over intra; expert weights under
    `parallel.expert_fsdp` the same, over 'data' only;
  * tp kv weights kept whole (kv heads < n): an all-reduce over intra of the
    whole weight, and over 'data' of the one kv head a device uses (XLA moves that
    all-reduce before the scatter into the whole weight);
  * ZeRO-2, the distributed optimizer: per step instead, the compute weights gathered
    in the model's dtype and the gradients reduce-scattered once, the stacked weights'
    inside the backward with one micro-batch (`distributed_optimizer_traffic`);
  * ZeRO-1: the moments split over 'data' leave the updated parameters to be
    all-gathered over 'data' once per step. (XLA today also shards the embedding
    table's gradient scatter when the table's moments are split, trading the
    table's all-reduce for gathers of the tokens' cotangents; not modelled.)

`hierarchical_sync_bytes` is the paper's appendix instead: gradients accumulated
over the step and synchronised once, intra-node reduce-scatter, inter-node
reduce-scatter and all-gather, intra-node all-gather.
"""

from __future__ import annotations

import dataclasses
import math

from jax.sharding import PartitionSpec as P

from moe_jax.config import Config
from moe_jax.parallel import distributed_optimizer, grad_exchange, registry
from moe_jax.parallel.layout import DATA, EXPERT, INTRA, TENSOR, axes_of
from moe_jax.plan.comm_volume import DTYPE_BYTES
from moe_jax.plan.state_arrays import (
    StateArray,
    device_bytes,
    mesh_sizes,
    names_of,
    placement,
    state_arrays,
    synced_in_backward,
)


def _all_reduce(size: float, group: int) -> float:
    return 2 * size * (group - 1) / group


def _gather(size: float, group: int) -> float:
    return size * (group - 1) / group


def _block(config: Config, array: StateArray) -> str:
    """Which code differentiates the weight: 'experts', 'router', 'attention', 'mlp'
    (dense or shared-expert MLPs) or 'outer' (embedding, head, norms)."""
    names = set(array.names) - {"layers"}
    if "experts" in names:
        return "experts"
    if names & {"heads", "kv_heads"}:
        return "attention"
    if "mlp" in names:
        return "mlp"
    if None in array.names:
        return "router"
    return "outer"


def _splits(config: Config, array: StateArray, master: bool = True) -> set[str]:
    """Mesh axes the parameter is split over (`master`: as `placement`)."""
    return {a for entry in placement(config, array, master=master) for a in axes_of(entry)}


def _by_gspmd(config: Config, block: str) -> bool:
    """Whether GSPMD, not a `shard_map` layout, differentiates the block's weights."""
    spec = registry.attention_spec(config)
    return (
        block == "outer"
        or (block == "attention" and not spec.attention_in_shard_map)
        or (block == "mlp" and not spec.mlp_in_shard_map)
    )


def _outer(config: Config, size: float) -> float:
    """GSPMD reduces over the batch axes and then the sequence axes of the layout."""
    p = config.parallel
    if not registry.attention_spec(config).seq_axes:  # the batch is split over every device
        return _all_reduce(size, p.data * p.intra)
    return _all_reduce(size, p.intra) + _all_reduce(size, p.data)


def parameter_bytes(config: Config, array: StateArray) -> float:
    """Bytes one device sends per micro-batch for one parameter's gradient (and, under
    fsdp, its gathered weight)."""
    p, m = config.parallel, config.model
    d, n = p.data, p.intra
    size = device_bytes(config, array)
    block, splits = _block(config, array), _splits(config, array)
    weights_over = registry.attention_spec(config).weights_over
    # Weights gathered over 'data' per block run the gather again when recomputed.
    gathers = 1 if m.remat == "none" else 2
    if block in ("attention", "mlp") and weights_over == DATA:
        whole = size * d if DATA in splits else size
        return (gathers + 1) * _gather(whole, d) + _all_reduce(whole, n)
    if block == "experts" and DATA in splits:  # parallel.expert_fsdp
        sizes = mesh_sizes(config)
        rest = math.prod(sizes[a] for a in sizes if a not in splits)
        return (gathers + 1) * _gather(size * d, d) + _all_reduce(size * d, rest)
    if block == "outer" and "vocab" in array.names and p.vocab_parallel:
        return _all_reduce(size, d)  # split over intra already: reduced over 'data' only
    if _by_gspmd(config, block):
        return _outer(config, size)
    if block == "attention" and weights_over == INTRA and not splits & {EXPERT, TENSOR}:
        kv_head = size / m.num_kv_heads  # only kv weights stay whole under tp
        return _all_reduce(size, n) + _all_reduce(kv_head, d)
    sizes = mesh_sizes(config)
    return _all_reduce(size, math.prod(sizes[a] for a in sizes if a not in splits))


def bf16_a2a_bytes(config: Config, array: StateArray) -> tuple[float, float]:
    """(per micro-batch, per step) bytes one device sends for one parameter under
    `parallel.grad_exchange='bf16_a2a'` (`moe_jax.parallel.grad_exchange`).

    Per micro-batch: a weight split over 'data' (FSDP, expert FSDP) is gathered in
    float32 (again in the recompute) and its gradient's bf16 all-to-all over 'data'
    replaces the reduce-scatter. Per step, the accumulated gradient: a bf16 all-to-all
    per stage (the intra group on the whole, then 'data' on the 1/n shard), and the
    summed float32 shards gathered back for the update; a gradient no dimension lets the
    group cut is all-reduced in float32 instead."""
    per_micro_batch, summed, back = _per_device_exchange(config, array, distributed=False)
    return per_micro_batch, summed + back


def _per_device_exchange(config: Config, array: StateArray, distributed: bool):
    """(per micro-batch, per step: the gradient's sum, the weights gathered back) bytes of
    one parameter's exchange in the step run per device: `bf16_a2a_bytes`, or
    `distributed_optimizer_traffic` with `distributed`."""
    p, m = config.parallel, config.model
    compressed = p.grad_exchange == "bf16_a2a"
    sizes = mesh_sizes(config)
    size = device_bytes(config, array, master=False)
    spec = P(*placement(config, array, master=False))
    start = distributed_optimizer.start_of(names_of(config, array)) if distributed else 0
    per_micro_batch = 0.0
    if DATA in _splits(config, array, master=False):
        gathers = 1 if m.remat == "none" else 2
        whole = size * p.data
        summed = whole / 2 if compressed else whole
        per_micro_batch = gathers * _gather(whole, p.data) + _gather(summed, p.data)
    stages = [math.prod(sizes[a] for a in stage) for stage in grad_exchange.summed_over(spec)]
    group = math.prod(stages)
    if group == 1:
        return per_micro_batch, 0.0, 0.0
    if grad_exchange.cut_dimension(sizes, spec, array.shape, start) is None:
        return per_micro_batch, _all_reduce(size, group), 0.0
    summed = _bf16_levels(size, stages) if compressed else _gather(size, group)
    # back to where the update reads them: the float32 sums gathered to the weights, or
    # (distributed optimizer) the next step's weights gathered in the model's dtype
    back = size * DTYPE_BYTES[m.dtype] / array.itemsize if distributed else size
    return per_micro_batch, summed, _gather(back, group)


def _bf16_levels(size: float, stages: list[int]) -> float:
    """Bytes of `grad_exchange.exchange` on a float32 gradient of `size` bytes: a bf16
    all-to-all per level (`stages`: its devices), each on the previous level's shard."""
    sent, shard = 0.0, size / 2
    for devices in stages:
        sent += _gather(shard, devices)
        shard /= devices
    return sent


def pipeline_sum_bytes(config: Config, array: StateArray) -> float:
    """Bytes one device sends for one parameter under a pipeline with float32 sums: the
    step runs per device in one shard_map, and each gradient is all-reduced once, over
    the mesh axes its parameter is replicated on ('stage' too, outside the stack)."""
    sizes = mesh_sizes(config)
    spec = P(*placement(config, array))
    group = math.prod(sizes[a] for level in grad_exchange.summed_over(spec) for a in level)
    return _all_reduce(device_bytes(config, array), group) if group > 1 else 0.0


def bf16_a2a_traffic(config: Config) -> tuple[float, float]:
    """(per micro-batch, per step) bytes of `bf16_a2a_bytes` over all parameters, the
    step's with ZeRO-1's gather of the updated parameters."""
    params = _params(config)
    traffic = [bf16_a2a_bytes(config, a) for a in params]
    zero = sum(_zero_gather(config, a) for a in params)
    return sum(m for m, _ in traffic), sum(s for _, s in traffic) + zero


def _zero_gather(config: Config, array: StateArray) -> float:
    """All-gather of an updated parameter whose moments ZeRO-1 split over 'data'."""
    p = config.parallel
    if not p.zero or p.data == 1 or DATA in _splits(config, array):
        return 0.0
    moment = dataclasses.replace(array, moment=True)
    if DATA not in _splits(config, moment):
        return 0.0
    return _gather(device_bytes(config, array), p.data)


def distributed_optimizer_traffic(config: Config) -> tuple[float, float, float]:
    """(per micro-batch, inside the backward, after it) bytes one device sends under the
    distributed optimizer (`parallel.zero=2`, `moe_jax.parallel.distributed_optimizer`),
    over all parameters.

    Per micro-batch, as under `bf16_a2a`: a weight split over 'data' (FSDP, expert FSDP)
    is gathered in float32 per layer (again in the recompute) and its gradient
    reduce-scattered (float32, or bf16 all-to-all shards). Per step, over the g devices
    sharing a parameter: the accumulated float32 gradient reduce-scattered to the
    masters (or, under `bf16_a2a`, its bf16 all-to-all per level): inside the backward
    for a stacked weight where the step syncs there (`state_arrays.synced_in_backward`:
    one micro-batch, no pipeline), after it for the rest; and every compute copy
    all-gathered in `model.dtype` for the next step. A gradient no dimension lets g cut
    stays whole and is all-reduced in float32."""
    out = [0.0, 0.0, 0.0]
    for array in _params(config):
        per_micro_batch, summed, back = _per_device_exchange(config, array, distributed=True)
        inside = synced_in_backward(config, array)
        out[0] += per_micro_batch
        out[1] += summed if inside else 0.0
        out[2] += back + (0.0 if inside else summed)
    return out[0], out[1], out[2]


def _params(config: Config) -> list[StateArray]:
    if config.parallel.data < 1 or config.parallel.experts == "auto":
        raise ValueError("param_traffic needs a resolved plan (see moe_jax.plan.resolve)")
    return [a for a in state_arrays(config) if a.part == "params"]


def gradient_bytes_per_step(config: Config) -> int:
    """Parameter and gradient bytes one device sends per step, as the trainer compiles it
    (what `comm_report` reports as param_grad, small loss reductions aside): XLA's
    float32 reductions per micro-batch, or `parallel.grad_exchange='bf16_a2a'`'s
    exchange once per step (`bf16_a2a_bytes`)."""
    params = _params(config)
    if config.parallel.zero == 2:
        per_micro_batch, inside, after = distributed_optimizer_traffic(config)
        return round(per_micro_batch * config.micro_batches + inside + after)
    if config.parallel.stages > 1 and config.parallel.grad_exchange == "fp32":
        return round(sum(pipeline_sum_bytes(config, a) for a in params))
    if config.parallel.grad_exchange == "bf16_a2a":
        per_micro_batch, per_step = bf16_a2a_traffic(config)
        return round(per_micro_batch * config.micro_batches + per_step)
    zero = sum(_zero_gather(config, a) for a in params)
    per_micro_batch = sum(parameter_bytes(config, a) for a in params)
    return round(per_micro_batch * config.micro_batches + zero)


def hierarchical_sync_bytes(config: Config) -> dict[str, int]:
    """The paper's hierarchical data-parallel sync, bytes one device sends per step.

    P: bytes of a device's parameters replicated over its node (n devices) and
    d data groups. Intra-node reduce-scatter, inter-node reduce-scatter and
    all-gather of the 1/n shard, intra-node all-gather: intra 2P(n-1)/n, inter
    2(P/n)(d-1)/d. Parameters split over the node (experts, tp shards) are
    all-reduced across data groups only: inter 2S(d-1)/d. fsdp weights (split over
    'data') end reduce-scattered: the final all-gather only rebuilds the node's
    1/d share.
    """
    d, n = config.parallel.data, config.parallel.intra
    intra = inter = 0.0
    for array in _params(config):
        size, splits = device_bytes(config, array), _splits(config, array)
        if splits & {EXPERT, TENSOR}:
            inter += _all_reduce(size, d)
        elif DATA in splits:
            whole = size * d
            intra += _gather(whole, n) + _gather(size, n)
            inter += _gather(whole / n, d)
        else:
            intra += _all_reduce(size, n)
            inter += _all_reduce(size / n, d)
    return {"intra": round(intra), "inter": round(inter)}
