"""Bytes one device holds while training under a plan: model state and stored activations.

Why: a layout that is fast but does not fit is no plan. The planner ranks
layouts by time only among those whose `Memory.total` fits the device.

Model state is exact: the arrays of the `TrainState` (traced abstractly, so any model
change is followed) placed as `train_state_shardings` places them (`state_arrays`).
Activations are an analytic count of what the backward pass keeps (see
`block_activation_bytes`), checked against XLA's buffer assignment in
tests/test_plan_memory.py.
"""

from __future__ import annotations

import dataclasses
import functools

from moe_jax.config import Config
from moe_jax.model.loss import loss_chunks
from moe_jax.model.mtp import is_moe
from moe_jax.moe.experts import kernel_of
from moe_jax.parallel import registry
from moe_jax.parallel.layout import DATA, INTRA
from moe_jax.parallel.pipeline_1f1b import sums_in_loop
from moe_jax.parallel.pipeline_schedule import loop_sums, tick_table
from moe_jax.plan import memory_experts, memory_mla, muon_cost
from moe_jax.plan.comm_volume import DTYPE_BYTES
from moe_jax.plan.state_arrays import device_bytes, state_arrays, state_bytes, units

FP32 = 4


@dataclasses.dataclass(frozen=True)
class Memory:
    """Bytes on one device (the worst pipeline stage).

    params: parameters and router biases; grads: one gradient per parameter,
    placed like it (two with several micro-batches: the step's sum and the current
    micro-batch's); optimizer: AdamW's two moments and counts, the step
    counter and the RNG key; activations: what the forward keeps for the
    backward, for every micro-batch in flight, or under Muon the update's blocks of
    whole matrices where they are more (`muon_cost.update_bytes`: held after the
    backward has freed the activations).
    """

    params: int
    grads: int
    optimizer: int
    activations: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations


# ---------------------------------------------------------------- activations


@dataclasses.dataclass(frozen=True)
class _Sizes:
    """Per-device sizes of one micro-batch."""

    b: int  # sequences per data-parallel group
    s: int
    h: int
    n: int
    B: int  # bytes of the compute dtype

    @property
    def t(self) -> int:
        """Tokens per device between blocks (every layout splits a group's tokens n ways)."""
        return self.b * self.s // self.n


def _sizes(config: Config, micro_batch: int | None) -> _Sizes:
    p, t = config.parallel, config.train
    if p.data < 1 or p.experts == "auto":
        raise ValueError("memory_per_device needs a resolved plan (see moe_jax.plan.resolve)")
    b = micro_batch if micro_batch is not None else t.batch_size // (p.data * config.micro_batches)
    m = config.model
    return _Sizes(b=b, s=t.seq_len, h=m.embed_dim, n=p.intra, B=DTYPE_BYTES[m.dtype])


def _attention_terms(config: Config, z: _Sizes) -> dict[str, int]:
    """Stored by one attention block (with its norm); MLA's in `memory_mla`."""
    m, spec = config.model, registry.attention_spec(config)
    if m.attention == "mla":
        return memory_mla.attention_terms(config, z)
    a, kv, hd, n = m.num_heads, m.num_kv_heads, m.head_dim, z.n
    if not spec.heads_split:
        seqs, heads, kv_heads, proj_tokens, out_width = z.b // n, a, kv, z.t, a
    else:  # tp and sp attend over whole sequences for a/n heads
        kv_heads = kv // n if kv % n == 0 else 1
        seqs, heads = z.b, a // n
        proj_tokens, out_width = (z.b * z.s, a // n) if spec.gathers_sequence else (z.t, a)
    if spec.weights_over == DATA:  # gathered whole for the block's backward
        cast = z.h * (2 * a + 2 * kv) * hd * z.B
    elif spec.weights_over == INTRA:  # a/n query heads; the kv heads it uses (sliced when K < n)
        cast = z.h * (2 * heads + 2 * kv_heads) * hd * z.B
        cast = cast if z.B != FP32 else (2 * z.h * hd * FP32 if kv % n else 0)
    else:  # the cast copies of whole weights (float32 reads the parameters themselves)
        cast = z.h * (2 * a + 2 * kv) * hd * z.B if z.B != FP32 else 0
    if m.attention_impl == "xla":  # the float32 softmax and B-byte probabilities, [s, s] each
        scores = seqs * heads * z.s * (z.s * (FP32 + z.B) + 2 * FP32)
    else:  # flash attention (blockwise, cudnn): each row's float32 logsumexp, and its
        # output where an exchange follows (sp); elsewhere that is attention_out itself
        exchanged = spec.heads_split and not spec.gathers_sequence
        scores = seqs * heads * z.s * (FP32 + (hd * z.B if exchanged else 0))
    return {
        "norm": z.t * (2 * z.h + 2) * FP32 + proj_tokens * z.h * z.B,
        "qkv": seqs * z.s * (heads + 2 * kv_heads) * hd * z.B,
        "scores": scores,
        "attention_out": proj_tokens * out_width * hd * z.B,
        "attention_weights": cast,
    }


def _mlp_terms(config: Config, z: _Sizes, width: int) -> dict[str, int]:
    """Stored by a SwiGLU MLP of `width` hidden columns (dense layer or shared experts)."""
    spec = registry.attention_spec(config)
    tokens = z.b * z.s if spec.gathers_sequence else z.t
    split = z.n if spec.weights_over == INTRA else 1
    weights = 3 * z.h * width
    if spec.weights_over == DATA:
        cast = weights * z.B
    else:
        cast = weights // split * z.B if z.B != FP32 else 0
    return {
        "mlp_input": tokens * z.h * z.B,
        "mlp_hidden": 6 * tokens * (width // split) * z.B,
        "mlp_weights": cast,
    }


def _router_terms(tokens: int, z: _Sizes, e: int, k: int) -> dict[str, int]:
    """Routing and combine of `tokens` tokens: scores [T, E] twice, softmax and top-k
    bookkeeping, renormalised weights, combine indices, weights and gathered rows."""
    return {
        "moe_input": tokens * z.h * FP32,  # as the router reads it; dispatch needs indices
        "router": tokens * (8 * e + 17 * k + 25),
        "combine_rows": tokens * k * z.h * z.B,
    }


def block_activation_bytes(
    config: Config, moe: bool, micro_batch: int | None = None
) -> dict[str, int]:
    """Bytes one block (attention + dense MLP, or attention + MoE) stores on one device
    for the backward pass of one micro-batch, by tensor: what JAX saves as residuals
    of the scanned layer (matched to jax.ad_checkpoint.print_saved_residuals within
    0.1%) and XLA keeps (tests/test_plan_memory.py).

    Symbols, per device: b sequences of length s per data group, t = b·s/n tokens
    between blocks, h = embed_dim, B = bytes of model.dtype (norms, softmaxes and
    the router stay float32: 4). Attention runs on `seqs` whole sequences with
    `heads` query and `kv` key/value heads of width d: dp/fsdp b/n, a, K; tp/sp b,
    a/n, K/n (or the one kv head it uses when K < n).

      norms      t·(2h+2)·4 each (float32 input and normalised value, two statistics)
                 + the projections' input t·h·B (tp: the gathered b·s·h·B)
      q, k, v    seqs·s·(heads + 2·kv)·d·B after rotary (sp: after the exchange)
      scores     model.attention_impl='xla': seqs·heads·s·(s·(4+B) + 8), the float32
                 softmax and B-byte probabilities [s, s] each; blockwise and cudnn
                 (flash attention): seqs·heads·s·4, each row's logsumexp, plus their
                 output seqs·s·heads·d·B under sp (before its exchange back)
      out        the out-projection's input t·a·d·B (tp: b·s·(a/n)·d·B)
      weights    fsdp: the gathered weights; bf16: each layer's cast copy of its shard
      MoE        T routed tokens (ep_a2a: t; all-gather forms: the group's n·t):
                 router input T·h·4, routing T·(8E+17k+25), combine rows T·k·h·B;
                 R expert rows of width h and 6 hidden [R, f_l] (gate, up, silu's
                 parts, product) at B bytes, where R = T·k static rows (all-gather
                 forms: every gathered assignment, not just the local ones; ep_a2a:
                 the n·t·k received rows, n·slots, or fewer with
                 parallel.a2a_buffer_factor; `tiled` pads each expert to a
                 tile; the weights are copied only when cast to bf16)
      dense MLP  input t·h·B and 6 hidden t·w·B (tp: b·s·h·B and 6·b·s·(w/n)·B)

    The paper counts (2n+2k+3kf+12+5/m)·b·s·h/n bytes per layer (bf16; f = h_ffn/h,
    m = a/K; a coefficient of 2 is one bf16 tensor of t·h elements): 12 + 5/m for
    norms and attention tensors, 2n for the gathered n·t tokens, 2k for the t·k
    dispatched rows of balanced routing and 3kf for the expert hidden. Ours is what
    this code keeps, larger in four ways: the [s, s] scores (the paper assumes
    flash attention), static expert buffers n times the balanced t·k rows (both EP
    forms, dropless), six hidden tensors where the paper has 1.5, and bf16 weight
    copies saved per layer. Mixtral-8x7B's layer at s=4096, b=1, n=8, bf16,
    sp+ep_a2a with ragged_dot: paper 108 MiB, ours 2.2 GiB (scores 0.4 GiB, expert
    hidden 1.3 GiB, expert weight copy 0.3 GiB).
    """
    z = _sizes(config, micro_batch)
    m, e = config.model, config.moe
    terms = _attention_terms(config, z)
    terms["ffn_norm"] = z.t * (2 * z.h + 2) * FP32
    if not moe:
        for key, value in _mlp_terms(config, z, m.mlp_dim).items():
            terms[key] = value
        return terms
    rows = memory_experts.routed_rows(config, z)
    if not registry.expert_spec(config).gathers_tokens:
        terms["exchange"] = rows.tokens * 12  # received expert ids, row indices, weights
    terms.update(_router_terms(rows.routed, z, e.num_experts, e.top_k))
    terms.update(memory_experts.expert_terms(config, z, rows))
    if e.num_shared_experts:
        width = e.num_shared_experts * e.shared_mlp_dim
        shared = _mlp_terms(config, z, width)
        terms.update({f"shared_{k}": v for k, v in shared.items()})
    return terms


def piece_gradient_bytes(config: Config, micro_batch: int | None = None) -> int:
    """The `tiled` kernel's float32 weight-gradient accumulators beyond the one the
    layer's own gradient is, in the backward of an expert block computed in P > 1
    pieces (`memory_experts.expert_pieces`): every piece's backward accumulates its own
    gradient of the local gate, up and down weights, (P - 1)·3·E_l·h·f_l·4, and XLA makes all P
    zeroed accumulators before the first piece's backward runs (one zero broadcast,
    copied per loop; tests/test_plan_memory.py, the 'rings' Mixtral plan: 96
    f32[8, 4096, 1792] live at the peak). Part of the backward's working set, once."""
    e = config.moe
    if kernel_of(e) != "tiled":
        return 0
    z = _sizes(config, micro_batch)
    pieces = memory_experts.expert_pieces(config, z)
    expert, tensor = registry.expert_split(config)
    f_local = e.expert_mlp_dim // tensor
    return (pieces - 1) * 3 * (e.num_experts // expert) * z.h * f_local * FP32


def _head_bytes(config: Config, z: _Sizes) -> int:
    """Final norm, head and cross-entropy of the last stage: the norm's float32 terms,
    the head's input t·h·B, and the float32 softmax of one loss chunk's logits t·V·4/C
    (C = the loss's chunks; C = 1: all of them) plus the labels."""
    chunks = loss_chunks(config, z.b * config.parallel.data, z.s)  # the whole micro-batch
    logits = z.t * config.model.vocab_size * 4 // chunks
    once = z.t * (2 * z.h + 2) * FP32 + z.t * z.h * z.B + logits + z.t * 3 * 4
    return once * (1 + config.model.mtp_depth)  # each MTP module's loss reads the head too


def mtp_table_gradient_bytes(config: Config) -> int:
    """Float32 gradients of the embedding table and the head that each MTP module's
    lookup and loss make apart from the main ones before they are summed, in the
    backward's working set: model.mtp_depth x (table + head) as placed (DeepSeek-V3 at
    full width, 1 MTP module, 64 devices: XLA's temporaries grow by 7.1 GB with the
    module beyond its weights' gradient and activations; these are 7.4 GB)."""
    depth = config.model.mtp_depth
    if not depth:
        return 0
    tables = (".params['embed']['table']", ".params['head']")
    arrays = [a for a in state_arrays(config) if a.path in tables]
    return depth * sum(device_bytes(config, a) for a in arrays)


def mtp_units(config: Config) -> list[tuple[str, int]]:
    """The model.mtp_depth MTP modules as units of one block each (dense or MoE as
    `mtp.is_moe` says): they run after the stack, under model.remat, on the last stage
    (under the trainer's pipeline, outside it, as the dense prefix and the head)."""
    m = config.model
    return [("moe" if is_moe(m, k) else "dense", 1) for k in range(1, m.mtp_depth + 1)]


def selective_block_bytes(config: Config, moe: bool, micro_batch: int | None = None) -> int:
    """Bytes one block keeps under model.remat='selective' (`moe_jax.model.remat`): its
    output t·h·B, the residual entering the FFN t·h·B, q/k/v, the attention core's
    statistics (and output under sp) and the out-projection's input, the rows the
    experts receive, fc1/fc3 (2 of the 6 hidden tensors) and fc2's rows; dense MLPs
    and shared experts keep fc1/fc3. Everything else is rebuilt in the backward."""
    z = _sizes(config, micro_batch)
    terms = block_activation_bytes(config, moe, micro_batch)
    flash = config.model.attention_impl != "xla"  # the xla core is recomputed whole
    kept = 2 * z.t * z.h * z.B + terms["qkv"] + terms["attention_out"]
    kept += memory_mla.latent_bytes(config, z) if config.model.attention == "mla" else 0
    kept += terms["scores"] if flash else 0
    kept += sum(terms.get(k, 0) for k in ("mlp_hidden", "shared_mlp_hidden")) // 3
    if moe:
        hidden = terms["expert_hidden"]
        f_local = config.moe.expert_mlp_dim // registry.expert_split(config)[1]
        rows = hidden // (6 * f_local * z.B)  # the (tile-padded) rows fc1..fc2 run on
        received = (
            terms["exchange"] // 12 if "exchange" in terms else terms["moe_input"] // (z.h * FP32)
        )
        kept += hidden // 3 + rows * z.h * z.B + received * z.h * z.B
    return kept


@functools.lru_cache(maxsize=1 << 12)  # a stage's units are mostly alike
def unit_activation_bytes(
    config: Config, unit: tuple[str, int], micro_batch=None, selective: bool = False
) -> int:
    """Stored activations of one scanned unit: its dense blocks and, for an MoE unit, its
    MoE block (`selective`: what model.remat='selective' keeps of them)."""
    kind, layers = unit
    if selective:
        block = lambda moe: selective_block_bytes(config, moe, micro_batch)
    else:
        block = lambda moe: sum(block_activation_bytes(config, moe, micro_batch).values())
    if kind == "dense":
        return block(False) * layers
    return block(False) * (layers - 1) + block(True)


def stage_activation_bytes(
    config: Config, stage: list, last: bool, micro_batch: int | None = None
) -> tuple[int, int]:
    """(kept, working): activations one micro-batch keeps on a stage until its backward,
    and the working set of the backward itself, needed once however many micro-batches
    are in flight. With model.remat='full' each unit runs under jax.checkpoint: only
    its input x [t, h] is kept, and the backward recomputes one unit at a time,
    holding that unit's activations. With 'selective' (and 'offload', whose kept
    tensors wait in host memory) each unit keeps its named tensors and the backward
    rebuilds the rest of one unit at a time. An MoE stage's backward also holds
    `piece_gradient_bytes`, `gathered_expert_bytes` and the kernel's input-gradient
    buffers (`memory_experts.backward_bytes`), in every mode."""
    z = _sizes(config, micro_batch)
    per_unit = [unit_activation_bytes(config, unit, micro_batch) for unit in stage]
    head = _head_bytes(config, z) if last else 0
    moe = any(kind == "moe" for kind, _ in stage)
    pieces = piece_gradient_bytes(config, micro_batch)
    pieces += memory_experts.gathered_expert_bytes(config)
    pieces += memory_experts.backward_bytes(config, z)
    pieces = pieces if moe else 0
    remat = config.model.remat
    if remat == "full":
        return len(stage) * z.t * z.h * z.B + head, max(per_unit, default=0) + pieces
    if remat in ("selective", "offload"):
        kept = [unit_activation_bytes(config, u, micro_batch, selective=True) for u in stage]
        rebuilt = max((a - k for a, k in zip(per_unit, kept, strict=True)), default=0)
        on_device = sum(kept) if remat == "selective" else 0
        return on_device + head, rebuilt + pieces
    return sum(per_unit) + head, pieces


def micro_batches(config: Config, micro_batch: int | None = None) -> int:
    """Micro-batches per step: batch_size / (data x micro_batch); grad_accum by default."""
    p, t = config.parallel, config.train
    if micro_batch is None:
        return t.grad_accum
    return max(1, t.batch_size // (p.data * micro_batch))


def memory_per_device(config: Config, pp: int = 1, micro_batch: int | None = None) -> Memory:
    """Memory of the worst device of a resolved plan (parallel.data >= 1, experts chosen).

    `micro_batch` is the sequences of one micro-batch per data-parallel group
    (default batch_size / (data x grad_accum), or / (data x parallel.microbatches) under
    a pipeline). `pp` > 1 (or `parallel.stages` > 1) is the trainer's pipeline
    (`pipeline_activation_bytes`): every stage holds 1/pp of the MoE layer stack and all
    of the rest (embedding, dense prefix, final norm, head).
    """
    _sizes(config, micro_batch)  # validates the plan
    if pp > 1 and config.parallel.stages == 1:  # planned for pp stages: the trainer's form
        parallel = dataclasses.replace(config.parallel, stages=pp)
        config = dataclasses.replace(config, parallel=parallel)
    if config.parallel.stages > 1:
        return _pipeline_memory(config, config.parallel.stages, micro_batch)
    in_flight = micro_batches(config, micro_batch)
    stage = units(config) + mtp_units(config)
    state = state_bytes(config)
    if in_flight > 1:  # the sum and one micro-batch's (the compute copy's dtype under ZeRO-2)
        each = DTYPE_BYTES[config.model.dtype] if config.parallel.zero == 2 else FP32
        state["grads"] += state["grads"] * each // FP32
    kept, working = stage_activation_bytes(config, stage, True, micro_batch)
    working += mtp_table_gradient_bytes(config)
    update = int(muon_cost.update_bytes(config))
    return Memory(**state, activations=max(kept * min(1, in_flight) + working, update))


def _split_units(config: Config) -> tuple[list, list]:
    """(the units outside the pipeline: the dense prefix; the pipelined MoE units)."""
    every, prefix = units(config), config.model.first_k_dense
    return every[:prefix], every[prefix:]


def pipeline_activation_bytes(
    config: Config, stages: int, micro: int, repeats: int, micro_batch: int
) -> dict[str, int]:
    """Activations one device holds under the trainer's pipeline (`moe_jax.parallel.
    pipeline`: GPipe, circular repeats, each tick rematerialised), a = t·h·B the stream
    of one micro-batch on one device:

    * GPipe: tick_inputs, (M R + S - 1) a, every tick's input, kept for its recompute;
      buffer, M a, stage 0's micro-batches (then their cotangents); outside, what the
      dense prefix (and, per micro-batch, the MTP modules) keeps for the K = M / S
      micro-batches each stage runs outside the pipeline (one batch of K b sequences);
      working, one tick's backward (its group's units recomputed under model.remat,
      then one unit's backward) or the outside part's backward with the head and loss
      of the K micro-batches (a loss chunk's float32 logits and their gradient);
    * 1F1B: in_flight, the table's slots (`pipeline_schedule`: bounded by S and R);
      token_ids, the M micro-batches' token ids and targets; working, one tick's
      backward, or the head (embedding, dense prefix) or tail of one micro-batch;
      summed_parts, where the loop sums the stack's gradients in its drain, the part
      a tick sums and its sum (`loop_sum_bytes`);
    * zero-bubble: 1F1B's, and the stash of the items whose W waits (`pipeline_schedule.
      zero_bubble`: about S), with the item being made and the one being read
      (`stash_item_bytes`).

    Per micro-batch of M the device holds (R + 1) a more under GPipe, token ids only
    under 1F1B (tests/test_pipeline_state.py measures both in XLA's buffer assignment)."""
    z = _sizes(config, micro_batch)
    a = z.t * z.h * z.B
    k = micro // stages
    outside, piped = _split_units(config)
    group = piped[: len(piped) // (repeats * stages)]
    kept_g, working_g = stage_activation_bytes(config, group, False, micro_batch)
    kept_o, working_o = stage_activation_bytes(config, outside, False, k * micro_batch)
    # the MTP modules run one micro-batch at a time (`mtp.losses`; 1F1B: in the loop)
    kept_m, working_m = stage_activation_bytes(config, mtp_units(config), False, micro_batch)
    tables = mtp_table_gradient_bytes(config)

    def head(z: _Sizes) -> int:  # its backward holds a loss chunk's logits and gradient
        chunks = loss_chunks(config, z.b * config.parallel.data, z.s)
        return _head_bytes(config, z) + z.t * config.model.vocab_size * FP32 // chunks

    if config.parallel.schedule != "gpipe":  # head and tail of one micro-batch per tick
        p = config.parallel
        table = tick_table(p.schedule, stages, micro, repeats, p.stash_depth)
        kept_p, working_p = stage_activation_bytes(config, outside, False, micro_batch)
        working = max(kept_g + working_g, kept_m + working_m + head(z) + tables, kept_p + working_p)
        # the M micro-batches' token ids, targets, MTP tokens, targets and weights
        ids = (2 + 3 * config.model.mtp_depth) * micro * z.t * 4
        in_flight = (table.slots + table.gradient_slots) * a
        parts = loop_sum_bytes(config, table)
        # zero-bubble: the stash's slots, the item the tick's B makes and the one its W
        # reads (XLA keeps both beside the buffer)
        item = stash_item_bytes(config, group, micro_batch)
        stash = (table.stash_slots + 2) * item if table.stash_slots else 0
        return {
            "in_flight": in_flight, "token_ids": ids, "working": working,
            "summed_parts": parts, "stash": stash,
        }  # fmt: skip
    kept_o, working_o = kept_o + k * kept_m, max(working_o, working_m)
    working = max(kept_g + working_g, working_o + head(_sizes(config, k * micro_batch)) + tables)
    ticks = (micro * repeats + stages - 1) * a
    return {"tick_inputs": ticks, "buffer": micro * a, "outside": kept_o, "working": working}


# What zero-bubble's W does not read of a block's stored tensors: attention's internals,
# the weights' copies and routing's bookkeeping.
NOT_READ_BY_W = (
    "scores", "attention_weights", "mlp_weights", "expert_weights", "shared_mlp_weights",
    "router", "exchange", "combine_rows",
)  # fmt: skip


def stash_item_bytes(config: Config, group: list, micro_batch: int | None = None) -> int:
    """What one zero-bubble B keeps for its W on one device (`moe_jax.parallel.
    backward_halves`): each weight GEMM's input and output gradient for the group's
    layers. Of a block's stored tensors (`block_activation_bytes`) those W reads: the
    projections' and norms' inputs, q, k, v and attention's output, the routed rows and
    three of the six hidden tensors; plus the output gradients of the projections
    (t·h·B), of the MLP's and experts' down projections (as large as their inputs)."""
    z = _sizes(config, micro_batch)
    total = 0
    for kind, layers in group:
        blocks = [False] * layers if kind == "dense" else [False] * (layers - 1) + [True]
        for moe in blocks:
            terms = block_activation_bytes(config, moe, micro_batch)
            read = {k: v for k, v in terms.items() if k not in NOT_READ_BY_W}
            for hidden in ("mlp_hidden", "expert_hidden", "shared_mlp_hidden"):
                read[hidden] = read.get(hidden, 0) // 2
            ins = ("expert_rows", "mlp_input", "shared_mlp_input")
            total += sum(read.values()) + z.t * z.h * z.B + sum(read.get(k, 0) for k in ins)
    return total


def loop_sum_bytes(config: Config, table) -> int:
    """What a drain tick of the 1F1B loop holds to sum one part of the stack's gradients
    (`moe_jax.parallel.pipeline_1f1b`): the part, read before the tick adds into the
    accumulators, and its sum; 1 / (R C) of the stack's gradients each (C parts per
    repeat, `pipeline_schedule.loop_sums`). 0 where the loop sums nothing."""
    p = config.parallel
    sums = loop_sums(table) if sums_in_loop(p.schedule, p.zero) else None
    if sums is None:
        return 0
    arrays = [a for a in state_arrays(config) if a.part == "params" and a.stack == "moe"]
    stack = sum(device_bytes(config, a, master=False) for a in arrays)
    return 2 * stack // (table.repeats * sums.chunks)


def _pipeline_memory(config: Config, stages: int, micro_batch: int | None) -> Memory:
    p, t = config.parallel, config.train
    micro = p.microbatches if micro_batch is None else t.batch_size // (p.data * micro_batch)
    micro = max(micro, stages)  # a config planned for `pp` stages without its micro-batches
    micro_batch = micro_batch or t.batch_size // (p.data * micro)
    state = state_bytes(config)
    repeats = p.repeats if p.stages > 1 else 1
    terms = pipeline_activation_bytes(config, stages, micro, repeats, micro_batch)
    return Memory(
        **state, activations=max(sum(terms.values()), int(muon_cost.update_bytes(config)))
    )
