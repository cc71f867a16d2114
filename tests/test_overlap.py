"""Chunked token exchange (`parallel.overlap_chunks`; expert blocks, and sp's attention
over its batch): the same numbers as one chunk, and in the compiled program C exchanges
of 1/C the size, with no chunk's GEMM waiting for a later chunk's exchange."""

from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np
import pytest

from moe_jax.tools import hlo_collectives
from tests.layouts import assert_trees_close, planned, with_plan
from tests.test_parallel import _exchanges

# One plan per dispatcher: all-gather (ep_ag, etp, ep_etp) and all-to-all (ep_a2a), on
# intra groups of 4 and 8, under attention layouts that split the batch or the sequence.
# Each in 4 chunks (2 chunks run in test_collective_matmul, test_pipeline and test_mtp).
PLANS = [("dp", "ep_ag", 2, 4), ("dp", "ep_a2a", 1, 8), ("sp", "etp", 2, 4), ("tp", "ep_etp", 2, 4)]


def _chunked(config, chunks: int):
    return dataclasses.replace(
        config, parallel=dataclasses.replace(config.parallel, overlap_chunks=chunks)
    )


@pytest.mark.parametrize("chunks", [4])
@pytest.mark.parametrize("attention,experts,data,intra", PLANS)
def test_chunks_give_the_numbers_of_one(attention, experts, data, intra, chunks):
    """Loss, its parts and every gradient of the first step, and the parameters after
    three AdamW steps, within 1e-6 of the unchunked block (dropless routing)."""
    one = with_plan(attention, data, intra, experts)
    got, want = planned(_chunked(one, chunks)), planned(one)
    for key in ("loss", "lm_loss", "aux_loss", "seq_aux_loss", "z_loss"):
        np.testing.assert_allclose(got.metrics[key], want.metrics[key], rtol=1e-6, err_msg=key)
    np.testing.assert_array_equal(got.metrics["load"], want.metrics["load"])
    assert_trees_close(got.grads, want.grads, rtol=1e-6)
    assert_trees_close(jax.device_get(got.state.params), jax.device_get(want.state.params), 1e-6)


def _by_pass(hlo: str, block: str = "moe") -> dict[tuple[str, str], list[int]]:
    """Sizes of a block's token exchanges by (kind, pass), one per execution."""
    found: dict[tuple[str, str], list[int]] = {}
    for kind, collectives in _exchanges(hlo, block).items():
        for c in collectives:
            found.setdefault((kind, c.pass_), []).extend([c.bytes] * c.count)
    return found


@pytest.mark.parametrize("chunks", [4])
@pytest.mark.parametrize(
    "attention,experts,intra,block,kinds",
    [
        ("dp", "ep_ag", 4, "moe", {"all-gather", "reduce-scatter"}),
        ("dp", "ep_a2a", 8, "moe", {"all-to-all"}),
        # Ulysses, chunked over the batch (the programs of test_chunks_give_the_numbers_of_one)
        ("sp", "etp", 4, "attention", {"all-to-all"}),
    ],
)
def test_each_exchange_runs_once_per_chunk_at_a_chunks_size(
    attention, experts, intra, block, kinds, chunks
):
    one = with_plan(attention, 8 // intra, intra, experts)
    want = _by_pass(planned(one).hlo, block)
    got = _by_pass(planned(_chunked(one, chunks)).hlo, block)
    assert set(got) == set(want)
    assert {kind for kind, _ in want} == kinds
    for key, sizes in want.items():
        assert len(got[key]) == chunks * len(sizes), key  # forward and backward alike
        assert sorted(got[key]) == sorted(s // chunks for s in sizes for _ in range(chunks)), key


def _chunk(ins: hlo_collectives.Instruction) -> tuple[str, bool, int] | None:
    """(block kind, backward?, chunk) of an instruction of a chunked block, else None:
    chunks compare within one block and pass (the expert block chunks the sequence and
    sp's attention the batch, so a backward chunk of one needs every chunk of the other)."""
    if ins.chunk is None:
        return None
    block = "moe" if "/moe/" in ins.op_name else "attention"
    return block, "transpose(" in ins.op_name, ins.chunk


@pytest.mark.parametrize("attention,experts", [("dp", "ep_ag"), ("sp", "ep_a2a")])
def test_no_chunk_waits_for_a_later_chunks_exchange(attention, experts):
    """Def-use walk over the compiled program: the operands of each chunk's GEMMs (dots,
    or fusions that hold one; the expert block's, and sp's attention's) reach only
    exchanges of that chunk or earlier."""
    hlo = planned(_chunked(with_plan(attention, 2, 4, experts), 4)).hlo
    program = hlo_collectives.instructions(hlo)
    with_dot = {ins.computation for ins in program if ins.opcode == "dot"}
    bodies: dict[str, dict[str, hlo_collectives.Instruction]] = {}
    for ins in program:
        bodies.setdefault(ins.computation, {})[ins.name] = ins
    collectives = ("all-gather", "reduce-scatter", "all-to-all", "all-reduce")
    checked, own = 0, 0  # GEMMs walked; those that reach their own chunk's exchange
    for body in bodies.values():
        for gemm in body.values():
            is_gemm = gemm.opcode == "dot" or (gemm.opcode == "fusion" and gemm.called & with_dot)
            chunk = _chunk(gemm)
            if chunk is None or not is_gemm:
                continue
            seen, todo = set(), list(gemm.operands)
            while todo:
                other = todo.pop()
                if other in seen or other not in body:
                    continue
                seen.add(other)
                its_chunk = _chunk(body[other])
                collective = body[other].opcode.startswith(collectives)
                if collective and its_chunk is not None and its_chunk[:2] == chunk[:2]:
                    assert its_chunk[2] <= chunk[2], f"{gemm.name} {chunk} waits for {other}"
                    own += its_chunk == chunk
                todo.extend(body[other].operands)
            checked += 1
    assert checked >= 4 and own > 0  # the walk found GEMMs and the exchanges they wait for


@pytest.mark.parametrize("experts,intra", [("ep_ag", 4), ("ep_a2a", 8)])
def test_comm_report_shows_the_chunks_with_the_bytes_of_one(experts, intra):
    """The report labels each exchange by its chunk, and the chunks together move the
    bytes of the unchunked block (within 1%)."""
    from moe_jax.tools import comm_report

    one = planned(with_plan("dp", 8 // intra, intra, experts))
    four = planned(_chunked(one.config, 4))
    reports = [
        comm_report.summarize(run.config, hlo_collectives.parse(run.hlo)) for run in (one, four)
    ]
    got, want = (r["activation_bytes_per_layer"]["measured_token_exchange"] for r in reports[::-1])
    assert got == pytest.approx(want, rel=0.01)
    rows = [row for row in reports[1]["collectives"] if row["tag"] == "token_exchange"]
    assert {row["chunk"] for row in rows} == {0, 1, 2, 3}
    table = comm_report.format_report({**reports[1], "compile_seconds": 0.0})
    assert re.search(r"token_exchange\s+3\s+-\s+\d", table)  # the chunk column (no ring)
