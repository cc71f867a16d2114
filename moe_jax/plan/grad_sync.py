"""The data-parallel gradient synchronisation of a plan and the optimizer update after
it (a part of `moe_jax.plan.cost_model.CostModel`): the paper's hierarchical sync, or
the trainer's exchange (`parallel.grad_exchange`), read off the exact state arrays of
the memory model for a pipeline."""

from __future__ import annotations

import dataclasses
import functools
import math

from moe_jax.config import Config
from moe_jax.parallel import pipeline_1f1b, pipeline_schedule, registry
from moe_jax.parallel.layout import DATA, INTRA, STAGE, axes_of
from moe_jax.plan import comm_volume, muon_cost
from moe_jax.plan.op_costs import PARAM_BYTES, Link


def optimizer_bytes_per_param(moment_bytes: int, moments: float = 2) -> float:
    """HBM bytes an optimizer update moves per float32 parameter: read its gradient, the
    parameter and the moments, write the parameter and the moments back (AdamW: two
    moments; 28 in float32, 20 with `train.moment_dtype=bfloat16`; Muon's matrices one)."""
    return 4 + 4 + 4 + 2 * moments * moment_bytes


class GradSync:
    """Gradient sums and the optimizer (a part of `CostModel`)."""

    def grad_sync_s(self, backward_s: float, stage_layers: int) -> tuple[float, float]:
        """(exposed, hidden) seconds per step of the data-parallel gradient sync of one
        stage. "hierarchical" (the paper): once per step, overlapping the last
        micro-batch's backward except the first layer's share (its gradients are ready
        last). "per_micro_batch" (what XLA compiles for the trainer): an all-reduce
        inside every micro-batch's backward, overlapping it the same way; with
        `parallel.grad_exchange='bf16_a2a'` only FSDP's gathers and their exchange stay
        there, and the summed gradients' exchange runs once, after the backward, exposed;
        under the distributed optimizer, with one micro-batch and no pipeline, the
        stacked weights' sums run inside the backward (overlapping it) and the rest, with
        the weight gathers, after it (`param_traffic.distributed_optimizer_traffic`)."""
        from moe_jax.plan import param_traffic

        plan, p = self.plan, self.plan.parallel
        layers = max(stage_layers, 1)
        window = backward_s * (1 - 1 / layers)
        if plan.grad_sync == "per_micro_batch" and self.sized.parallel.zero == 2:
            link = self.data_link if p.data > 1 else self.intra
            traffic = param_traffic.distributed_optimizer_traffic(self.sized)
            every, last, after = (sent / p.stages / link.bandwidth for sent in traffic)
            shown = lambda t: max(t - window, t / layers) if t else 0.0
            exposed = shown(every) * (self.micro_batches - 1) + shown(every + last) + after
            total = every * self.micro_batches + last + after
            return exposed, total - exposed
        if plan.grad_sync == "per_micro_batch":
            link = self.data_link if p.data > 1 else self.intra
            sent = param_traffic.gradient_bytes_per_step(self.sized) / p.stages / self.micro_batches
            after = 0.0  # parallel.grad_exchange='bf16_a2a': once, after the last backward
            if self.sized.parallel.grad_exchange == "bf16_a2a":
                per_micro_batch, per_step = param_traffic.bf16_a2a_traffic(self.sized)
                sent, after = (
                    per_micro_batch / p.stages,
                    per_step / p.stages / link.bandwidth,
                )
            once = sent / link.bandwidth
            shown = max(once - window, once / layers) if sent else 0.0
            return shown * self.micro_batches + after, (once - shown) * self.micro_batches
        volume = param_traffic.hierarchical_sync_bytes(self.sized)
        scale = comm_volume.DTYPE_BYTES[plan.grad_dtype] / PARAM_BYTES  # bf16 exchange: half
        intra = volume["intra"] * scale / p.stages / self.intra.bandwidth
        inter = volume["inter"] * scale / p.stages / self.data_link.bandwidth
        steps = (p.intra - 1) * 2 * self.intra.latency + (p.data - 1) * 2 * self.data_link.latency
        total = intra + inter + steps * (volume["intra"] + volume["inter"] > 0)
        shown = max(total - window, total / layers)
        return shown, total - shown

    def optimizer_s(self, params: float | None = None) -> float:
        """The optimizer's elementwise update: memory-bound over one device's parameters
        (default the largest 1F1B stage's; the moments split over data by ZeRO-1),
        moments in `train.moment_dtype`, as many per parameter as the model's state
        holds (`muon_cost.moments_per_param`: AdamW's 2, fewer under Muon). Muon's
        Newton-Schulz is `muon_cost.MuonCost.newton_schulz_s`."""
        params = max(self.stage_params()) if params is None else params
        shards = self.plan.parallel.data if self.plan.parallel.zero else 1
        bandwidth = self.gpu.hbm_bandwidth * self.eff.memory
        moment = comm_volume.DTYPE_BYTES[self.sized.train.moment_dtype]
        moments = muon_cost.moments_per_param(self.sized)
        return params / shards * optimizer_bytes_per_param(moment, moments) / bandwidth

    def pipeline_sync_split(self, loop: list, rest: list, backward_s: float) -> tuple[float, float]:
        """(exposed, hidden) seconds of the pipelined step's gradient sums, given
        `pipeline_sync_parts`: all after the tick loop's backward (GPipe), or where the
        1F1B loop sums the stack's (`pipeline_1f1b.sums_in_loop`), the last n of its R
        repeats' a part per drain tick (`pipeline_schedule.loop_sums`), each hidden
        behind the tick's backward (`backward_s`) but for what outlasts it, and the rest
        after the loop, exposed."""
        p = self.plan.parallel
        sums = None
        if pipeline_1f1b.sums_in_loop(p.schedule, p.zero):
            table = pipeline_schedule.tick_table(
                p.schedule, p.stages, self.micro_batches, p.repeats, p.stash_depth
            )
            sums = pipeline_schedule.loop_sums(table)
        if sums is None:
            return sync_time(loop + rest), 0.0
        share, ticks = sums.summed / sums.repeats, sums.summed * sums.chunks
        after = [(sent * (1 - share), group, link) for sent, group, link in loop]
        part = sync_time([(sent * share / ticks, group, link) for sent, group, link in loop])
        shown = ticks * max(0.0, part - backward_s)
        return sync_time(rest + after) + shown, ticks * part - shown

    def pipeline_sync_traffic(self) -> list[tuple[float, int, Link]]:
        """(bytes, group, link) of every collective of the pipelined step's gradient sum.
        Each device sums its stage's 1/S of the stack over the mesh axes the stack is
        replicated on, and what every stage holds (embedding, head, dense prefix) over
        'stage' as well."""
        return [sent for part in self.pipeline_sync_parts() for sent in part]

    def pipeline_sync_parts(self) -> tuple[list, list]:
        """(the stack's sums, everything else): `pipeline_sync_traffic` cut in two, the
        pipelined stack's all-reduces (ZeRO 0 and 1: what a 1F1B loop may sum in its
        drain, `pipeline_1f1b.sums_in_loop`), and the rest: what every stage holds,
        FSDP's scatters, ZeRO-1's gathers, the distributed optimizer's."""
        from moe_jax.plan.state_arrays import placement_key  # traces: only when asked

        sizes = registry.mesh_sizes(self.sized)
        loop, rest = [], []
        for shard in _shards(placement_key(self.sized)):
            summed = self._summed(shard, sizes) if self.plan.parallel.zero < 2 else []
            (loop if shard.piped else rest).extend(summed)
            rest += self._sync(shard, sizes)
        return loop, rest

    def _form(self) -> str:
        """The gradient sum's form: the paper's ("hierarchical", ZeRO 0 and 1) or the
        trainer's `parallel.grad_exchange`."""
        paper = self.plan.grad_sync == "hierarchical" and self.plan.parallel.zero < 2
        return "hierarchical" if paper else self.sized.parallel.grad_exchange

    def _group(self, shard: _Shard, sizes: dict[str, int]) -> tuple[float, int, int, Link]:
        """(bytes on one device, devices of the intra group, of 'data' and 'stage', the
        link beyond the intra group) of the devices sharing one parameter."""
        p, splits = self.plan.parallel, shard.splits
        size = shard.bytes / (p.stages if shard.piped and STAGE not in splits else 1)
        inner = math.prod(sizes[a] for a in INTRA if a not in splits)
        outer = (1 if DATA in splits else p.data) * (1 if shard.piped else p.stages)
        return size, inner, outer, self.data_link if shard.piped else self.stage_link

    def _summed(self, shard: _Shard, sizes: dict[str, int]) -> list[tuple[float, int, Link]]:
        """(bytes, group, link) of one parameter's gradient sum over the devices that
        share it under ZeRO 0 and 1 (`_sync`): one float32 all-reduce over the group, or
        in two levels, intra group first ('bf16_a2a', the paper's)."""
        form, (size, inner, outer, far) = self._form(), self._group(shard, sizes)
        if form == "fp32":
            group = inner * outer
            return [(2 * size * (group - 1) / group, group, far if outer > 1 else self.intra)]
        dtype = comm_volume.DTYPE_BYTES[self.plan.grad_dtype] / PARAM_BYTES
        scale = 0.75 if form == "bf16_a2a" else dtype
        return [
            (scale * 2 * size * (inner - 1) / inner, inner, self.intra),
            (scale * 2 * size / inner * (outer - 1) / outer, outer, far),
        ]

    def _sync(self, shard: _Shard, sizes: dict[str, int]) -> list[tuple[float, int, Link]]:
        """(bytes, group, link) one device sends to sum one parameter's gradient over its
        devices of the intra group, then across 'data' (and 'stage'). `Plan.grad_sync`
        "hierarchical" is the paper's form (intra-node all-reduce, then one of the 1/n
        shard across nodes, in `Plan.grad_dtype`); else the trainer's
        `parallel.grad_exchange`: one float32 all-reduce over the whole group, or
        'bf16_a2a' (bf16 all-to-alls, intra group first, the float32 shards gathered
        back: 3/4 of the paper's float32 bytes), with ZeRO-1's gather of the updated
        parameters; the distributed optimizer's in every mode (`_distributed`). FSDP's
        gradients are reduce-scattered over 'data' in every micro-batch's backward (the
        transpose of its weight gathers). All but ZeRO 0 and 1's sums (`_summed`),
        which the caller places."""
        plan, p, splits = self.plan, self.plan.parallel, shard.splits
        form = self._form()
        dtype = comm_volume.DTYPE_BYTES[plan.grad_dtype] / PARAM_BYTES
        size, inner, outer, far = self._group(shard, sizes)
        out = []
        if DATA in splits:
            passes = self.micro_batches if shard.piped else 1
            scatter = {"fp32": 1.0, "bf16_a2a": 0.5}.get(form, dtype)
            out.append((passes * scatter * size * (p.data - 1), p.data, self.data_link))
        if p.zero == 2:  # the master split further than the compute copy: cut
            cut = shard.master_splits != splits
            return out + self._distributed(cut, size, inner, outer, far)
        if form != "hierarchical" and p.zero and DATA in shard.moment_splits - splits:
            out.append((size * (p.data - 1) / p.data, p.data, self.data_link))
        return out

    def _distributed(
        self, cut: bool, size: float, inner: int, outer: int, far: Link
    ) -> list[tuple[float, int, Link]]:
        """The step's sum of one parameter under the distributed optimizer
        (`parallel.zero=2`), as `moe_jax.parallel.distributed_optimizer` runs it whatever
        `Plan.grad_sync` says: the accumulated float32 gradient reduce-scattered to the
        masters over the g = inner x outer devices sharing it (one float32
        reduce-scatter, or `grad_exchange='bf16_a2a'`'s bf16 all-to-all per level), and
        the next step's compute copy all-gathered in `model.dtype`; a gradient that no
        dimension lets g `cut` is all-reduced whole in float32."""
        group = inner * outer
        link = far if outer > 1 else self.intra
        if group == 1:
            return []
        if not cut:
            return [(2 * size * (group - 1) / group, group, link)]
        if self.sized.parallel.grad_exchange == "bf16_a2a":
            summed = [
                (size / 2 * (inner - 1) / inner, inner, self.intra),
                (size / 2 / inner * (outer - 1) / outer, outer, far),
            ]
        else:
            summed = [(size * (group - 1) / group, group, link)]
        wire = comm_volume.DTYPE_BYTES[self.sized.model.dtype] / PARAM_BYTES
        return [*summed, (wire * size * (group - 1) / group, group, link)]


@dataclasses.dataclass(frozen=True)
class _Shard:
    """One parameter as a device holds it: what its gradient sum needs."""

    piped: bool  # of the pipelined MoE stack (split over 'stage' when pipelined)
    bytes: int  # on one device (`state_arrays.device_bytes`: a pipelined stack split over 'stage')
    splits: frozenset[str]  # mesh axes its compute copy is split over
    moment_splits: frozenset[str]  # those of its optimizer moments (ZeRO-1: 'data')
    master_splits: frozenset[str]  # those of its float32 master (ZeRO-2: further cut)


@functools.lru_cache(maxsize=1024)
def _shards(config: Config) -> tuple[_Shard, ...]:
    """Every parameter of the train state as one device holds it under `config`."""
    from moe_jax.plan import state_arrays  # traces the train state: only when asked

    return tuple(
        _Shard(
            piped=array.stack == "moe",
            bytes=state_arrays.device_bytes(config, array, master=False),
            splits=_axes(state_arrays.placement(config, array, master=False)),
            moment_splits=_axes(
                state_arrays.placement(config, dataclasses.replace(array, moment=True))
            ),
            master_splits=_axes(state_arrays.placement(config, array)),
        )
        for array in state_arrays.state_arrays(config)
        if array.part == "params"
    )


def _axes(spec) -> frozenset[str]:
    """Mesh axes a placement splits over."""
    return frozenset(a for entry in spec for a in axes_of(entry))


def sync_time(traffic: list[tuple[float, int, Link]]) -> float:
    """Bytes over each link, and 2 (g - 1) latency steps for each distinct group (one
    all-reduce-like collective per group: XLA combines a step's reductions over it)."""
    seconds = sum(sent / link.bandwidth for sent, _, link in traffic)
    groups = {(group, link) for sent, group, link in traffic if sent > 0 and group > 1}
    return seconds + sum(2 * (group - 1) * link.latency for group, link in groups)
