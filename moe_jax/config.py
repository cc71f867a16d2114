"""Typed configuration: the one place that knows every setting and checks it.

Config files in `configs/` are `ml_collections` dicts (overridable from the
command line); `load()` turns one into frozen dataclasses and validates it
once, before anything is traced or compiled. Every error is a one-line
`ValueError` that names the setting and what would be valid.

`ml_collections` is imported only where a config dict is made or read: the
dataclasses alone serve the GPU checks (`bench/gpu_*.py`) on a machine without it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

from moe_jax import config_attention, config_rules, config_sources
from moe_jax.kernels import requirements

if TYPE_CHECKING:
    import ml_collections

SCORE_FNS = ("softmax", "sigmoid")
MOE_IMPLS = ("auto", "tiled", "ragged_dot", "pallas", "tokamax", "capacity", "dense")
DTYPES = ("float32", "bfloat16")
REMAT = ("none", "full", "selective", "offload")  # see moe_jax.model.remat
UPCYCLE = ("none", "copy", "split")  # see moe_jax.init_from
WANDB = ("off", "offline", "online")  # see moe_jax.metrics
QK_NORMS = ("none", "head", "projection")  # see moe_jax.model.attention
ROPE_SCALINGS = ("none", "linear", "yarn")  # see moe_jax.model.rope
GROUP_SCORES = ("top2_sum", "max")  # see moe_jax.moe.routing


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Router, experts and load balancing of every MoE layer."""

    num_experts: int = 8
    top_k: int = 2
    expert_mlp_dim: int = 128
    num_shared_experts: int = 0
    shared_mlp_dim: int = 128  # width of each shared expert
    shared_expert_gate: bool = False  # scale the shared experts by sigmoid(x @ w) (Qwen2-MoE)
    score_fn: str = "softmax"
    renormalize: bool = True  # rescale the selected weights to sum to one
    routed_scaling: float = 1.0
    n_groups: int = 1  # group-limited routing (DeepSeek-V3); 1 disables it
    topk_groups: int = 1
    # What ranks a group: the sum of its best two scores (DeepSeek-V3) or its best
    # score (DeepSeek-V2's group_limited_greedy).
    group_score: str = "top2_sum"
    capacity_factor: float = 0.0  # 0 = dropless
    impl: str = "auto"
    tile_size: int = 0  # rows per tile of the `tiled` grouped matmul; 0 = auto
    aux_loss_coef: float = 0.01
    seq_aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.001
    bias_update_rate: float = 0.0  # aux-loss-free balancing; 0 disables it

    @property
    def dropless(self) -> bool:
        return self.capacity_factor == 0.0

    def tile(self, num_tokens: int) -> int:
        """Rows per tile: `tile_size`, or by default a power of two in [16, 128] near
        an eighth of an expert's mean rows. Padding is at most a tile per expert, and
        the tiled kernel multiplies whole runs of tiles at once, so small is cheap."""
        if self.tile_size:
            return self.tile_size
        rows_per_expert = num_tokens * self.top_k / self.num_experts
        return int(min(128, max(16, 2 ** math.floor(math.log2(max(rows_per_expert / 8, 1))))))

    def capacity(self, num_tokens: int) -> int:
        """Slots per expert for `num_tokens` tokens in capacity mode."""
        slots = math.ceil(self.capacity_factor * num_tokens * self.top_k / self.num_experts)
        return max(1, min(num_tokens, slots))


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Decoder-only transformer: GQA attention, dense and MoE SwiGLU blocks."""

    vocab_size: int = 259
    num_layers: int = 2
    embed_dim: int = 128
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    mlp_dim: int = 256  # width of the dense SwiGLU layers
    first_k_dense: int = 0
    moe_every: int = 1  # after the dense prefix, every moe_every-th layer is MoE
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    # Rotary scaling the checkpoint was trained with (moe_jax.model.rope; names after
    # Hugging Face's rope_parameters): none, linear (positions / rope_factor) or yarn.
    rope_scaling: str = "none"
    rope_factor: float = 1.0
    rope_original_max_position: int = 0  # yarn: the pretraining context length
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_mscale: float = 0.0  # yarn; 0 = unset
    rope_mscale_all_dim: float = 0.0  # yarn; 0 = unset
    rope_attention_factor: float = 0.0  # yarn's cos/sin factor; 0 = from factor and mscales
    rope_truncate: bool = True  # yarn: round the correction range to whole pairs
    norm_eps: float = 1e-6
    qkv_bias: bool = False  # biases on the query, key and value projections (Qwen2)
    # RMSNorm on queries and keys before rotary: none, head (over each head, Qwen3) or
    # projection (over all heads of the projection at once, OLMoE).
    qk_norm: str = "none"
    dtype: str = "float32"  # compute dtype; parameters are always float32
    remat: str = "none"
    # Per-device attention: xla (stores [s, s] scores), cudnn (GPU flash attention,
    # bfloat16), blockwise (plain JAX, no [s, s] scores) or auto (cudnn on GPU in
    # bfloat16, else blockwise); see moe_jax.kernels.attention.
    attention_impl: str = "auto"
    # gqa (the projections above) or mla (multi-head latent attention, DeepSeek-V2/V3),
    # with its widths named as in the Hugging Face config; see moe_jax.model.mla.
    attention: str = "gqa"
    q_lora_rank: int = 0  # mla: query latent width; 0 = one query projection (V2-Lite)
    kv_lora_rank: int = 0  # mla: key/value latent width (what decoding caches)
    qk_nope_head_dim: int = 0  # mla: per-head query/key width without rotary
    qk_rope_head_dim: int = 0  # mla: rotary width, its key shared by all heads
    v_head_dim: int = 0  # mla: per-head value width
    # Multi-token prediction (DeepSeek-V3): D modules after the stack, module k predicting
    # the token k + 1 ahead (`moe_jax.model.mtp`); 0 = off (HF: num_nextn_predict_layers).
    mtp_depth: int = 0

    @property
    def num_moe_layers(self) -> int:
        return (self.num_layers - self.first_k_dense) // self.moe_every

    def block_of(self, layer: int) -> tuple[str, int, int, bool]:
        """The one rule for which layers are MoE: (stack, unit, block in the unit, is MoE)
        of layer `layer`. `first_k_dense` 'dense' units of one block, then 'moe' units of
        `moe_every - 1` dense blocks and one MoE block."""
        if layer < self.first_k_dense:
            return "dense", layer, 0, False
        unit, block = divmod(layer - self.first_k_dense, self.moe_every)
        return "moe", unit, block, block == self.moe_every - 1


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Optimisation, evaluation, logging and checkpoint cadence."""

    steps: int = 200
    batch_size: int = 16  # global batch, in sequences
    seq_len: int = 128
    grad_accum: int = 1  # micro-batches per step (batch_size must divide evenly)
    learning_rate: float = 3e-3
    schedule: str = "cosine"  # after warmup: cosine, linear, constant, wsd or inverse_sqrt
    min_lr_ratio: float = 0.1  # final learning rate / peak
    wsd_decay_fraction: float = 0.1  # schedule=wsd: the last fraction of steps that decay
    warmup_steps: int = 20
    optimizer: str = "adamw"  # or muon: Muon for the hidden matrices (moe_jax.optimizer)
    muon_momentum: float = 0.95  # optimizer=muon: the matrices' Nesterov momentum
    moment_dtype: str = "float32"  # or bfloat16: the optimizer's moments between steps
    weight_decay: float = 0.1
    decay_norms: bool = False  # apply weight decay to norm scales
    decay_embeddings: bool = True  # apply weight decay to the embedding table
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # global-norm clipping; 0 disables it
    qk_clip: bool = False  # Kimi-K2's QK-clip: heads whose peak logit passed the threshold
    qk_clip_threshold: float = 100.0  # ... have their query and key scaled (moe_jax.qk_clip)
    seed: int = 0
    log_every: int = 10
    eval_every: int = 100  # 0 evaluates only at the end
    eval_batches: int = 4
    checkpoint_every: int = 100  # 0 saves only at the end
    keep_checkpoints: int = 3
    max_bad_steps: int = 5  # consecutive non-finite losses before the run stops
    loss_chunks: int = 0  # chunks of the sequence the loss runs over; 0 = by logits size
    mtp_loss_weight: float = 0.1  # loss = lm + weight * mean over model.mtp_depth depths
    memory_limit_gb: float = 0.0  # per device, checked before compiling; 0 = the device's
    # A fresh run's weights from another run or a Hugging Face checkpoint directory
    # (step 0, fresh optimizer); upcycle: none, copy or split (moe_jax.init_from).
    init_from: str = ""
    upcycle: str = "none"
    wandb: str = "off"  # Weights & Biases: off, offline or online (needs the wandb package)
    wandb_project: str = "moe_jax"


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where tokens come from."""

    source: str = "stdlib"  # stdlib (embedded corpus), tokens (prepared files) or synthetic
    path: str = ""  # directory written by `python -m moe_jax.data.prepare` (source=tokens)
    val_fraction: float = 0.05  # share of stdlib files held out for validation
    verify: bool = False  # check every shard's SHA-256 against meta.json at start (tokens)
    # A mixture of prepared directories instead of data.path, drawn by weight per window:
    # DIR:WEIGHT:NAME,DIR:WEIGHT:NAME (moe_jax.config_sources, moe_jax.data.mixture).
    sources: str = ""
    # Attention within each document of a window, positions restarting at each, and no
    # target predicted across a document boundary (docs/data.md); source=synthetic has
    # no documents, so it has no effect there.
    document_mask: bool = True


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """The plan: how each block kind is laid out on a (data, intra) device mesh."""

    layout: str = "manual"  # manual (the settings below) or auto (the planner picks them)
    gpu: str = ""  # layout=auto: hardware preset the planner assumes; "" = this device's, else h800
    attention: str = "dp"  # dp, fsdp, tp (Megatron + sequence-parallel norms), sp (Ulysses)
    experts: str = "auto"  # ep_ag, ep_a2a, etp (expert width split), ep_etp, or auto
    ag_threshold: float = 0.75  # auto picks ep_ag when moe.top_k / intra exceeds this
    # ep_a2a*: rows of each per-destination buffer as a multiple of the balanced share
    # T·k/n; 0 = room for all T·k (exactly dropless). Overflow is dropped and counted.
    a2a_buffer_factor: float = 0.0
    intra: int = 1  # n: devices of one intra-node group (experts and sequence split here)
    data: int = 0  # data-parallel groups; 0 = all devices not used by intra
    zero: int = 0  # ZeRO: 0 replicated, 1 moments split over data, 2 distributed optimizer
    etp: int = 2  # experts=ep_etp: devices splitting each expert's width (intra / etp own experts)
    # Expert weights (and their gradients and moments) also split over 'data', gathered
    # per layer and reduce-scattered in the backward: ZeRO-3 / FSDP for the experts.
    expert_fsdp: bool = False
    # Embedding and output head split over the vocabulary on the intra group, with a
    # vocabulary-parallel cross-entropy (Megatron-LM's).
    vocab_parallel: bool = False
    # Expert blocks run as this many independent chunks of each device's tokens (along
    # the sequence), so one chunk's exchanges can overlap another's expert compute; sp's
    # attention blocks likewise, in chunks of the batch.
    overlap_chunks: int = 1
    # Collective matmul: the exchanges of tp blocks, sp attention and the all-gather
    # expert layouts as n-1 point-to-point steps, each overlapping the GEMM on the block
    # at hand.
    collective_matmul: bool = False
    # Dtype of token movements: 'native' (the compute dtype) or 'fp8' (E4M3 payload with
    # float32 scales per token and 128 channels; the backward in the compute dtype).
    token_dtype: str = "native"
    # Gradients summed over devices: 'fp32', or 'bf16_a2a' (each device's float32
    # gradient rounded once to bf16, exchanged by all-to-all into shards, summed in
    # float32; intra group first, then 'data').
    grad_exchange: str = "fp32"
    # Pipeline parallelism (`moe_jax.parallel.pipeline`) over an outer 'stage' mesh axis.
    stages: int = 1  # S: pipeline stages the MoE layer stack is cut over (1: no pipeline)
    microbatches: int = 1  # M: micro-batches per step through the pipeline, a multiple of S
    repeats: int = 1  # R: circular schedule, R non-adjacent layer groups per stage
    schedule: str = "gpipe"  # 'gpipe', '1f1b' or 'zero_bubble' (`pipeline_1f1b`)
    stash_depth: int = 0  # zero_bubble: the most ticks a W trails its B (0: S - 1, all)


@dataclasses.dataclass(frozen=True)
class ProfileConfig:
    steps: str = ""  # "start,stop": trace steps [start, stop) with jax.profiler


@dataclasses.dataclass(frozen=True)
class Config:
    model: ModelConfig = ModelConfig()
    moe: MoEConfig = MoEConfig()
    train: TrainConfig = TrainConfig()
    data: DataConfig = DataConfig()
    parallel: ParallelConfig = ParallelConfig()
    profile: ProfileConfig = ProfileConfig()

    @property
    def micro_batches(self) -> int:
        """Micro-batches per step: a pipeline's `parallel.microbatches`, else
        `train.grad_accum`."""
        return self.parallel.microbatches if self.parallel.stages > 1 else self.train.grad_accum


SECTIONS = {
    "model": ModelConfig,
    "moe": MoEConfig,
    "train": TrainConfig,
    "data": DataConfig,
    "parallel": ParallelConfig,
    "profile": ProfileConfig,
}
DATA_SOURCES = ("stdlib", "tokens", "synthetic")
SCHEDULES = ("cosine", "linear", "constant", "wsd", "inverse_sqrt")


def to_config_dict(config: Config) -> ml_collections.ConfigDict:
    """The `ml_collections` form of a typed config (what `configs/*.py` return)."""
    import ml_collections

    return ml_collections.ConfigDict(dataclasses.asdict(config))


def load(config: ml_collections.ConfigDict | dict[str, Any]) -> Config:
    """Builds the typed config from a config dict and validates it."""
    raw = config.to_dict() if hasattr(config, "to_dict") else dict(config)  # a ConfigDict
    unknown = sorted(set(raw) - set(SECTIONS))
    if unknown:
        raise ValueError(f"unknown config section {unknown[0]!r}; valid: {sorted(SECTIONS)}")
    kwargs = {}
    for section, cls in SECTIONS.items():
        values = raw.get(section, {})
        if not isinstance(values, dict):
            raise ValueError(f"config section {section!r} must be a mapping of settings")
        defaults = dataclasses.asdict(cls())
        bad = sorted(set(values) - set(defaults))
        if bad:
            raise ValueError(
                f"unknown setting {section}.{bad[0]}; valid settings: {sorted(defaults)}"
            )
        if section == "data" and "sources" in values:  # a config file may give a list
            values = {**values, "sources": config_sources.as_text(values["sources"])}
        for name, value in values.items():
            _check_type(f"{section}.{name}", value, defaults[name])
        kwargs[section] = cls(**values)
    result = Config(**kwargs)
    validate(result)
    return result


def _check_type(setting: str, value: Any, default: Any) -> None:
    """Settings keep the type of their default (an int may stand for a float)."""
    expected = type(default)
    ok = isinstance(value, expected) and not (expected is int and isinstance(value, bool))
    ok = ok or (expected is float and isinstance(value, int) and not isinstance(value, bool))
    _check(ok, setting, value, f"must be of type {expected.__name__}")


_check = config_rules.check


def _positive(section: Any, prefix: str, *fields: str) -> None:
    for name in fields:
        value = getattr(section, name)
        _check(value > 0, f"{prefix}.{name}", value, "must be > 0")


def validate(config: Config) -> None:
    """Raises a one-line ValueError for the first inconsistent setting: each setting's
    own range here; the rules over the whole config (every float finite, no setting
    another turns off, no window beyond the run) in `moe_jax.config_rules`."""
    config_rules.check_finite(config)
    m, e, t = config.model, config.moe, config.train
    _check(
        m.vocab_size >= 2,
        "model.vocab_size",
        m.vocab_size,
        "must be >= 2: one token id leaves nothing to predict",
    )
    _positive(m, "model", "num_layers", "embed_dim", "num_heads")
    _positive(m, "model", "num_kv_heads", "head_dim", "mlp_dim", "moe_every", "norm_eps")
    _check(
        m.rope_theta > 1,
        "model.rope_theta",
        m.rope_theta,
        "must be > 1 (the base of the rotary wavelengths; 1 makes every frequency equal)",
    )
    config_rules.validate_rope(m, ROPE_SCALINGS)
    _check(
        m.num_heads % m.num_kv_heads == 0,
        "model.num_heads",
        m.num_heads,
        f"must be a multiple of model.num_kv_heads={m.num_kv_heads}",
    )
    _check(m.head_dim % 2 == 0, "model.head_dim", m.head_dim, "must be even (rotary pairs)")
    _check(m.dtype in DTYPES, "model.dtype", m.dtype, f"valid: {DTYPES}")
    _check(m.remat in REMAT, "model.remat", m.remat, f"valid: {REMAT}")
    _check(m.qk_norm in QK_NORMS, "model.qk_norm", m.qk_norm, f"valid: {QK_NORMS}")
    _validate_attention_impl(m)
    config_attention.validate(m)
    _check(
        0 <= m.first_k_dense <= m.num_layers,
        "model.first_k_dense",
        m.first_k_dense,
        f"must be in [0, model.num_layers={m.num_layers}]",
    )
    _check(
        (m.num_layers - m.first_k_dense) % m.moe_every == 0,
        "model.moe_every",
        m.moe_every,
        f"must divide model.num_layers - model.first_k_dense = {m.num_layers - m.first_k_dense}",
    )

    _positive(e, "moe", "num_experts", "top_k", "expert_mlp_dim", "shared_mlp_dim")
    _positive(e, "moe", "n_groups", "topk_groups", "routed_scaling")
    _check(e.tile_size >= 0, "moe.tile_size", e.tile_size, "must be >= 0 (0 picks it by size)")
    _check(
        e.top_k <= e.num_experts,
        "moe.top_k",
        e.top_k,
        f"must be <= moe.num_experts={e.num_experts}",
    )
    _check(e.score_fn in SCORE_FNS, "moe.score_fn", e.score_fn, f"valid: {SCORE_FNS}")
    _check(
        e.group_score in GROUP_SCORES, "moe.group_score", e.group_score, f"valid: {GROUP_SCORES}"
    )
    _check(e.impl in MOE_IMPLS, "moe.impl", e.impl, f"valid: {MOE_IMPLS}")
    _validate_moe_impl(e)
    _check(
        e.num_shared_experts >= 0, "moe.num_shared_experts", e.num_shared_experts, "must be >= 0"
    )
    _check(
        not e.shared_expert_gate or e.num_shared_experts > 0,
        "moe.shared_expert_gate",
        e.shared_expert_gate,
        "gates the shared experts: needs moe.num_shared_experts > 0",
    )
    _check(
        e.capacity_factor >= 0,
        "moe.capacity_factor",
        e.capacity_factor,
        "must be >= 0 (0 means dropless)",
    )
    _check(
        e.impl != "capacity" or not e.dropless,
        "moe.impl",
        e.impl,
        "'capacity' needs moe.capacity_factor > 0; dropless runs use 'auto', 'tiled' or "
        "'ragged_dot'",
    )
    _check(
        e.num_experts % e.n_groups == 0,
        "moe.n_groups",
        e.n_groups,
        f"must divide moe.num_experts={e.num_experts}",
    )
    _check(
        e.topk_groups <= e.n_groups,
        "moe.topk_groups",
        e.topk_groups,
        f"must be <= moe.n_groups={e.n_groups}",
    )
    reachable = e.topk_groups * (e.num_experts // e.n_groups)
    _check(
        e.top_k <= reachable,
        "moe.top_k",
        e.top_k,
        f"must be <= moe.topk_groups * experts per group = {reachable}",
    )
    for name in ("aux_loss_coef", "seq_aux_loss_coef", "z_loss_coef", "bias_update_rate"):
        _check(getattr(e, name) >= 0, f"moe.{name}", getattr(e, name), "must be >= 0")

    _positive(t, "train", "steps", "batch_size", "seq_len", "learning_rate", "log_every")
    _positive(t, "train", "grad_accum", "eval_batches", "keep_checkpoints", "max_bad_steps")
    _check(
        t.batch_size % t.grad_accum == 0,
        "train.grad_accum",
        t.grad_accum,
        f"must divide train.batch_size={t.batch_size}",
    )
    _check(t.schedule in SCHEDULES, "train.schedule", t.schedule, f"valid: {SCHEDULES}")
    _check(0 <= t.min_lr_ratio <= 1, "train.min_lr_ratio", t.min_lr_ratio, "must be in [0, 1]")
    _check(t.wandb in WANDB, "train.wandb", t.wandb, f"valid: {WANDB}")
    _check(t.upcycle in UPCYCLE, "train.upcycle", t.upcycle, f"valid: {UPCYCLE}")
    _check(
        t.upcycle == "none" or bool(t.init_from),
        "train.upcycle",
        t.upcycle,
        "upcycles the model of train.init_from, which is not set",
    )
    for name in ("warmup_steps", "weight_decay", "eval_every", "checkpoint_every", "eps"):
        _check(getattr(t, name) >= 0, f"train.{name}", getattr(t, name), "must be >= 0")
    _check(t.grad_clip >= 0, "train.grad_clip", t.grad_clip, "must be >= 0 (0 disables)")
    _check(
        t.memory_limit_gb >= 0,
        "train.memory_limit_gb",
        t.memory_limit_gb,
        "must be >= 0 (0: the device's own limit)",
    )
    _check(
        t.loss_chunks >= 0 and (t.loss_chunks == 0 or t.seq_len % t.loss_chunks == 0),
        "train.loss_chunks",
        t.loss_chunks,
        f"must be 0 (automatic) or divide train.seq_len={t.seq_len}",
    )
    config_rules.validate_mtp(config)
    config_rules.validate_optimizer(config)

    d = config.data
    _check(d.source in DATA_SOURCES, "data.source", d.source, f"valid: {DATA_SOURCES}")
    config_sources.validate(d)
    _check(0 < d.val_fraction < 1, "data.val_fraction", d.val_fraction, "must be in (0, 1)")
    config_rules.validate_documents(config)
    config_rules.validate_parallel(config.parallel)
    config_rules.check_meaningful(config)


def _validate_attention_impl(m: ModelConfig) -> None:
    """What any platform allows (the platform is checked with the plan, in
    `moe_jax.parallel.registry.problems`)."""
    found = requirements.attention_problems(m.attention_impl, m.dtype)
    if found:
        raise ValueError(found[0])


def _validate_moe_impl(e: MoEConfig) -> None:
    """`tokamax` needs its optional package (found here; imported with the plan)."""
    if e.impl == "tokamax" and not requirements.tokamax_installed():
        raise ValueError(requirements.TOKAMAX_MISSING)


def profile_steps(profile: ProfileConfig) -> tuple[int, int] | None:
    """The [start, stop) steps to trace, or None when profiling is off."""
    return config_rules.profile_steps(profile.steps)
