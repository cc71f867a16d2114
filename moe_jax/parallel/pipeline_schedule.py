"""The tick tables of the 1F1B pipeline schedule (`moe_jax.parallel.pipeline_1f1b`):
which micro-batch each stage runs forward and backward at each tick, and where what it
sends and receives is kept. Pure Python, computed once per plan; the planner reads the
same tables for the bubble and the activations in flight.

The stack is cut into V = R S virtual stages (group v = r S + s on stage s, as
`moe_jax.parallel.pipeline` cuts it). Micro-batch i runs forward through v = 0 .. V - 1,
its loss on the last, then backward through v = V - 1 .. 0. At each tick every stage
runs at most one forward item (i, v) and at most one backward item, in lock step: what a
stage sends at the end of tick t (activations to s + 1, input gradients to s - 1, both
around the ring) is there at tick t + 1. The last virtual stage runs the forward, the
loss and the backward of a micro-batch in the same tick.

Forward items run in Megatron's interleaved order: micro-batches in groups of S, each
group through every repeat before the next group starts ((i // S, r, i)); a backward
item runs as soon as its output gradient is there. Every item a stage runs forward is
then there when it is its turn, and every backward item one tick after its successor,
so forward work fills M R + S - 1 ticks and backward work M R + S - 1 ticks, as GPipe's
two loops do; but a stage holds an item's input only from its forward to its backward,
about 2 R S ticks, so the items in flight are bounded by the stages and repeats, not by
the micro-batches.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

NONE = -1  # a table entry with nothing to do (or nothing arriving)


@dataclasses.dataclass(frozen=True)
class Table:
    """One schedule. Every array is [ticks, stages] of int32; NONE where idle.

    forward: the micro-batch a stage runs forward; forward_repeat its repeat;
    forward_slot: where its input is kept (NONE: the micro-batch's embedded input, for
    v = 0); loss: 1 where the forward is the last virtual stage's, whose loss gradient
    is kept in loss_slot (its backward may run in the same tick). backward,
    backward_repeat, backward_slot alike, and gradient_slot: where its output gradient
    is kept. arrive_slot / gradient_arrive_slot: where the
    activation / input gradient received at the tick's start is kept (NONE: discard).
    `slots` / `gradient_slots`: the buffers' sizes, the items in flight."""

    stages: int
    microbatches: int
    repeats: int
    forward: np.ndarray
    forward_repeat: np.ndarray
    forward_slot: np.ndarray
    loss: np.ndarray
    loss_slot: np.ndarray
    backward: np.ndarray
    backward_repeat: np.ndarray
    backward_slot: np.ndarray
    gradient_slot: np.ndarray
    arrive_slot: np.ndarray
    gradient_arrive_slot: np.ndarray
    slots: int
    gradient_slots: int
    # zero-bubble only (`zero_bubble`): each backward item above is B, its input
    # gradient; weight, weight_repeat: the item whose W (its weights' gradients) a
    # stage runs, reading what B kept in weight_slot; stash_slot: where the tick's B
    # keeps it; stash_slots: that buffer's size.
    weight: np.ndarray | None = None
    weight_repeat: np.ndarray | None = None
    weight_slot: np.ndarray | None = None
    stash_slot: np.ndarray | None = None
    stash_slots: int = 0

    @property
    def ticks(self) -> int:
        return self.forward.shape[0]

    def forward_ticks(self) -> int:
        """Ticks in which some stage runs forward work (each costs one forward)."""
        return int((self.forward != NONE).any(1).sum())

    def backward_ticks(self) -> int:
        """Ticks in which some stage runs backward work (each costs one backward)."""
        return int((self.backward != NONE).any(1).sum())

    def weight_ticks(self) -> int:
        """Ticks in which some stage runs a W item (zero-bubble; 1F1B's B holds its W)."""
        return 0 if self.weight is None else int((self.weight != NONE).any(1).sum())


class _Slots:
    """Buffer slots handed out on arrival and freed after the tick of their use."""

    def __init__(self):
        self.free: list[int] = []
        self.used = 0
        self.release: list[int] = []

    def take(self) -> int:
        if self.free:
            return self.free.pop(0)
        self.used += 1
        return self.used - 1

    def end_tick(self) -> None:
        self.free = sorted(self.free + self.release)
        self.release = []


@functools.cache
def one_f_one_b(stages: int, microbatches: int, repeats: int = 1) -> Table:
    """The 1F1B table for S stages, M micro-batches (a multiple of S) and R repeats."""
    sim = _Simulation(stages, microbatches, repeats)
    while len(sim.b_done) < microbatches * repeats * stages:
        sim.tick()
        if len(sim.rows) > 4 * (microbatches * repeats + stages * repeats + stages):
            raise RuntimeError("1F1B table did not converge")  # a bug, not an input
    arrays = {n: np.array([row[n] for row in sim.rows], dtype=np.int32) for n in ROWS}
    return Table(
        stages, microbatches, repeats, **arrays,
        slots=max(1, max(p.used for p in sim.inputs)),
        gradient_slots=max(1, max(p.used for p in sim.grads)),
    )  # fmt: skip


@functools.cache
def zero_bubble(stages: int, microbatches: int, repeats: int = 1, depth: int = 0) -> Table:
    """1F1B's table with each backward cut in two (Qi et al.'s B and W): B, the input
    gradient the stage before waits for, at 1F1B's tick; W, the weights' gradients, which
    nothing waits for, at the latest tick at which every stage has run its k-th B, so
    that the k-th W of every stage runs in the same tick. In lock step a tick costs the
    work of its busiest stage, so W work costs M R ticks instead of 1F1B's M R + S - 1:
    the bubble loses (S - 1) W. What B keeps for W (the weight GEMMs' inputs and output
    gradients) waits in a stash of `stash_slots` items, about S.

    `depth` (`parallel.stash_depth`) > 0 bounds how long a W waits: at most `depth`
    ticks after its B, so the stash holds about `depth` + 1 items, and W work costs
    M R + S - 1 - `depth` ticks (each tick of waiting allowed takes one W out of the
    bubble); 0: as long as aligning every stage's W needs."""
    base = one_f_one_b(stages, microbatches, repeats)
    b = base.backward
    per_stage = [np.nonzero(b[:, s] != NONE)[0] for s in range(stages)]  # each's B ticks
    aligned = np.max(np.stack(per_stage), axis=0)  # the k-th W's tick, every stage's
    when = [aligned if depth <= 0 else np.minimum(aligned, ticks + depth) for ticks in per_stage]
    rows = {n: np.full_like(b, NONE) for n in ZERO_BUBBLE_ROWS}
    pools = [_Slots() for _ in range(stages)]
    kept: dict[tuple[int, int], int] = {}  # (stage, k) -> its stash slot
    for t in range(base.ticks):
        for s in range(stages):
            if b[t, s] != NONE:
                k = int(np.searchsorted(per_stage[s], t))
                kept[(s, k)] = rows["stash_slot"][t, s] = pools[s].take()
            for k in np.nonzero(when[s] == t)[0]:
                at = per_stage[s][k]
                rows["weight"][t, s], rows["weight_slot"][t, s] = b[at, s], kept[(s, k)]
                rows["weight_repeat"][t, s] = base.backward_repeat[at, s]
                pools[s].release.append(kept[(s, k)])
        for pool in pools:
            pool.end_tick()
    return dataclasses.replace(base, **rows, stash_slots=max(p.used for p in pools))


ZERO_BUBBLE_ROWS = ("weight", "weight_repeat", "weight_slot", "stash_slot")


def tick_table(
    schedule: str, stages: int, microbatches: int, repeats: int = 1, depth: int = 0
) -> Table:
    """The table of `parallel.schedule` '1f1b' or 'zero_bubble' (`depth`: its
    `parallel.stash_depth`)."""
    if schedule == "zero_bubble":
        return zero_bubble(stages, microbatches, repeats, depth)
    return one_f_one_b(stages, microbatches, repeats)


# The table's arrays, each [ticks, stages].
ROWS = (
    "forward", "forward_repeat", "forward_slot", "loss", "loss_slot",
    "backward", "backward_repeat", "backward_slot", "gradient_slot",
    "arrive_slot", "gradient_arrive_slot",
)  # fmt: skip


class _Simulation:
    """Runs the schedule tick by tick, recording each tick's row of the table."""

    def __init__(self, stages: int, microbatches: int, repeats: int):
        s_ = self.stages = stages
        self.last = repeats * stages - 1  # the last virtual stage
        items = [(i, v) for i in range(microbatches) for v in range(repeats * s_)]
        order = sorted(items, key=lambda item: (item[0] // s_, item[1] // s_, item[0]))
        self.todo = [[item for item in order if item[1] % s_ == s] for s in range(s_)]
        self.f_done: dict[tuple[int, int], int] = {}
        self.b_done: dict[tuple[int, int], int] = {}
        self.sent: list[tuple[int, int]] = []  # forward items finished last tick
        self.sent_back: list[tuple[int, int]] = []  # backward items finished last tick
        self.where: dict[tuple[int, int], int] = {}  # (i, v) -> its input's slot
        self.grad_where: dict[tuple[int, int], int] = {}  # (i, v) -> its gradient's slot
        self.ready: list[list[tuple[int, int]]] = [[] for _ in range(s_)]  # backward, by stage
        self.inputs = [_Slots() for _ in range(s_)]
        self.grads = [_Slots() for _ in range(s_)]
        self.rows: list[dict[str, list[int]]] = []

    def tick(self) -> None:
        s_ = self.stages
        row = {name: [NONE] * s_ for name in ROWS}
        for i, v in self.sent:  # activations from stage s - 1
            if v < self.last:
                s = (v + 1) % s_
                self.where[(i, v + 1)] = row["arrive_slot"][s] = self.inputs[s].take()
        for i, v in self.sent_back:  # input gradients from stage s + 1
            if v > 0:
                s = (v - 1) % s_
                self.grad_where[(i, v - 1)] = row["gradient_arrive_slot"][s] = self.grads[s].take()
                self.ready[s].append((i, v - 1))
        self.sent, self.sent_back = [], []
        for s in range(s_):
            self._forward(s, row)
            self._backward(s, row)
        for pool in self.inputs + self.grads:
            pool.end_tick()
        self.rows.append(row)

    def _forward(self, s: int, row) -> None:
        """The stage's next forward item in its order, if its input is there."""
        if not self.todo[s]:
            return
        i, v = self.todo[s][0]
        if v != 0 and (i, v) not in self.where:
            return
        self.todo[s].pop(0)
        self.f_done[(i, v)] = len(self.rows)
        self.sent.append((i, v))
        row["forward"][s], row["forward_repeat"][s] = i, v // self.stages
        row["forward_slot"][s] = self.where.get((i, v), NONE)
        if v == self.last:  # the loss's gradient, for the backward in this tick
            row["loss"][s] = 1
            self.grad_where[(i, v)] = row["loss_slot"][s] = self.grads[s].take()
            self.ready[s].append((i, v))

    def _backward(self, s: int, row) -> None:
        """The ready backward item of the earliest group, latest repeat, first micro-batch."""
        s_ = self.stages
        if not self.ready[s]:
            return
        i, v = min(self.ready[s], key=lambda item: (item[0] // s_, -(item[1] // s_), item[0]))
        self.ready[s].remove((i, v))
        self.b_done[(i, v)] = len(self.rows)
        self.sent_back.append((i, v))
        row["backward"][s], row["backward_repeat"][s] = i, v // s_
        row["backward_slot"][s] = self.where.get((i, v), NONE)
        row["gradient_slot"][s] = self.grad_where[(i, v)]
        if (i, v) in self.where:
            self.inputs[s].release.append(self.where[(i, v)])
        self.grads[s].release.append(self.grad_where[(i, v)])


def in_flight(table: Table) -> int:
    """The most stage inputs one stage keeps at once (its buffer's slots), a
    micro-batch's stream each; stage 0 also keeps the M embedded inputs."""
    return table.slots


@dataclasses.dataclass(frozen=True)
class LoopSums:
    """Where the 1F1B loop sums the stack's gradients over the devices that share them
    (`moe_jax.parallel.pipeline_1f1b`). Repeat r's weight gradients are final once every
    stage has run its last backward item of r, and in interleaved 1F1B the last group of
    micro-batches runs its backward through the repeats from the last down, S ticks
    each: repeats R - 1 .. R - n are final while the drain still computes (backward
    work only: the last repeat's last backward item follows the last loss). From tick
    `start` to the loop's end each tick sums one of `chunks` equal parts of one of them
    (repeat R - 1 first), each after its repeat is final; repeats 0 .. R - n - 1 (at
    least repeat 0, final in the last tick) are summed after the loop."""

    start: int
    chunks: int
    summed: int  # n: the repeats summed in the loop, the last ones
    repeats: int  # R

    def rows(self, ticks: int) -> tuple[np.ndarray, np.ndarray]:
        """(repeat, part) summed in each tick from `start` to `ticks`."""
        k = np.arange(ticks - self.start, dtype=np.int32)
        return self.repeats - 1 - k // self.chunks, k % self.chunks

    @property
    def after(self) -> int:
        """The repeats summed after the loop: 0 .. R - n - 1."""
        return self.repeats - self.summed


def loop_sums(table: Table) -> LoopSums | None:
    """The most parts per repeat that fit the drain (smaller parts: less to hide behind
    each tick), with as many repeats in the loop as fit; None where none does (R = 1)."""
    r_, ticks = table.repeats, table.ticks
    # a repeat's gradients are final after its last backward (zero-bubble: its last W)
    last = table.backward_repeat if table.weight is None else table.weight_repeat
    final = [int(np.nonzero((last == r).any(1))[0].max()) for r in range(r_)]
    first = final[-1] + 1  # the first tick after the last repeat is final
    for n in range(r_ - 1, 0, -1):
        chunks = (ticks - first) // n
        start = ticks - n * chunks  # the parts end with the loop
        if chunks and all(start + (r_ - 1 - r) * chunks > final[r] for r in range(r_ - n, r_)):
            # the last repeat's last backward follows the last loss: no forward is left
            if (table.forward[start:] != NONE).any() or (table.loss[start:] > 0).any():
                raise RuntimeError("forward work in the 1F1B drain")  # a bug, not an input
            return LoopSums(start, chunks, n, r_)
    return None
