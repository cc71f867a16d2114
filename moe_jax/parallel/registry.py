"""The one registry of parallel layouts: every attention and expert layout's spec.

`parallel.attention` and `parallel.experts` name an entry here; everything else
(the mesh, the blocks, parameter placement, the config check, the planner's
candidates and models) reads the spec. Adding a layout is one new spec in the
module that holds its block function, listed below, and its name in `moe_jax.names`
(the config's jax-free table; tests/test_imports.py checks the two agree).
"""

from __future__ import annotations

from moe_jax.kernels import requirements, tokamax_gmm
from moe_jax.parallel.expert_parallel import EP_A2A, EP_AG, EP_ETP, ETP
from moe_jax.parallel.fsdp import FSDP
from moe_jax.parallel.layout import DATA, DP, EXPERT, STAGE, TENSOR
from moe_jax.parallel.ragged_exchange import EP_A2A_RAGGED
from moe_jax.parallel.spec import AttentionSpec, ExpertSpec, VocabSpec
from moe_jax.parallel.tensor_parallel import TP
from moe_jax.parallel.ulysses import SP
from moe_jax.parallel.vocab_parallel import VOCAB_PARALLEL

ATTENTION: dict[str, AttentionSpec] = {s.name: s for s in (DP, FSDP, TP, SP)}
EXPERTS: dict[str, ExpertSpec] = {s.name: s for s in (EP_A2A, EP_A2A_RAGGED, EP_AG, ETP, EP_ETP)}


def expert_rules(config) -> tuple:
    """Expert weights: experts over 'expert', each one's width over 'tensor' (the mesh
    shape decides the split) and, with `parallel.expert_fsdp`, over 'data' as well."""
    width = (TENSOR, DATA) if config.parallel.expert_fsdp else TENSOR
    return (("experts", EXPERT), ("expert_mlp", width))


def attention_spec(config) -> AttentionSpec:
    return ATTENTION[config.parallel.attention]


def expert_spec(config) -> ExpertSpec:
    """The spec of a resolved `parallel.experts` (not 'auto': see moe_jax.plan.resolve)."""
    name = config.parallel.experts
    if name not in EXPERTS:
        raise ValueError(f"parallel.experts={name!r} must be resolved first (moe_jax.plan)")
    return EXPERTS[name]


def expert_split(config) -> tuple[int, int]:
    """(expert, tensor) sizes of the intra group for the resolved expert layout."""
    return expert_spec(config).split(config.parallel)


def mesh_sizes(config) -> dict[str, int]:
    """Sizes of the mesh axes of a resolved plan."""
    expert, tensor = expert_split(config)
    p = config.parallel
    return {STAGE: p.stages, DATA: p.data, EXPERT: expert, TENSOR: tensor}


def param_rules(config) -> tuple:
    """Logical parameter axes -> mesh axes for the plan (unnamed axes are replicated)."""
    vocab = vocab_spec(config)
    stages = (("stage_layers", STAGE),) if config.parallel.stages > 1 else ()
    return (
        attention_spec(config).rules(config)
        + expert_rules(config)
        + (vocab.rules if vocab else ())
        + stages
    )


def vocab_spec(config) -> VocabSpec | None:
    """The vocabulary split of the plan (`parallel.vocab_parallel`), or None."""
    return VOCAB_PARALLEL if config.parallel.vocab_parallel else None


def batch_split(config) -> int:
    """How many ways the plan's attention layout splits the batch's rows (within one
    stage): over 'data', and over the intra group too where it holds whole rows."""
    p, attention = config.parallel, attention_spec(config)
    return p.data * (p.intra if set(attention.batch_axes) & {EXPERT, TENSOR} else 1)


def problems(config, num_devices: int, platform: str) -> list[str]:
    """Every reason a resolved plan cannot run on `num_devices` devices of `platform`
    ('cpu', 'gpu', 'tpu'), as one-line messages in the order they are checked."""
    p, e, t = config.parallel, config.moe, config.train
    attention, experts = attention_spec(config), expert_spec(config)
    found = []
    if p.stages * p.data * p.intra != num_devices:
        found.append(
            f"parallel.stages * parallel.data * parallel.intra = {p.stages} * {p.data} * "
            f"{p.intra} must equal the {num_devices} devices"
        )
    found += pipeline_problems(config)
    if e.impl == "capacity" and p.intra != 1:
        found.append(
            "moe.impl='capacity' runs on one device only for now; use 'auto' with parallel.intra>1"
        )
    if platform in experts.platforms_without:
        found.append(
            f"parallel.experts={experts.name!r} needs a GPU (XLA:{platform.upper()} "
            f"{experts.platform_reason})"
        )
    own = experts.problems(config)
    found += own
    if not own:
        ep, tp = expert_split(config)
        if e.num_experts % ep:
            found.append(
                f"moe.num_experts={e.num_experts} must be divisible by the {ep} expert-parallel "
                f"devices of parallel.experts={experts.name!r}"
            )
        if e.expert_mlp_dim % tp:
            found.append(
                f"moe.expert_mlp_dim={e.expert_mlp_dim} must be divisible by the {tp} "
                f"expert-tensor-parallel devices of parallel.experts={experts.name!r}"
            )
        elif p.expert_fsdp and e.expert_mlp_dim % (tp * p.data):
            found.append(
                f"parallel.expert_fsdp splits moe.expert_mlp_dim={e.expert_mlp_dim} over "
                f"{tp} expert-tensor x {p.data} data devices, which must divide it"
            )
    split = batch_split(config)
    if p.stages > 1 and t.batch_size % (split * p.microbatches):
        found.append(
            f"train.batch_size={t.batch_size} must be divisible by "
            f"{split * p.microbatches} (parallel.microbatches={p.microbatches} times "
            f"the batch split of parallel.attention={attention.name!r})"
        )
    if t.batch_size % (split * t.grad_accum):
        found.append(
            f"train.batch_size={t.batch_size} must be divisible by {split * t.grad_accum} "
            f"(the batch split of parallel.attention={attention.name!r} times train.grad_accum)"
        )
    chunk = t.seq_len // t.loss_chunks if t.loss_chunks else 0
    if attention.seq_axes and chunk % p.intra:
        found.append(
            f"train.loss_chunks={t.loss_chunks} leaves chunks of {chunk} positions, not "
            f"divisible by the parallel.intra={p.intra} devices parallel.attention="
            f"{attention.name!r} splits the sequence over"
        )
    sequences = t.batch_size // max(1, split * config.micro_batches)  # one micro-batch
    if attention.chunks_batch and p.overlap_chunks > 1 and sequences % p.overlap_chunks:
        found.append(
            f"parallel.overlap_chunks={p.overlap_chunks} must divide the {sequences} sequences "
            f"of each device's micro-batch: parallel.attention={attention.name!r} runs its "
            "chunks over the batch"
        )
    held = t.seq_len // (p.intra if attention.seq_axes else 1)  # positions a device holds
    if held % p.overlap_chunks:
        found.append(
            f"parallel.overlap_chunks={p.overlap_chunks} must divide the {held} positions of "
            f"each sequence a device holds under parallel.attention={attention.name!r}"
        )
    if p.collective_matmul and not attention.ring and experts.ring_dispatcher is None:
        with_ring = [a for a, s in ATTENTION.items() if s.ring]
        with_ring += [x for x, s in EXPERTS.items() if s.ring_dispatcher]
        found.append(
            f"parallel.collective_matmul=True has no exchange to rewrite under "
            f"parallel.attention={attention.name!r} and parallel.experts={experts.name!r}; "
            f"layouts with a ring form: {', '.join(with_ring)}"
        )
    if p.collective_matmul and experts.ring_dispatcher is not None and not e.dropless:
        found.append(
            f"parallel.collective_matmul=True runs parallel.experts={experts.name!r} as a ring "
            f"that routes one source's tokens per step, so moe.capacity_factor="
            f"{e.capacity_factor} cannot decide drops over the whole group; use "
            "moe.capacity_factor=0 (dropless) or parallel.collective_matmul=False"
        )
    found += requirements.attention_problems(
        config.model.attention_impl, config.model.dtype, platform
    )
    if e.impl == "tokamax" and tokamax_gmm.missing():  # installed (config found it), broken
        found.append(tokamax_gmm.missing())
    if config.model.remat == "offload" and platform != "gpu":
        found.append(
            f"model.remat='offload' moves kept activations to pinned host memory, which "
            f"XLA:{platform.upper()} does not have; use 'selective' there"
        )
    return found + attention.problems(config) + VOCAB_PARALLEL.problems(config)


def pipeline_problems(config) -> list[str]:
    """Why `parallel.stages`, `microbatches` and `repeats` cannot run this model."""
    p, m = config.parallel, config.model
    if p.stages == 1:
        if p.repeats > 1:
            return [f"parallel.repeats={p.repeats} needs a pipeline (parallel.stages > 1)"]
        return []
    found = []
    groups = p.stages * p.repeats
    if m.num_moe_layers % groups:
        found.append(
            f"parallel.stages * parallel.repeats = {groups} must divide the "
            f"{m.num_moe_layers} pipelined units (the MoE layer stack; "
            f"model.first_k_dense={m.first_k_dense} dense layers run before it)"
        )
    if p.microbatches % p.stages:
        found.append(
            f"parallel.microbatches={p.microbatches} must be a multiple of "
            f"parallel.stages={p.stages} (each stage embeds and scores an equal share)"
        )
    if config.train.grad_accum != 1:
        found.append(
            f"train.grad_accum={config.train.grad_accum} must be 1 under a pipeline: "
            f"parallel.microbatches={p.microbatches} is its accumulation"
        )
    return found


def check(config, num_devices: int, platform: str) -> None:
    """Raises a one-line ValueError for the first reason the resolved plan cannot run."""
    found = problems(config, num_devices, platform)
    if found:
        raise ValueError(found[0])
