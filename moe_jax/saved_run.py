"""A run's workdir read back for the commands that use a checkpoint (export, and the
commands that sample or score): its resolved config and its newest checkpoint,
placed on this machine's devices under a plan of their own."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax

from moe_jax import config as config_lib
from moe_jax import paths
from moe_jax.checkpoint import Checkpointer
from moe_jax.parallel import mesh as mesh_lib
from moe_jax.plan.resolve import check_plan
from moe_jax.train_step import abstract_state, with_shardings


def saved_config(workdir: Path) -> config_lib.Config:
    """The resolved config a run wrote to `workdir`/config.json, or one line."""
    path = workdir / "config.json"
    if not path.is_file():
        raise ValueError(f"{workdir}: no config.json (not a moe_jax run directory)")
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"{path} cannot be read as JSON ({type(error).__name__})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path} holds a JSON {type(raw).__name__}, not a run's settings")
    return config_lib.load(paths.resolved(raw, workdir))


def placed(config: config_lib.Config, parallel: config_lib.ParallelConfig):
    """(config with `parallel` resolved for this machine's devices, layout, graphdef,
    abstract TrainState in the plan's shardings)."""
    config = check_plan(dataclasses.replace(config, parallel=parallel), jax.device_count())
    layout = mesh_lib.make_layout(config, mesh_lib.make_mesh(config))
    graphdef, abstract = abstract_state(config, layout)
    shardings = mesh_lib.train_state_shardings(abstract, layout, config.parallel.zero)
    return config, layout, graphdef, with_shardings(abstract, shardings)


def restore(workdir: Path, parallel: config_lib.ParallelConfig, say=print, **sections):
    """(config, layout, graphdef, step, state) of the newest readable checkpoint of the
    run in `workdir`, restored into `parallel`'s plan (any plan: checkpoints are
    canonical), or one line. `sections` replace the run's (say, the data to score);
    nothing trains on the state, so by default the batch is one sequence per device,
    which splits over any plan of this machine."""
    config = saved_config(workdir)
    train = dataclasses.replace(config.train, batch_size=jax.device_count(), grad_accum=1)
    config = dataclasses.replace(config, **{"train": train, **sections})
    config, layout, graphdef, like = placed(config, parallel)
    checkpoints = Checkpointer(workdir / "checkpoints", config.train.keep_checkpoints)
    try:
        found = checkpoints.restore_newest(like, say)
    finally:
        checkpoints.close()
    if found is None:
        raise ValueError(f"{workdir}: no readable checkpoint in {workdir / 'checkpoints'}")
    step, state, _ = found
    return config, layout, graphdef, step, state
