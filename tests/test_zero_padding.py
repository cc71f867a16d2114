"""ZeRO-1 over 3 data groups, which divide none of the test model's dimensions (32, 8,
16, 259, ...): the moments padded to split (`moe_jax.parallel.zero_padding`), on 6 of
the 8 forced CPU devices. The same step as ZeRO 0 (loss, every gradient, the
parameters and moments after three AdamW steps), each device holding a third of every
padded moment, the planner's memory model counting those bytes, and checkpoints
restoring between padded and unpadded plans."""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import optax

from moe_jax.checkpoint import Checkpointer
from moe_jax.config import Config
from moe_jax.parallel import mesh as mesh_lib
from moe_jax.plan import state_arrays
from moe_jax.plan.resolve import check_plan
from moe_jax.train_state import init_state
from tests.layouts import BASE, assert_trees_close, on_ragged_dot, run_under, with_plan

DATA, INTRA = 3, 2
BASE = on_ragged_dot(
    dataclasses.replace(BASE, train=dataclasses.replace(BASE.train, batch_size=12))
)


def _placed(config: Config):
    """`config` resolved and laid out on the first data x intra devices."""
    config = check_plan(config, DATA * INTRA)
    devices = jax.devices()[: DATA * INTRA]
    return config, mesh_lib.make_layout(config, mesh_lib.make_mesh(config, devices))


@functools.cache
def _run(zero: int):
    return run_under(*_placed(with_plan("sp", DATA, INTRA, "ep_a2a", base=BASE, zero=zero)))


def _moments(state):
    return jax.tree.leaves(optax.tree.get(state.opt_state, "mu")) + jax.tree.leaves(
        optax.tree.get(state.opt_state, "nu")
    )


def _unpadded(padded, shape):
    return np.asarray(padded)[tuple(slice(0, n) for n in shape)]


def test_padded_moments_step_as_zero_stage_0_on_a_third_of_the_bytes():
    got, want = _run(1), _run(0)
    np.testing.assert_allclose(got.metrics["loss"], want.metrics["loss"], rtol=1e-5)
    assert_trees_close(got.grads, want.grads, rtol=1e-5)
    assert_trees_close(*jax.device_get((got.state.params, want.state.params)), rtol=1e-5)
    padded, held, whole = 0, 0, 0
    for mine, theirs in zip(_moments(got.state), _moments(want.state), strict=True):
        shape = theirs.shape
        value = np.asarray(mine)
        assert_trees_close(_unpadded(value, shape), np.asarray(theirs), rtol=1e-5)
        extra = [i for i, (a, b) in enumerate(zip(value.shape, shape, strict=True)) if a != b]
        if extra:  # one dimension padded with zeros to split over 'data'
            (dim,) = extra
            padded += 1
            assert value.shape[dim] % DATA == 0 and value.shape[dim] - shape[dim] < DATA
            assert not np.take(value, range(shape[dim], value.shape[dim]), dim).any()
            assert mine.sharding.spec[dim] == "data"
        held += mine.addressable_shards[0].data.nbytes
        whole += theirs.addressable_shards[0].data.nbytes
    assert padded >= 0.8 * len(_moments(got.state))
    assert held < 0.5 * whole  # a third, a row or so more
    # the memory model: each device's moments as the planner counts them
    config = got.config
    counted = sum(
        state_arrays.device_bytes(config, a)
        for a in state_arrays.state_arrays(config)
        if a.moment and a.path.split(".")[-1].startswith(("mu", "nu"))
    )
    assert counted == held


def test_checkpoints_restore_between_padded_and_unpadded_plans(tmp_path):
    """The padded moments saved, restored under 8 devices' ZeRO 0 (their zeros dropped)
    and under the padded plan again (the same arrays)."""
    run = _run(1)
    checkpoints = Checkpointer(tmp_path, 2)
    checkpoints.save(3, run.state, {}, {})
    checkpoints.wait()

    def restored(config, layout):
        _, state = init_state(config, layout)
        shardings = mesh_lib.train_state_shardings(state, layout, config.parallel.zero)
        return checkpoints.restore(3, jax.device_put(state, shardings))[0]

    eight = check_plan(with_plan("tp", 2, 4, "etp", base=BASE), 8)
    unpadded = restored(eight, mesh_lib.make_layout(eight, mesh_lib.make_mesh(eight)))
    again = restored(*_placed(run.config))
    checkpoints.close()
    for saved, moved, back in zip(
        _moments(run.state), _moments(unpadded), _moments(again), strict=True
    ):
        np.testing.assert_array_equal(_unpadded(saved, moved.shape), np.asarray(moved))
        np.testing.assert_array_equal(np.asarray(saved), np.asarray(back))
    assert_trees_close(*jax.device_get((run.state.params, unpadded.params)), rtol=0)
