"""The step of a plan from its blocks: the micro-batches of the slowest stage, the
pipeline's ticks and its bubble (a part of `moe_jax.plan.cost_model.CostModel`).

The trainer's pipeline ("gpipe", `moe_jax.parallel.pipeline`): GPipe over S stages with
R circular repeats; the stage-cut step (`one_f_one_b_step`): the trainer's unpipelined
step at one stage, and the 1F1B of the paper's systems (`PAPER_PIPELINE`) at more.
"""

from __future__ import annotations

import dataclasses
import functools

from moe_jax.model.mtp import is_moe
from moe_jax.plan.op_costs import (
    RING_PARTNERS,
    Tally,
    backward_factor,
    collective_time,
    recomputed,
)


def bubble_fraction(stages: int, micro_batches: int, repeats: int = 1) -> float:
    """Share of a pipeline's ticks a stage idles, (S-1)/(M R + S - 1): the trainer's GPipe
    with R circular repeats (1F1B's (p-1)/(m+p-1) at R = 1)."""
    return (stages - 1) / (micro_batches * repeats + stages - 1)


class Schedules:
    """Stage cuts and schedules (a part of `CostModel`)."""

    def stage_params(self) -> list[float]:
        """Parameters one device holds on each 1F1B stage: its layers, the embedding on the
        first, the head on the last."""
        m, p = self.config.model, self.plan
        is_moe = [m.block_of(i)[3] for i in range(m.num_layers)]
        table = self.table_params()
        out = []
        for s, layers in enumerate(self.stage_layers()):
            ends = (s == 0) + (s == p.parallel.stages - 1 and not m.tie_embeddings)
            last = self.mtp_params() if s == p.parallel.stages - 1 else 0.0
            out.append(sum(self.layer_params(is_moe[i]) for i in layers) + ends * table + last)
        return out

    def mtp_params(self) -> float:
        """Parameters of the model.mtp_depth MTP modules on one device (their blocks;
        eh_proj and norms are small), held by every stage that runs them."""
        m = self.config.model
        return sum(self.layer_params(is_moe(m, k)) for k in range(1, m.mtp_depth + 1))

    def stage_layers(self) -> list[range]:
        """Layers of each stage: the model cut into pp contiguous, near-equal parts."""
        n, pp = self.config.model.num_layers, self.plan.parallel.stages
        bounds = [round(s * n / pp) for s in range(pp + 1)]
        return [range(bounds[s], bounds[s + 1]) for s in range(pp)]

    def stages(self) -> list[Tally]:
        """Per micro-batch, forward + backward, of each 1F1B pipeline stage."""
        m, p = self.config.model, self.plan
        is_moe = [m.block_of(i)[3] for i in range(m.num_layers)]
        layer = {kind: self.layer(kind) for kind in set(is_moe)}
        p2p = 0.0
        if p.parallel.stages > 1:  # activations in and gradients back, each this device's tokens
            p2p = 2 * collective_time(self.t * m.embed_dim * self.B, 2, self.stage_link)
        stages = []
        params = self.stage_params()
        for s, layers in enumerate(self.stage_layers()):
            tally = Tally(compute={"grad_accumulation": self.accumulation_s(params[s])})
            for i in layers:
                tally.add(layer[is_moe[i]])
            if s == p.parallel.stages - 1:
                tally.add(self.head())
            if p2p:
                tally.add(Tally(exposed={"pipeline_p2p": p2p}))
            stages.append(tally)
        return stages

    def one_f_one_b_step(self) -> tuple[dict[str, float], dict[str, float], float]:
        """(breakdown, hidden, slowest stage's micro-batch seconds) of m micro-batches
        through 1F1B (no pipeline: one stage)."""
        p = self.plan.parallel
        stages = self.stages()
        slowest = max(range(p.stages), key=lambda s: stages[s].seconds)
        stage = stages[slowest]
        t_mb = stage.seconds
        mbs = self.micro_batches
        breakdown = {k: v * mbs for k, v in stage.compute.items()}
        for k, v in stage.exposed.items():
            breakdown[k] = breakdown.get(k, 0.0) + v * mbs
        hidden = {k: v * mbs for k, v in stage.hidden.items()}
        breakdown["bubble"] = (p.stages - 1) * t_mb
        shown, hid = self.grad_sync_s(stages[0].backward, len(self.stage_layers()[0]))
        breakdown["grad_sync"] = shown
        hidden["grad_sync"] = hid
        breakdown["optimizer"] = self.optimizer_s()
        breakdown.update(self.muon_s())
        return breakdown, hidden, t_mb

    # --- the trainer's pipeline (`Plan.pipeline` "trainer") -------------------------

    def units_per_group(self) -> int:
        """MoE units (moe_every - 1 dense layers, one MoE layer) of each of the R S groups."""
        return self.config.model.num_moe_layers // (
            self.plan.parallel.stages * self.plan.parallel.repeats
        )

    def unit(self, forward_only: bool = False) -> Tally:
        """One pipelined unit for one micro-batch: forward, backward and the model's
        recompute, or (`forward_only`) one forward, exchanges included."""
        run = self.layer_forward if forward_only else self.layer
        tally = run(True)
        dense = self.config.model.moe_every - 1
        if dense:
            tally.add(run(False), dense)
        return tally

    def layer_forward(self, moe: bool) -> Tally:
        """One forward of a layer: what rematerialising a tick runs once more."""
        attention = recomputed(self.attention_ops())
        tally = self._pass(attention, self.attention_exchanges(), backward=False)
        if moe:
            tally.add(self._pass(self.moe_ops(), self.moe_exchanges(), backward=False))
        else:
            tally.add(self._pass(self.mlp_ops(), self.mlp_exchanges(), backward=False))
        return tally

    def group_params(self) -> float:
        """Parameters of one group of the stack on one device."""
        dense = (self.config.model.moe_every - 1) * self.layer_params(False)
        return self.units_per_group() * (self.layer_params(True) + dense)

    def outside_params(self) -> float:
        """Parameters every stage holds whole: the embedding, the head (untied) and the
        dense prefix and the MTP modules."""
        m = self.config.model
        tables = 1 + (not m.tie_embeddings)
        prefix = m.first_k_dense * self.layer_params(False)
        return tables * self.table_params() + prefix + self.mtp_params()

    def send_s(self, tokens: float) -> float:
        """One collective-permute of `tokens` tokens' hidden states between two stages."""
        sent = tokens * self.config.model.embed_dim * self.B
        return collective_time(sent, 2, self.stage_link)

    def tick(self) -> Tally:
        """One stage at one tick: its group's forward, backward and the model's recompute
        for one micro-batch, the forward once more (each tick is rematerialised), the
        weight gradients added into the step's sum, the activation sent on and its
        cotangent sent back (both wait for the tick's compute and feed the next)."""
        units = self.units_per_group()
        tally = Tally(compute={"grad_accumulation": self.accumulation_s(self.group_params())})
        tally.add(self.unit(), units)
        tally.add(self.unit(forward_only=True), units)
        tally.add(Tally(exposed={"pipeline_p2p": 2 * self.send_s(self.t)}))
        return tally

    def deferred_s(self) -> float:
        """What zero-bubble takes out of the bubble (0 under the other schedules): its W
        item, the weights' half of each weight GEMM's backward (the input gradient is
        the other) and their addition into the step's sum, once per tick a W may trail
        its B (`parallel.stash_depth`, S - 1 at most: then every stage's W runs in the
        same M R ticks, `pipeline_schedule.zero_bubble`). B keeps its exchanges'
        timing as 1F1B's (their GEMMs to hide behind shrink by W; not modelled)."""
        p = self.plan.parallel
        if p.schedule != "zero_bubble":
            return 0.0

        def weights_half(ops: list) -> float:
            kinds = [op for op in ops if op.kind in RING_PARTNERS]
            return sum(self._time(op, True) * backward_factor(op) / 2 for op in kinds)

        attention = weights_half(self.attention_ops())
        unit = attention + weights_half(self.moe_ops())
        unit += (self.config.model.moe_every - 1) * (attention + weights_half(self.mlp_ops()))
        w = self.units_per_group() * unit + self.accumulation_s(self.group_params())
        return (p.stash_depth or p.stages - 1) * w

    def outside(self) -> Tally:
        """The dense prefix and the head of one micro-batch, outside the pipeline."""
        tally = self.head()
        if self.config.model.first_k_dense:
            tally.add(self.layer(False), self.config.model.first_k_dense)
        return tally

    def _shared(self) -> tuple[Tally, Tally, tuple[list, list]]:
        """(tick, outside, `pipeline_sync_parts`): what a pipelined plan's two
        schedules share, computed once for the pair (the planner yields them one after
        the other)."""
        gpipe = dataclasses.replace(self.plan.parallel, schedule="gpipe", stash_depth=0)
        twin = dataclasses.replace(self.plan, parallel=gpipe)
        return _shared_costs(type(self), self.config, twin, self.gpu, self.global_batch, self.eff)

    def gpipe_step(self) -> tuple[dict[str, float], dict[str, float], float]:
        """(breakdown, hidden, tick seconds) of the trainer's pipelined step: M R ticks of
        work and S - 1 of bubble, each stage's K = M / S micro-batches outside the
        pipeline, the sends of those to stage 0 and back (forward and backward), one
        exposed gradient sum and the optimizer. Under 1F1B (`parallel.schedule`) the
        same ticks (`pipeline_schedule`: forward and backward work each in M R + S - 1),
        but stage 0 runs the embedding and dense prefix and the last stage the head of
        all M micro-batches inside the loop while the others wait, only token ids
        travel between stages outside the loop, and the loop's drain sums the last
        repeats' gradients behind its backward (`pipeline_sync_split`)."""
        p = self.plan.parallel
        (tick, outside, parts), k = self._shared(), self.micro_batches // p.stages
        one_f_one_b = p.schedule != "gpipe"  # 1F1B or zero-bubble
        total = Tally()
        total.add(tick, self.micro_batches * p.repeats)
        # 1F1B: stage 0's embedding and dense prefix and the last stage's head of all
        # M micro-batches in the loop (the other stages wait); GPipe: K on each stage
        total.add(outside, self.micro_batches if one_f_one_b else k)
        breakdown = dict(total.compute)
        for key, value in total.exposed.items():
            breakdown[key] = breakdown.get(key, 0.0) + value
        outside = self.outside_params()
        passes = self.micro_batches if one_f_one_b else 1  # 1F1B: a head and tail a tick
        breakdown["grad_accumulation"] += passes * self.accumulation_s(outside, passes=passes)
        if not one_f_one_b:  # the embedded micro-batches to stage 0, the outputs back
            breakdown["pipeline_p2p"] += 4 * (p.stages - 1) * self.send_s(k * self.t)
        breakdown["bubble"] = (p.stages - 1) * tick.seconds - self.deferred_s()
        breakdown["grad_sync"], hidden = self.pipeline_sync_split(*parts, tick.backward)
        breakdown["optimizer"] = self.optimizer_s(p.repeats * self.group_params() + outside)
        breakdown.update(self.muon_s())
        return breakdown, {**total.hidden, "grad_sync": hidden}, tick.seconds


@functools.lru_cache(maxsize=1)
def _shared_costs(model: type, *args) -> tuple[Tally, Tally, tuple[list, list]]:
    """`Schedules._shared` of the GPipe twin `model(*args)`: the last pair's, kept."""
    twin = model(*args)
    return twin.tick(), twin.outside(), twin.pipeline_sync_parts()
