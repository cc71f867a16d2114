"""Chunked token exchange (`parallel.overlap_chunks`) and collective matmul
(`parallel.collective_matmul`) on a GPU, from the scheduled program.

    python bench/gpu_overlap.py            # on the GPU machine (one GPU is enough)
    python bench/gpu_overlap.py --small    # a CPU dry run (8 forced host devices)

1. Schedule: compiles one training step for an 8-device mesh (on one GPU through
   XLA's mock GPU topology, as JAX's own tests do; on CPU with 8 host devices): `dp`
   attention with `ep_ag` and `ep_a2a` experts at C = 1, 2, 4 chunks, and `tp`
   attention with `ep_ag` experts without and with collective matmul. It reports from
   the scheduled HLO each asynchronous collective (start/done pair) of the attention,
   MLP and expert blocks with the GEMMs scheduled between its start and its done, i.e.
   the compute it can hide behind, and the blocks' token exchanges per chunk and ring
   step. XLA:CPU runs collectives synchronously, so the CPU run reports the exchanges
   and no pairs.
2. Pieces: forward and backward on one device of the expert block's grouped GEMM as C
   chunks of rows, and of a tensor-parallel projection as the n = 8 blocks of a ring,
   each against one call of the same FLOPs (ratio = one / pieces; the pieces should
   keep >= 0.9 of the monolithic rate).

Prints one JSON object last; exit status 1 when a check fails. Nothing here is used
by the trainer; runs end to end in well under 5 minutes.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

SMALL = "--small" in sys.argv
if SMALL:  # before jax is imported; any XLA flags of yours are kept
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )

import json  # noqa: E402
from functools import partial  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import repo_root  # noqa: E402, F401  (before moe_jax: this checkout on the path)
from timing import median_seconds  # noqa: E402

from moe_jax.tools import hlo_collectives  # noqa: E402

DEVICES = 8
COLLECTIVES = ("all-gather", "all-to-all", "reduce-scatter", "all-reduce", "collective-permute")
# The CPU dry run reads its programs and never runs them: XLA's backend (LLVM) skips its
# optimisations, about a fifth of the compile time, and the HLO is the same. (Also what
# notebooks/overlap.ipynb compiles with: the same programs, shared through JAX's cache.)
READ_ONLY = {"xla_backend_optimization_level": 0}
_GEMM_CALL = re.compile(r'custom_call_target="[^"]*(gemm|matmul)|triton_gemm')


def mock_devices() -> str:
    """Makes jax see DEVICES GPUs on this one (XLA's mock topology); returns what runs."""
    if SMALL:
        return "cpu"
    jax.config.update("jax_mock_gpu_topology", f"1x{DEVICES}x1")
    jax.config.update("jax_cuda_visible_devices", "0")
    return "gpu (mock topology)"


def step_program(attention: str, experts: str, chunks: int, ring: bool = False) -> str:
    """The compiled text of one training step of a small MoE model on DEVICES devices."""
    from moe_jax.config import Config, ModelConfig, MoEConfig, ParallelConfig, TrainConfig
    from moe_jax.parallel import mesh as mesh_lib
    from moe_jax.plan.resolve import check_plan
    from moe_jax.train_step import RATE, abstract_state, train_step, with_shardings

    width, seq = (32, 64) if SMALL else (1024, 2048)
    config = Config(
        model=ModelConfig(
            num_layers=2,
            first_k_dense=0,
            embed_dim=width,
            num_heads=8,
            num_kv_heads=8,
            head_dim=width // 8,
            dtype="float32" if SMALL else "bfloat16",
        ),
        # the GPU path's kernel, named so that the CPU dry run (and the overlap notebook,
        # which shares its programs) compiles it too
        moe=MoEConfig(num_experts=8, top_k=2, expert_mlp_dim=2 * width, impl="ragged_dot"),
        train=TrainConfig(batch_size=DEVICES, seq_len=seq),
        parallel=ParallelConfig(
            attention=attention,
            experts=experts,
            intra=DEVICES,
            data=1,
            overlap_chunks=chunks,
            collective_matmul=ring,
        ),
    )
    config = check_plan(config, jax.device_count())
    layout = mesh_lib.make_layout(config, mesh_lib.make_mesh(config))
    graphdef, abstract = abstract_state(config, layout)
    shardings = mesh_lib.train_state_shardings(abstract, layout, 0)
    tokens = jax.ShapeDtypeStruct(
        (config.train.batch_size, seq), jnp.int32, sharding=mesh_lib.batch_sharding(layout)
    )
    step = jax.jit(partial(train_step, graphdef, config), donate_argnums=0)
    batch = {"inputs": tokens, "targets": tokens}
    lowered = step.lower(with_shardings(abstract, shardings), batch, RATE)
    return lowered.compile(compiler_options=READ_ONLY if SMALL else None).as_text()


BLOCKS = ("attention", "mlp", "moe")


def _step(ins: hlo_collectives.Instruction) -> str:
    """Where a block's instruction belongs: "c<chunk>", "r<ring step>", both, or "-"."""
    parts = [f"c{ins.chunk}"] if ins.chunk is not None else []
    parts += [f"r{ins.ring}"] if ins.ring is not None else []
    return "".join(parts) or "-"


def schedule(hlo: str) -> dict:
    """The blocks' asynchronous collectives with the GEMMs scheduled inside each
    start/done pair, and their token exchanges by block and chunk / ring step (as
    "block/step", synchronous ones included)."""
    program = hlo_collectives.instructions(hlo)
    with_dot = {ins.computation for ins in program if ins.opcode == "dot"}

    def is_gemm(ins: hlo_collectives.Instruction) -> bool:
        fused = ins.opcode == "fusion" and bool(ins.called & with_dot)
        return ins.opcode == "dot" or fused or bool(_GEMM_CALL.search(ins.attrs))

    bodies: dict[str, list[hlo_collectives.Instruction]] = {}
    for ins in program:  # in program order: the schedule, once XLA has scheduled it
        bodies.setdefault(ins.computation, []).append(ins)
    pairs, exchanges = [], {}
    for body in bodies.values():
        opened: dict[str, tuple[str, str, int]] = {}
        for position, ins in enumerate(body):
            block = next((b for b in BLOCKS if f"/{b}/" in ins.op_name), None)
            kind = ins.opcode.removesuffix("-start")
            starts = ins.opcode.endswith("-start")
            where = f"{block}/{_step(ins)}"
            exchange = "token_exchange" in ins.op_name and (kind in COLLECTIVES or starts)
            if block and exchange:
                exchanges[where] = exchanges.get(where, 0) + 1
            if block and starts:
                opened[ins.name] = (kind, where, position)
            started = ins.operands & set(opened) if ins.opcode.endswith("-done") else set()
            for name in started:
                kind, where, begin = opened.pop(name)
                inside = sum(map(is_gemm, body[begin + 1 : position]))
                pairs.append({"kind": kind, "where": where, "gemms": inside})
    return {"exchanges": exchanges, "async_pairs": pairs}


def time_pieces(chunks: int, repeats: int) -> dict:
    """Grouped GEMM forward+backward: `chunks` calls on 1/chunks of the rows each, against
    one call on all of them (same FLOPs), on one device."""
    rows, dim, width, experts = (512, 64, 128, 8) if SMALL else (32768, 4096, 1408, 64)
    dtype = jnp.float32 if SMALL else jnp.bfloat16
    x = jax.random.normal(jax.random.key(0), (rows, dim), dtype)
    w = jax.random.normal(jax.random.key(1), (experts, dim, width), dtype) / dim**0.5
    sizes = jnp.full((experts,), rows // experts, jnp.int32)

    def loss(w, x, pieces: int):
        parts = jnp.split(x, pieces)
        per = sizes // pieces
        outs = [jax.lax.ragged_dot(p, w, per, preferred_element_type=jnp.float32) for p in parts]
        return sum(jnp.sum(o * o) for o in outs)

    grad = lambda pieces: jax.jit(jax.grad(partial(loss, pieces=pieces), argnums=(0, 1)))
    one = median_seconds(grad(1), (w, x), repeats)
    many = median_seconds(grad(chunks), (w, x), repeats)
    return {
        "one_ms": round(one * 1e3, 3),
        "chunked_ms": round(many * 1e3, 3),
        "ratio": round(one / many, 3),
    }


def time_ring_pieces(pieces: int, repeats: int) -> dict:
    """A tensor-parallel projection forward+backward: `pieces` GEMMs on 1/pieces of the
    rows each (a ring's steps), against one GEMM on all of them, on one device."""
    rows, dim, width = (256, 64, 128) if SMALL else (16384, 4096, 1792)
    dtype = jnp.float32 if SMALL else jnp.bfloat16
    x = jax.random.normal(jax.random.key(0), (rows, dim), dtype)
    w = jax.random.normal(jax.random.key(1), (dim, width), dtype) / dim**0.5

    def loss(w, x, pieces: int):
        outs = [p @ w for p in jnp.split(x, pieces)]
        return sum(jnp.sum(o.astype(jnp.float32) ** 2) for o in outs)

    grad = lambda pieces: jax.jit(jax.grad(partial(loss, pieces=pieces), argnums=(0, 1)))
    one = median_seconds(grad(1), (w, x), repeats)
    many = median_seconds(grad(pieces), (w, x), repeats)
    return {
        "one_ms": round(one * 1e3, 3),
        "ring_ms": round(many * 1e3, 3),
        "ratio": round(one / many, 3),
    }


def _chunks_seen(exchanges: dict, block: str) -> set[str]:
    return {where.split("/")[1] for where in exchanges if where.startswith(f"{block}/")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="a CPU dry run at tiny sizes")
    parser.parse_args()
    report = {"runs_on": mock_devices(), "jax": jax.__version__, "schedule": {}}
    ok = jax.device_count() == DEVICES
    if not ok:
        report["schedule_error"] = f"saw {jax.device_count()} devices, not {DEVICES}"
    runs = [("dp", e, c, False) for e in ("ep_ag", "ep_a2a") for c in (1, 2, 4)]
    runs += [("tp", "ep_ag", 1, False), ("tp", "ep_ag", 1, True)]
    for attention, experts, chunks, ring in runs if ok else ():
        name = f"{attention}+{experts}/C{chunks}" + ("+cm" if ring else "")
        found = schedule(step_program(attention, experts, chunks, ring))
        report["schedule"][name] = found
        print(f"{name}: token exchanges by block/step {found['exchanges']}", flush=True)
        for pair in found["async_pairs"]:
            print(f"  {pair['kind']} ({pair['where']}) encloses {pair['gemms']} GEMMs")
        moe = {w: n for w, n in found["exchanges"].items() if w.startswith("moe/")}
        if chunks > 1:  # every chunk has its exchanges, of equal number
            ok = ok and len(set(moe.values())) == 1 and len(moe) == chunks
        if ring:  # every ring step of every block, and nothing outside a ring
            steps = {f"r{i}" for i in range(DEVICES)}
            ok = ok and all(_chunks_seen(found["exchanges"], b) == steps for b in BLOCKS[::2])
    repeats = 2 if SMALL else 20
    report["pieces"] = {f"C{c}": time_pieces(c, repeats) for c in (2, 4)}
    report["pieces"]["ring8"] = time_ring_pieces(DEVICES, repeats)
    for key, value in report["pieces"].items():
        print(f"GEMM pieces {key}: {value}", flush=True)
    report["ok"] = ok
    print(json.dumps(report), flush=True)
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
