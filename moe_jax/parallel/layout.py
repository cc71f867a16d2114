"""A model's layout as data: which spec runs each block kind, on which mesh.

Model code calls `layout.attention(...)`, `layout.mlp(...)` and `layout.moe(...)`
and never asks which layout it is in. `Layout()` (no mesh)
is the single-device layout; `moe_jax.parallel.mesh.make_layout` builds the others
from a resolved plan and the specs in `moe_jax.parallel.registry`.

The mesh always has four axes, ('stage', 'data', 'expert', 'tensor'): `stage`
pipeline stages (outermost, across nodes; 1 without a pipeline), each `data`
data-parallel groups of an intra-node group of n = expert * tensor devices.
Attention and dense blocks use the intra group as one axis (`INTRA`); expert
blocks split experts over 'expert' and each expert's width over 'tensor'.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from moe_jax.moe.dispatcher import TokenDispatcher
from moe_jax.parallel import layer_sync, peaks
from moe_jax.parallel.mesh_axes import ALL, INTRA, STAGE
from moe_jax.parallel.mesh_axes import DATA as DATA  # the axis names, also from here
from moe_jax.parallel.mesh_axes import EVERY as EVERY
from moe_jax.parallel.mesh_axes import EXPERT as EXPERT
from moe_jax.parallel.mesh_axes import MESH_AXES as MESH_AXES
from moe_jax.parallel.mesh_axes import TENSOR as TENSOR
from moe_jax.parallel.scopes import DOCUMENT_POSITIONS
from moe_jax.parallel.spec import AttentionSpec, ExpertSpec, VocabSpec


def axes_of(entry) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry: None, one axis, or a tuple of them."""
    return () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))


def split_size(entry, sizes) -> int:
    """Devices one dimension placed by `entry` is split over (`sizes`: the mesh's)."""
    return math.prod(sizes[a] for a in axes_of(entry))


def take_along(weights, axes, name: str, start, size: int):
    """`weights` with each dimension whose logical axis is `name` cut to
    [start, start + size): one device's heads out of whole attention weights."""

    def take(w: jax.Array, names: tuple) -> jax.Array:
        if name not in names:
            return w
        return jax.lax.dynamic_slice_in_dim(w, start, size, axis=names.index(name))

    return jax.tree.map(take, weights, axes, is_leaf=lambda t: isinstance(t, tuple))


def local_attention_block(layout: Layout, block, x, positions, weights, axes, attend):
    """The attention block where it stands: one device, or batch-split under GSPMD."""
    return block(x, positions, weights, attend)


def local_mlp(layout: Layout, block, x, weights, axes):
    return block(x, weights)


def local_moe(layout: Layout, forward, x: jax.Array, params, cfg):
    """All experts on all tokens of the call, on one device."""
    return forward(x, params, cfg, TokenDispatcher(cfg))


# Plain data parallelism: the batch over every device, weights replicated, GSPMD
# differentiates the blocks. On one device it is the single-device layout.
DP = AttentionSpec(
    name="dp",
    attention=local_attention_block,
    mlp=local_mlp,
    batch_axes=ALL,
    attention_in_shard_map=False,
    mlp_in_shard_map=False,
)
LOCAL_EXPERTS = ExpertSpec(name="local", block=local_moe, dispatcher=TokenDispatcher)


class Parts(NamedTuple):
    """What a pipeline that runs the loss runs (`Layout.stack_loss`):
    `run_group(params, rest, x, positions) -> (y, stats)` as `Layout.stack` takes it,
    `tail(tail_params, y, data) -> (loss, metrics)` on one micro-batch's stack output
    and its part of the data (the loss carries the gradient, the metrics are
    averaged), `stats_loss(stats)`, the loss's MoE terms (linear in the statistics),
    and `prefix(prefix_params, tokens, positions) -> (x, peaks)`, the stack's input (the
    embedding and the dense layers before the stack) of the micro-batches given, and the
    dense layers' attention peaks (`moe_jax.parallel.peaks`; None where not tracked)."""

    run_group: Callable
    tail: Callable
    stats_loss: Callable
    prefix: Callable


@dataclasses.dataclass(frozen=True)
class Layout:
    """How each block kind runs. Hashable, so it can live in the model graph.

    `param_rules` maps logical parameter axes to mesh axes (anything unnamed is
    replicated); the block functions read their weights' specs from it.
    """

    mesh: jax.sharding.Mesh | None = None
    attention_spec: AttentionSpec = DP
    expert_spec: ExpertSpec = LOCAL_EXPERTS
    param_rules: tuple[tuple[str, str | tuple[str, ...]], ...] = ()
    # The table and head split over the vocabulary (`moe_jax.parallel.vocab_parallel`);
    # None: whole, and the embedding and loss run where the tokens are.
    vocab_spec: VocabSpec | None = None
    # parallel.a2a_buffer_factor: the all-to-all dispatchers' buffer rows (0: worst case).
    a2a_buffer_factor: float = 0.0
    # parallel.overlap_chunks: independent chunks of each expert block's tokens.
    overlap_chunks: int = 1
    # parallel.collective_matmul: exchanges cut into n-1 point-to-point steps, each
    # overlapping the GEMM on the block at hand (`moe_jax.parallel.collective_matmul`).
    collective_matmul: bool = False
    # parallel.token_dtype: 'fp8' sends token movements as E4M3 with scales
    # (`moe_jax.parallel.fp8_exchange.token_collective`).
    token_dtype: str = "native"
    # parallel.grad_exchange: 'bf16_a2a' sums the gradients reduced over devices as bf16
    # shards in float32 (`moe_jax.parallel.grad_exchange`), FSDP gathers' included.
    grad_exchange: str = "fp32"
    # A pipeline over the 'stage' axis (`moe_jax.parallel.pipeline.run`) with
    # parallel.microbatches and parallel.repeats; None: no pipeline.
    pipeline_run: Callable | None = None
    # parallel.schedule='1f1b' or 'zero_bubble': the pipeline that also runs the head and
    # the loss, with the backward interleaved (`moe_jax.parallel.pipeline_1f1b.run_loss`);
    # None: the stack alone through `pipeline_run` (GPipe), the loss after it.
    pipeline_loss: Callable | None = None
    schedule: str = "gpipe"
    stash_depth: int = 0  # parallel.stash_depth (`pipeline_schedule.zero_bubble`)
    microbatches: int = 1
    repeats: int = 1
    # parallel.zero: 2 is the distributed optimizer (`moe_jax.parallel.distributed_optimizer`):
    # the step gathers its compute weights from sharded float32 masters and
    # reduce-scatters the gradients back to them.
    zero: int = 0
    # The blocks traced as per-device bodies inside the step's one shard_map over the
    # mesh (`moe_jax.parallel.per_device_step`, which sets it on the model it runs):
    # every array is then already one device's piece, so a block's own shard_map is a
    # plain call of its body and a loss is one device's share.
    per_device: bool = False
    # data.document_mask on a source with documents: the batch's positions restart at
    # each document and attention stays within one (`moe_jax.data.documents`).
    documents: bool = False
    # train.qk_clip: attention blocks also return each head's peak logit
    # (`moe_jax.parallel.peaks`), for the clip after the update (`moe_jax.qk_clip`).
    track_peaks: bool = False

    @property
    def stages(self) -> int:
        return 1 if self.mesh is None else self.mesh.shape.get(STAGE, 1)

    @property
    def pipelined(self) -> bool:
        """Whether the MoE stack runs as a pipeline over 'stage' (`stack`)."""
        return self.pipeline_run is not None

    def stack(self, run_group, params, biases, x, positions):
        """`run_group(params, biases, x, positions) -> (y, stats)` (stacked layers, stats
        stacked over them) over the pipelined layer stack: as a pipeline over the 'stage'
        axis where there is one, else on the whole stack at once."""
        if not self.pipelined:
            return run_group(params, biases, x, positions)
        return self.pipeline_run(self, run_group, params, biases, x, positions)

    @property
    def loss_in_pipeline(self) -> bool:
        """Whether the pipeline runs the head and the loss too (`stack_loss`)."""
        return self.pipelined and self.pipeline_loss is not None

    def stack_loss(
        self, parts: Parts, params, biases, tokens, positions, prefix_params, tail_params, data
    ):
        """(objective, metrics, stats): `parts.prefix` on each micro-batch of `tokens`, the
        pipelined stack as `stack` runs it, then `parts.tail` on that micro-batch's
        part of `data`, where `loss_in_pipeline`. The objective carries the gradient;
        its mean over devices is the loss; the tail's metrics are their means over the
        micro-batches."""
        args = (params, biases, tokens, positions, prefix_params, tail_params, data)
        return self.pipeline_loss(self, parts, *args)

    @staticmethod
    def layer_weights(params):
        """One layer's slice of a stack's parameters (inside its scan) as the layer reads
        them; where the step reduces gradients inside the backward, the weights whose
        backward does so (`moe_jax.parallel.layer_sync`)."""
        return layer_sync.layer_weights(params)

    def block_map(self, body, in_specs, out_specs):
        """`body` run per device by a shard_map over the mesh with these specs; inside the
        step-wide shard_map (`per_device`) the body itself, since its arguments are
        already the per-device pieces those specs describe. An attention block whose
        peak logits are recorded (`moe_jax.parallel.peaks`) returns them too, each
        head's maximum over the mesh, and records them outside."""
        if peaks.recording_now():
            n = self.size(INTRA) if self.attention_spec.heads_split else 1
            body = peaks.returning(body, INTRA, n)
            return peaks.recorded(self._map(body, in_specs, (out_specs, P())))
        return self._map(body, in_specs, out_specs)

    def _map(self, body, in_specs, out_specs):
        if self.per_device:
            return body
        return jax.shard_map(body, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs)

    def positions(self, tokens: jax.Array, given: jax.Array | None = None) -> jax.Array:
        """Sequence positions of `tokens` [b, s]: as the attention blocks are handed them.
        Per device (inside the step-wide shard_map) that is the device's own block of
        positions, or the whole sequence for a layout whose blocks gather it. Under
        `documents`: `given` (the batch's per-document positions; 0, 1, 2, ... for a
        batch without them), handed whole-sequence wherever the sequence is split,
        gathered here once per step."""
        if self.documents:
            with jax.named_scope(DOCUMENT_POSITIONS):
                return self._document_positions(tokens, given)
        b, s = tokens.shape
        start = 0
        if self.per_device and self.seq_axes:
            if self.attention_spec.gathers_sequence:
                s *= self.size(self.seq_axes)
            else:
                start = jax.lax.axis_index(self.seq_axes) * s
        return jnp.broadcast_to(start + jnp.arange(s), (b, s))

    def _document_positions(self, tokens: jax.Array, given: jax.Array | None) -> jax.Array:
        split = self.per_device and bool(self.seq_axes)
        if given is None:  # one document per row
            b, s = tokens.shape
            s *= self.size(self.seq_axes) if split else 1
            return jnp.broadcast_to(jnp.arange(s), (b, s))
        if not self.seq_axes:
            return given
        gather = partial(jax.lax.all_gather, axis_name=self.seq_axes, axis=1, tiled=True)
        if split:
            return gather(given)
        # An explicit gather (not a sharding constraint, which XLA would hoist to the
        # step's input where its name scope is lost): comm_report counts it by its scope.
        rows = self.batch_axes or None
        specs = {"in_specs": (P(rows, self.seq_axes),), "out_specs": P(rows, None)}
        return jax.shard_map(gather, mesh=self.mesh, check_vma=False, **specs)(given)

    def microbatched(self, fn, *args):
        """`fn(*args)` -> a tree of means (attention's peaks: maxima), for what runs after
        the pipelined stack but is
        not linear in the batch (multi-token prediction's MoE blocks): under a pipeline,
        run per device on each of its M / S micro-batches (rows split that many ways) in
        turn and averaged, as a one-device run with `train.grad_accum` = M runs it;
        otherwise once on the whole."""
        k = self.microbatches // self.stages if self.pipelined and self.per_device else 1
        if k == 1:
            return fn(*args)
        split = jax.tree.map(lambda a: a.reshape(k, a.shape[0] // k, *a.shape[1:]), args)
        out = jax.lax.map(lambda a: fn(*a), split)
        return peaks.map_stats(lambda o: o.mean(0), lambda o: o.max(0), out)

    # Each block kind runs under a name scope of its own, so the compiled
    # program says which block a collective belongs to.
    def attention(self, block, x, positions, weights, axes, attend):
        """block(x, positions, weights, attend) -> out, run the way this layout runs it.

        `attend(q, k, v)` is causal attention on what one device holds (the model's
        `model.attention_impl`); the layout decides which sequences and heads that is.
        """
        with jax.named_scope("attention"):
            return self.attention_spec.attention(self, block, x, positions, weights, axes, attend)

    def mlp(self, block, x, weights, axes):
        with jax.named_scope("mlp"):
            return self.attention_spec.mlp(self, block, x, weights, axes)

    def moe(self, forward, x: jax.Array, params, cfg):
        """forward(x, params, cfg, dispatcher) -> (y, stats), with this layout's dispatcher."""
        with jax.named_scope("moe"):
            return self.expert_spec.block(self, forward, x, params, cfg)

    def embed(self, table: jax.Array, tokens: jax.Array) -> jax.Array:
        """Rows of the embedding table (as stored, float32) for `tokens` [b, s]."""
        if self.vocab_spec is None:
            return jnp.take(table, tokens, axis=0)
        with jax.named_scope("embed"):
            return self.vocab_spec.embed(self, table, tokens)

    @property
    def chunk_loss(self):
        """(x, head as stored, targets) -> one chunk's summed cross-entropy over vocabulary
        shards, or None when the vocabulary is not split (the plain loss applies)."""
        if self.vocab_spec is None:
            return None
        return partial(self.vocab_spec.cross_entropy, self)

    @property
    def batch_axes(self) -> tuple[str, ...]:
        return self.attention_spec.batch_axes if self.mesh is not None else ()

    @property
    def seq_axes(self) -> tuple[str, ...]:
        return self.attention_spec.seq_axes if self.mesh is not None else ()

    def size(self, axes: str | tuple[str, ...]) -> int:
        return split_size(axes, self.mesh.shape)

    def param_spec(self, names: tuple[str | None, ...]) -> P:
        rules = dict(self.param_rules)
        return P(*(rules.get(name) for name in names))

    def weight_specs(self, axes):
        """A tree of PartitionSpecs for weights whose logical axes are `axes`."""
        return jax.tree.map(self.param_spec, axes, is_leaf=lambda t: isinstance(t, tuple))

    def activation_spec(self, rank: int = 3) -> P:
        """[batch, seq, ...] as the layout leaves activations between blocks."""
        return P(self.batch_axes or None, self.seq_axes or None, *([None] * (rank - 2)))


SINGLE_DEVICE = Layout()
