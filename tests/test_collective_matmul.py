"""Collective matmul (`parallel.collective_matmul`): tp's all-gather + GEMM and GEMM +
reduce-scatter, sp's all-to-all + GEMM and the all-gather expert layouts' ring give
the numbers of the plain collectives, and compile to n-1 collective-permutes per
exchange, with no all-gather, reduce-scatter or all-to-all left in the rewritten block
and a GEMM free to run beside every step's transfer."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from moe_jax.tools import hlo_collectives
from tests.layouts import (
    BASE,
    DENSE,
    assert_leaves_close_in_norm,
    on_ragged_dot,
    planned,
    with_plan,
)

BASE, DENSE = on_ragged_dot(BASE), on_ragged_dot(DENSE)  # the GPU path's expert kernel


def _ring(config, chunks: int = 1):
    parallel = dataclasses.replace(config.parallel, collective_matmul=True, overlap_chunks=chunks)
    return dataclasses.replace(config, parallel=parallel)


def _assert_same_numbers(got, want) -> None:
    for key in ("loss", "lm_loss", "aux_loss", "seq_aux_loss", "z_loss"):
        np.testing.assert_allclose(got.metrics[key], want.metrics[key], rtol=1e-6, err_msg=key)
    np.testing.assert_array_equal(got.metrics["load"], want.metrics["load"])
    assert_leaves_close_in_norm(got.grads, want.grads, 1e-6)
    assert_leaves_close_in_norm(
        jax.device_get(got.state.params), jax.device_get(want.state.params), 1e-6
    )


# Every layout with a ring form, on intra groups of 4 and 8: tp attention and MLPs, sp
# attention (kv heads repeated: 2 kv heads < n), and ep_ag / etp / ep_etp experts with
# the tokens split over the batch (dp) or the sequence (tp, sp).
PLANS = [
    ("tp", "ep_etp", 2, 4, DENSE),
    ("tp", "ep_ag", 1, 8, BASE),
    ("sp", "etp", 1, 8, BASE),
    ("sp", "ep_a2a", 2, 4, DENSE),
    ("dp", "ep_ag", 2, 4, BASE),
]


@pytest.mark.parametrize("attention,experts,data,intra,base", PLANS)
def test_rings_give_the_numbers_of_the_collectives(attention, experts, data, intra, base):
    """Loss, its parts, every gradient and the parameters after three AdamW steps within
    1e-6 of the same plan with plain collectives (dropless routing; leaves in norm: the
    rings sum the group's partial results in another order than XLA's collectives)."""
    one = with_plan(attention, data, intra, experts, base=base)
    _assert_same_numbers(planned(_ring(one)), planned(one))


@pytest.mark.parametrize("attention,experts,chunks", [("tp", "ep_ag", 2), ("sp", "etp", 2)])
def test_rings_inside_chunks_give_the_numbers_of_one_block(attention, experts, chunks):
    """Both overlaps at once: C chunks, each ringed."""
    one = with_plan(attention, 2, 4, experts, base=BASE)
    _assert_same_numbers(planned(_ring(one, chunks)), planned(one))


def _block_exchanges(hlo: str) -> dict[tuple[str, str, str], list]:
    """Token-exchange collectives by (block, kind, pass), one entry per execution."""
    found: dict[tuple[str, str, str], list] = {}
    for c in hlo_collectives.parse(hlo):
        if c.tag != "token_exchange":
            continue
        block = next(b for b in ("attention", "mlp", "moe") if f"/{b}/" in c.op_name)
        found.setdefault((block, c.kind, c.pass_), []).extend([c] * c.count)
    return found


# Forward collective-permutes per step, by hand: each exchange of a block, its way in
# and its way out, is n-1 of them, per layer. tp+ep_etp, n=4, on DENSE (3 layers: one
# dense, two MoE with a shared expert): attention 2·3 per layer; the MLPs 2·3 in the
# dense layer and 3 in each MoE layer, whose shared expert's way in is the expert
# block's (XLA shares the one ring of the layer's tokens, as it shares their
# all-gather); the expert block 2·3 (the tokens travel around all n, the experts' width
# split within pairs). sp+etp, n=8, on BASE (2 MoE layers): q, k and v travel as one
# buffer, so attention is 2·7 per layer, and the expert block 2·7. Both are programs of
# `PLANS`, compiled once for both tests.
PERMUTES = {
    ("tp", "ep_etp", 4): (DENSE, {"attention": 3 * 6, "mlp": 6 + 2 * 3, "moe": 2 * 6}),
    ("sp", "etp", 8): (BASE, {"attention": 2 * 14, "moe": 2 * 14}),
}


@pytest.mark.parametrize("attention,experts,intra", list(PERMUTES))
def test_each_exchange_compiles_to_n_minus_one_permutes(attention, experts, intra):
    """In each rewritten block the plain program's all-gathers, reduce-scatters and
    all-to-alls become n-1 collective-permutes each (`PERMUTES`), labelled by ring step
    and moving the same bytes (within 1%); nothing else exchanges tokens there. The
    backward's transposed rings move the plain backward's bytes (XLA sums the gradients
    of a shared ring before they travel, so they are compared over the blocks)."""
    base, blocks = PERMUTES[attention, experts, intra]
    one = with_plan(attention, 8 // intra, intra, experts, base=base)
    want, got = (_block_exchanges(planned(c).hlo) for c in (one, _ring(one)))
    sent = lambda found, block, pass_: sum(
        c.bytes for (b, _, p), cs in found.items() if b in block and p == pass_ for c in cs
    )
    for block, count in blocks.items():
        assert {kind for b, kind, _ in got if b == block} == {"collective-permute"}, block
        plain = {kind for b, kind, _ in want if b == block}
        assert plain and plain <= {"all-gather", "reduce-scatter", "all-to-all"}, block
        permutes = got[block, "collective-permute", "forward"]
        assert len(permutes) == count, block
        assert set(range(1, intra)) <= {c.ring for c in permutes} <= set(range(intra))
        assert sent(got, (block,), "forward") == pytest.approx(sent(want, (block,), "forward"))
        assert got[block, "collective-permute", "backward"], block
    backward = sent(got, tuple(blocks), "backward")
    assert backward == pytest.approx(sent(want, tuple(blocks), "backward"), rel=0.01)


def test_every_permute_has_a_gemm_to_hide_behind():
    """Def-use walk over the compiled forward: for each ring step's collective-permute of
    the expert and tp blocks there is a GEMM of the same block (a dot, or a fusion that
    holds one) that neither feeds it nor waits for it, so the two can run at once (tp's
    attention and MLP rings, ep_etp's expert ring: the first program of `PLANS`)."""
    hlo = planned(_ring(with_plan("tp", 2, 4, "ep_etp", base=DENSE))).hlo
    program = hlo_collectives.instructions(hlo)
    with_dot = {ins.computation for ins in program if ins.opcode == "dot"}
    bodies: dict[str, dict[str, hlo_collectives.Instruction]] = {}
    for ins in program:
        bodies.setdefault(ins.computation, {})[ins.name] = ins

    def ancestors(body, name):
        seen, todo = set(), list(body[name].operands)
        while todo:
            other = todo.pop()
            if other in body and other not in seen:
                seen.add(other)
                todo.extend(body[other].operands)
        return seen

    checked = 0
    for body in bodies.values():
        forward = [i for i in body.values() if "transpose(" not in i.op_name]
        gemms = [
            i.name
            for i in forward
            if i.opcode == "dot" or (i.opcode == "fusion" and i.called & with_dot)
        ]
        before = {name: ancestors(body, name) for name in gemms}
        for permute in forward:
            if not permute.opcode.startswith("collective-permute") or permute.ring is None:
                continue
            block = next(b for b in ("attention", "mlp", "moe") if f"/{b}/" in permute.op_name)
            feeds = ancestors(body, permute.name)
            free = [
                g
                for g in gemms
                if f"/{block}/" in body[g].op_name
                and g not in feeds
                and permute.name not in before[g]
            ]
            assert free, f"{permute.name} ({permute.op_name}) has no GEMM beside it"
            checked += 1
    assert checked >= 2 * 3 * 2  # ring steps of the attention and expert blocks were walked


def test_comm_report_labels_the_ring_steps():
    """The report's ring column names each step, and the ring moves the plain
    collectives' token-exchange bytes (within 1%) (the first program of `PLANS`)."""
    from moe_jax.tools import comm_report

    one = with_plan("tp", 2, 4, "ep_etp", base=DENSE)
    reports = [
        comm_report.summarize(run.config, hlo_collectives.parse(run.hlo))
        for run in (planned(one), planned(_ring(one)))
    ]
    want, got = (r["activation_bytes_per_layer"]["measured_token_exchange"] for r in reports)
    assert got == pytest.approx(want, rel=0.01)
    rows = [row for row in reports[1]["collectives"] if row["tag"] == "token_exchange"]
    assert {row["ring"] for row in rows} == {0, 1, 2, 3}
    assert {row["kind"] for row in rows} == {"collective-permute"}
    table = comm_report.format_report({**reports[1], "compile_seconds": 0.0})
    assert any(
        line.split()[:5] == ["collective-permute", "forward", "activation", "token_exchange", "-"]
        and line.split()[5] == "3"
        for line in table.splitlines()
    )


def test_a_plan_without_a_ring_form_is_refused_in_one_line():
    from moe_jax.parallel import registry

    config = _ring(with_plan("dp", 1, 8, "ep_a2a"))
    found = registry.problems(config, 8, "cpu")
    assert len(found) == 1 and "has no exchange to rewrite" in found[0]
    assert "tp, sp, ep_ag, etp, ep_etp" in found[0]
    capacity = dataclasses.replace(config.moe, capacity_factor=1.25)
    config = dataclasses.replace(_ring(with_plan("tp", 2, 4, "ep_ag")), moe=capacity)
    found = registry.problems(config, 8, "cpu")
    assert len(found) == 1 and "moe.capacity_factor=1.25" in found[0]
