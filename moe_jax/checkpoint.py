"""Checkpoints with orbax: asynchronous, atomic, the last K kept, resumed automatically.

A checkpoint holds the whole `TrainState` (params, optimizer state, step,
RNG, router biases), the data iterator's state and the resolved config.
Orbax writes each step into a temporary directory and renames it only once
complete, so a crash mid-save leaves the previous checkpoint as the latest.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

# Settings that change the shapes or meaning of saved parameters.
ARCHITECTURE_SECTIONS = ("model", "moe")
ARCHITECTURE_EXEMPT = {
    "moe.impl",
    "moe.tile_size",
    "model.dtype",
    "model.remat",
    "model.attention_impl",
}


def _flat(config: dict[str, Any]) -> dict[str, Any]:
    return {
        f"{section}.{key}": value
        for section in ARCHITECTURE_SECTIONS
        for key, value in config.get(section, {}).items()
        if f"{section}.{key}" not in ARCHITECTURE_EXEMPT
    }


class Checkpointer:
    """The checkpoints of one run directory."""

    def __init__(self, directory: Path, keep: int):
        # Which steps to save is the trainer's call; the manager only keeps the last K.
        self._options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=True, create=False
        )
        self.directory = Path(directory).absolute()
        self._manager = None

    @property
    def manager(self) -> ocp.CheckpointManager:
        if self._manager is None:
            self._manager = ocp.CheckpointManager(
                self.directory, options=self._options, item_names=("state", "data", "config")
            )
        return self._manager

    def latest_step(self) -> int | None:
        if not self.directory.exists():
            return None
        return self.manager.latest_step()

    def check_compatible(self, config: dict[str, Any]) -> None:
        """Refuses to resume a checkpoint written for a different architecture."""
        step = self.latest_step()
        if step is None:
            return
        ours, theirs = _flat(config), _flat(self.saved_config(step))
        for key in sorted(set(ours) | set(theirs)):
            if ours.get(key) != theirs.get(key):
                raise ValueError(
                    f"{self.directory} holds a checkpoint (step {step}) of another model: "
                    f"{key}={theirs.get(key)!r} there, {ours.get(key)!r} here; "
                    "use a new --workdir or the matching config"
                )

    def saved_config(self, step: int) -> dict[str, Any]:
        """The resolved config the checkpoint of `step` was written with (read through
        orbax, whatever its file layout)."""
        restored = self.manager.restore(
            step, args=ocp.args.Composite(config=ocp.args.JsonRestore())
        )
        return restored["config"] or {}

    def save(self, step: int, state, data_state: dict, config: dict) -> bool:
        """Starts an asynchronous save; returns whether one was started."""
        self.directory.mkdir(parents=True, exist_ok=True)
        if step in self.manager.all_steps():
            return False
        return self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                data=ocp.args.JsonSave(data_state),
                config=ocp.args.JsonSave(config),
            ),
        )

    def restore(self, step: int, like):
        """(state, data_state) of `step`, with `like`'s structure, shapes and shardings
        (arrays, or `jax.ShapeDtypeStruct`s carrying shardings: read straight into them)."""
        abstract = jax.tree.map(
            lambda x: (
                x if isinstance(x, jax.ShapeDtypeStruct) else ocp.utils.to_shape_dtype_struct(x)
            ),
            like,
        )
        restored = self.manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), data=ocp.args.JsonRestore()
            ),
        )
        return restored["state"], restored["data"]

    def wait(self) -> None:
        """Returns once the last save is complete on every process (before exiting on a signal)."""
        if self._manager is not None:
            self._manager.wait_until_finished()
            if jax.process_count() > 1:
                multihost_utils.sync_global_devices("moe_jax: checkpoint complete")

    def close(self) -> None:
        if self._manager is not None:
            self._manager.wait_until_finished()
            self._manager.close()
