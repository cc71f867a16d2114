"""Pipeline parallelism's state and memory (`moe_jax.parallel.pipeline`): checkpoints
that stay canonical across stages and repeats, the 352B plan compiled on one pipeline's
devices, and XLA's temporaries against the memory model."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import subprocess
import sys
import textwrap
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax.checkpoint import Checkpointer
from moe_jax.parallel import mesh as mesh_lib
from moe_jax.parallel import pipeline
from moe_jax.parallel.layout import STAGE
from moe_jax.parallel.pipeline_schedule import loop_sums, one_f_one_b
from moe_jax.plan.resolve import check_plan
from moe_jax.train_step import abstract_state, init_placed
from tests.commands import subprocess_env
from tests.layouts import FAST_COMPILE as FAST
from tests.layouts import on_ragged_dot
from tests.pipelined import pipeline_trip_counts, pipelined, placed

# --- checkpoints ------------------------------------------------------------------


@pytest.mark.parametrize(
    "saved,restored",
    [
        ((4, 2, 1, 4, 1), (1, 2, 4, 1, 1)),
        ((4, 2, 1, 4, 1), (2, 1, 4, 2, 2)),
        ((2, 1, 4, 2, 2), (4, 2, 1, 4, 1)),
        ((1, 2, 4, 1, 1), (2, 1, 4, 4, 2)),
    ],
    ids=lambda plan: "S{}xD{}xN{},M{},R{}".format(*plan),
)
def test_checkpoints_restore_bit_for_bit_across_stages_and_repeats(tmp_path, saved, restored):
    def config_of(plan):
        s, d, n, m, r = plan
        return pipelined(s, d, n, m, r) if s > 1 else pipelined(1, d, n, 1)

    config, layout, _, shardings = placed(config_of(saved))
    state = init_placed(config, layout, shardings)
    checkpoints = Checkpointer(tmp_path, keep=1)
    checkpoints.save(1, state, {}, {})
    checkpoints.wait()
    _, _, like, _ = placed(config_of(restored))
    got, _ = checkpoints.restore(1, like)
    checkpoints.close()
    # the restored arrays hold the run's form and placement...
    for value, target in zip(jax.tree.leaves(got), jax.tree.leaves(like), strict=True):
        assert value.shape == target.shape and value.sharding == target.sharding
    # ...and every value saved, bit for bit, in the canonical [layers, ...] order
    want = jax.device_get(pipeline.canonical(state))
    restored = jax.tree.leaves(jax.device_get(pipeline.canonical(got)))
    for a, b in zip(restored, jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)


def test_held_form_is_the_canonical_stack_reshaped():
    """[R, U / R] with stage s holding groups r S + s: the layers each stage runs."""
    config, layout, _, shardings = placed(pipelined(2, 1, 4, 2, 2))
    state = init_placed(config, layout, shardings)
    one, one_layout, _, one_shardings = placed(pipelined(1, 2, 4, 1))
    canonical = init_placed(one, one_layout, one_shardings)
    gate = state.params["moe"]["units"]["blocks"][0]["ffn"]["gate"]
    want = canonical.params["moe"]["units"]["blocks"][0]["ffn"]["gate"]
    assert gate.shape == (2, 2, *want.shape[1:])
    assert gate.sharding.spec[:2] == (None, STAGE)
    np.testing.assert_array_equal(np.asarray(gate).reshape(want.shape), np.asarray(want))
    held = np.asarray(want).reshape(gate.shape)
    np.testing.assert_array_equal(held[:, 1], np.asarray(want)[[1, 3]])
    for shard in gate.addressable_shards:  # stage 1 (devices 4-7) holds layers 1 and 3
        stage = shard.device.id // 4
        assert shard.index[1] == slice(stage, stage + 1)
        np.testing.assert_array_equal(np.asarray(shard.data), held[shard.index])


# --- the paper's 352B plan ----------------------------------------------------------

MEGASCALE_352B = textwrap.dedent(
    """
    import dataclasses, os, runpy, sys
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=120"
    os.environ["JAX_PLATFORMS"] = "cpu"
    from moe_jax import config as config_lib
    from moe_jax.parallel import mesh as mesh_lib
    from moe_jax.plan import memory
    from moe_jax.plan.resolve import check_plan
    from moe_jax.train_step import abstract_state
    from tests.abstract_step import compile_step, held_bytes
    raw = runpy.run_path("configs/megascale_352b.py")["get_config"]()
    raw.data.source, raw.data.path = "tokens", "unread"  # a real run's batch: documents
    base = config_lib.load(raw)
    # One pipeline of the planner's 1,440-H800 plan (`python -m moe_jax.plan
    # --config=configs/megascale_352b.py --gpus=1440`: 15 stages x 4 repeats of sp
    # attention and expert all-to-alls over n=8 with collective matmul, data=12, 30
    # micro-batches of 2 of each data group's 60 sequences; ep_a2a standing in for the
    # GPU-only ep_a2a_ragged) at reduced width: the 60 layers, 32 experts, top-3, GQA
    # 32/8 and 8,192-token sequences stay.
    model = dataclasses.replace(base.model, embed_dim=256, head_dim=8, vocab_size=4096)
    moe = dataclasses.replace(base.moe, expert_mlp_dim=256)
    plan = dataclasses.replace(
        base.parallel, attention="sp", experts="ep_a2a", intra=8, data=1, stages=15,
        repeats=4, microbatches=30, collective_matmul=True, schedule=sys.argv[1],
        stash_depth=int(sys.argv[2]),
    )
    train = dataclasses.replace(base.train, batch_size=60)
    config = dataclasses.replace(base, model=model, moe=moe, parallel=plan, train=train)
    config = check_plan(config, 120)
    layout = mesh_lib.make_layout(config, mesh_lib.make_mesh(config))
    graphdef, abstract = abstract_state(config, layout)
    shardings = mesh_lib.train_state_shardings(abstract, layout, 0)
    compiled = compile_step(config, layout, graphdef, abstract, shardings)
    print(config.model.num_layers, held_bytes(compiled), memory.memory_per_device(config).total)
    print(compiled.as_text())
    """
)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero_bubble"])
def test_megascale_352b_pipeline_compiles(schedule):
    """The 352B model's train step under its 1,440-GPU plan, one pipeline's 120 devices
    (forced CPU devices, abstract inputs: nothing allocated), at reduced width: 60
    layers in 15 stages x 4 repeats of one layer, 30 micro-batches, under each
    schedule; zero-bubble's as the planner picks it, a stash one tick deep
    (`parallel.stash_depth=1`), its 193 ticks as 1F1B's."""
    depth = str(int(schedule == "zero_bubble"))
    done = subprocess.run(
        [sys.executable, "-c", MEGASCALE_352B, schedule, depth],
        cwd=Path(__file__).resolve().parents[1],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    first, hlo = done.stdout.split("\n", 1)
    layers, held, predicted = map(int, first.split())
    assert layers == 60
    trips = pipeline_trip_counts(hlo)
    if schedule == "gpipe":  # 30 micro-batches, 4 repeats, 15 stages: 30 x 4 + 15 - 1 ticks
        assert trips.count(134) >= 2  # both ways
    else:  # the table's ticks in one loop, its 45 drain ticks (summing) in a second
        sums = loop_sums(one_f_one_b(15, 30, 4))
        assert (sums.start, sums.chunks, sums.summed) == (148, 15, 3)
        assert trips.count(148) == trips.count(45) == 1 and 134 not in trips, trips
    if schedule == "zero_bubble":  # its stash (4 items of one layer's weight-GEMM
        # operands) and the rest: XLA holds them as the model counts them
        assert held == pytest.approx(predicted, rel=0.15), (held, predicted)
    print(f"352B pipeline per device: compiled {held / 1e6:.0f} MB, model {predicted / 1e6:.0f} MB")


def _config(micro: int, repeats: int, schedule: str, seq: int, width: int):
    """S = 2, n = 4, one sequence of `seq` tokens per micro-batch, MLP and expert width
    `width` if given, no dense prefix, the experts on `ragged_dot`."""
    config = on_ragged_dot(pipelined(2, 1, 4, micro, repeats))
    model = dataclasses.replace(config.model, num_layers=4, first_k_dense=0, remat="full")
    moe = config.moe
    if width:
        model = dataclasses.replace(model, mlp_dim=width)
        moe = dataclasses.replace(moe, expert_mlp_dim=width)
    chunks = 8 if seq >= 512 else 1
    train = dataclasses.replace(config.train, batch_size=micro, seq_len=seq, loss_chunks=chunks)
    plan = dataclasses.replace(config.parallel, schedule=schedule)
    config = dataclasses.replace(config, model=model, moe=moe, train=train, parallel=plan)
    return check_plan(config, 8)


@functools.cache
def _temporaries_and_model(
    micro: int, repeats: int, schedule: str = "gpipe", seq: int = 512, width: int = 0
) -> tuple[int, int]:
    """XLA's temporaries of the compiled step of `_config` (no dense prefix: its
    backward's working set on XLA:CPU's blockwise attention is not the pipeline's; the
    experts on `ragged_dot`, as what a pipeline holds is no kernel's) and the memory
    model's activations."""
    from moe_jax.plan import memory
    from moe_jax.train_step import RATE, train_step

    config, layout, abstract, shardings = placed(_config(micro, repeats, schedule, seq, width))
    graphdef, _ = abstract_state(config, layout)
    tokens = jax.ShapeDtypeStruct((micro, seq), jnp.int32, sharding=mesh_lib.batch_sharding(layout))
    step = jax.jit(
        partial(train_step, graphdef, config), out_shardings=(shardings, None), donate_argnums=0
    )
    batch = {"inputs": tokens, "targets": tokens}
    # Only the memory is read: LLVM's optimisation level does not change it.
    compiled = step.lower(abstract, batch, RATE).compile(compiler_options=FAST)
    temporaries = compiled.memory_analysis().temp_size_in_bytes
    return temporaries, memory.memory_per_device(config).activations


A = 1 * 512 // 4 * 32 * 4  # a: one sequence per micro-batch, split 4 ways, fp32


def test_temporaries_grow_with_micro_batches_as_the_memory_model_says():
    """GPipe keeps every tick's input and stage 0's buffer: per micro-batch of M,
    (R + 1) a more per device. XLA's temporaries at M = S, 2 S and 4 S with
    micro-batches of the same size grow as `memory.pipeline_activation_bytes` says
    within 15%."""
    for repeats, factors in ((1, (1, 2, 4)), (2, (1, 2))):
        points = [_temporaries_and_model(2 * f, repeats) for f in factors]
        for (t1, m1), (t2, m2) in itertools.pairwise(points):
            assert t2 - t1 == pytest.approx(m2 - m1, rel=0.15)
        (_, m1), (_, m2) = points[:2]
        assert m2 - m1 == 2 * (repeats + 1) * A  # the model's own formula, for the record


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble"])
def test_one_f_one_b_holds_inputs_bounded_by_stages_not_micro_batches(schedule):
    """1F1B holds an item's input only from its forward to its backward (zero-bubble also
    a stash bounded by S), and embeds each micro-batch on stage 0 inside the loop: per
    micro-batch of M only token ids grow
    (XLA holds the gathered ids and each stage's own, about 6 bytes a token; the model
    counts the gathered 4 + 4), not the inputs in flight, with R = 2 as with one repeat:
    XLA's growth within a / 4 of the model's, against GPipe's (R + 1) a."""
    micro = (4, 8, 16)
    points = [_temporaries_and_model(m, 2, schedule) for m in micro]
    for (m_1, m_2), ((t1, p1), (t2, p2)) in zip(
        itertools.pairwise(micro), itertools.pairwise(points), strict=True
    ):
        grown, modelled = (t2 - t1) / (m_2 - m_1), (p2 - p1) / (m_2 - m_1)
        assert 0 < modelled < grown < modelled + A / 4, (m_1, m_2, t1, t2, p1, p2)
    assert grown < 0.1 * (2 + 1) * A  # GPipe's (R + 1) a


def test_zero_bubble_holds_its_stash_as_the_memory_model_says():
    """Zero-bubble keeps what each B leaves for its W (the weight GEMMs' inputs and output
    gradients) in a stash of S items: XLA's temporaries above 1F1B's as the memory
    model's say, within 15%."""
    zb, one_f = _temporaries_and_model(4, 2, "zero_bubble"), _temporaries_and_model(4, 2, "1f1b")
    grown, modelled = zb[0] - one_f[0], zb[1] - one_f[1]
    assert grown == pytest.approx(modelled, rel=0.15), (grown, modelled)


def test_one_f_one_b_holds_no_more_than_gpipe_where_weights_outweigh_activations():
    """Wide layers and short sequences, R = 2: each repeat's weight gradients are added
    into the loop's accumulator in place (read, added and written back as a slice, the
    accumulator cost a second copy of one repeat's gradients); the drain's sums hold a
    part and its sum, no copy of the accumulators (here half a repeat's gradients each:
    2 drain ticks), as the memory model counts them."""
    wide = dict(seq=64, width=2048)
    interleaved, _ = _temporaries_and_model(4, 2, "1f1b", **wide)
    gpipe, _ = _temporaries_and_model(4, 2, "gpipe", **wide)
    from moe_jax.plan import memory

    parts = memory.loop_sum_bytes(_config(4, 2, "1f1b", **wide), one_f_one_b(2, 4, 2))
    # the stack's gradients on a device (2 layers: expert up, gate and down, each
    # 8 x 32 x 2048 over n = 4, 3,145,728 bytes; the rest 43,520), in R = 2 repeats
    # of C = 2 parts (2 drain ticks)
    assert parts == 2 * (3 * 2 * 8 * 32 * 2048 // 4 * 4 + 43_520) // (2 * 2)
    assert interleaved <= gpipe * 1.01 + parts, (interleaved, gpipe, parts)
