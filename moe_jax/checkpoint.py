"""Checkpoints with orbax: asynchronous, atomic, the last K kept, resumed automatically.

A checkpoint holds the whole `TrainState` (params, optimizer state, step,
RNG, router biases), the data iterator's state and the resolved config. Arrays are
written in their canonical form whatever the plan: a pipeline's stage-split layer
stacks as the [layers, ...] arrays of any other run (`moe_jax.parallel.pipeline`).
Orbax writes each step into a temporary directory and renames it only once
complete, so a crash mid-save leaves the previous checkpoint as the latest.
"""

from __future__ import annotations

import contextlib
import gc
import math
import re
import shutil
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils
from orbax.checkpoint._src.metadata import array_metadata_store

from moe_jax.parallel import pipeline

# Settings that change the shapes or meaning of saved parameters.
ARCHITECTURE_SECTIONS = ("model", "moe")
ARCHITECTURE_EXEMPT = {
    "moe.impl",
    "moe.tile_size",
    "model.dtype",
    "model.remat",
    "model.attention_impl",
}


def architecture(config: dict[str, Any]) -> dict[str, Any]:
    """The settings of a config dict that shape or give meaning to its parameters."""
    return {
        f"{section}.{key}": value
        for section in ARCHITECTURE_SECTIONS
        for key, value in config.get(section, {}).items()
        if f"{section}.{key}" not in ARCHITECTURE_EXEMPT
    }


SPACE_MARGIN = 64 * 2**20  # bytes: metadata, the data iterator's state, the config


def bytes_written(state) -> int:
    """Bytes a checkpoint of `state` writes in all (arrays, or `jax.ShapeDtypeStruct`s, so
    it is known before the state exists): every array once, whichever processes write
    its shards, since they all write to the one checkpoint directory."""
    return sum(math.prod(leaf.shape) * leaf.dtype.itemsize for leaf in jax.tree.leaves(state))


def _write_failure(step: int, directory: Path, error: Exception) -> str:
    """One line for an asynchronous write that failed (a full disk, a vanished path)."""
    text = str(error)
    if "No space left on device" in text or "os_error_code='28'" in text:
        cause = "the disk is full"
    else:
        cause = (text.strip().splitlines() or [type(error).__name__])[0][:160]
    return (
        f"could not write the checkpoint of step {step} in {directory}: {cause}; the "
        "previous checkpoint stays the newest (the partial write is ignored, and removed "
        "at the next start); free space and run again to resume from it"
    )


def _key(path) -> tuple[str, ...]:
    """A state leaf's path as plain names, the same for the saved metadata's dicts and
    the state's dataclass, `nnx.State` and `Variable`s."""
    keys = (getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path)
    return tuple(str(k) for k in keys if str(k) != "value")


def _damaged_file(error: Exception, directory: Path) -> str:
    """The file under `directory` an error names, else the error's first line."""
    text = str(error)
    match = re.search(re.escape(str(directory)) + r"[^\s'\"\],)]*", text)
    if match and match.group(0).rstrip("/") != str(directory):
        return match.group(0)
    first = text.strip().splitlines()[0] if text.strip() else type(error).__name__
    first = first.split(". See full")[0]  # tensorstore appends a method's repr
    return f"{directory}: {first[:160]}"


# Orbax splits the writing of a replicated array between its replicas (on CPU and TPU),
# each replica's slice an eagerly dispatched operation; for slices under a MiB that costs
# more than the parallel write saves (hundreds of tiny compiles per save of a small
# model), so only larger slices are written in parallel. The array metadata store is the
# one orbax's default handler uses.
ocp.type_handlers.register_type_handler(
    jax.Array,
    ocp.type_handlers.ArrayHandler(
        array_metadata_store=array_metadata_store.Store(),
        min_slice_bytes_for_replica_parallel=1 << 20,
    ),
    override=True,
)


class Checkpointer:
    """The checkpoints of one run directory."""

    def __init__(self, directory: Path, keep: int):
        # Which steps to save is the trainer's call; the manager only keeps the last K.
        self._options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            enable_async_checkpointing=True,
            create=False,
            cleanup_tmp_directories=True,  # a save a crash cut short is never resumed
        )
        self.directory = Path(directory).absolute()
        self._manager = None
        self._writing: int | None = None  # the step of the save in flight

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

    def steps(self) -> list[int]:
        """Saved steps, newest first."""
        if not self.directory.exists():
            return []
        return sorted(self.manager.all_steps(), reverse=True)

    def newest_readable(self) -> tuple[int, dict[str, Any]] | None:
        """(step, saved config) of the newest checkpoint whose config reads; reads only."""
        for step in self.steps():
            try:
                return step, self.saved_config(step)
            except Exception:  # damaged: `restore_newest` reports it and moves it aside
                continue
        return None

    def restore_newest(self, like, say, own: bool = True) -> tuple[int, Any, dict] | None:
        """(step, state, data_state) of the newest checkpoint that restores whole, or None.

        A damaged checkpoint (a truncated or missing file, garbled metadata) is reported
        in one line through `say`, naming it and the file where known, and moved aside to
        `<workdir>/checkpoints-damaged/`, never deleted; the next older one is tried.
        Another run's checkpoints (`own=False`: `train.init_from` reads them) are only
        reported, never moved."""
        for step in self.steps():
            where = self.directory / str(step)
            item = "config"
            try:
                self.saved_config(step)
                item = "state"
                state, data_state = self.restore(step, like)
                return step, state, data_state
            except Exception as error:  # what orbax and tensorstore raise varies by damage
                gc.collect()  # the reads orbax abandoned go now, not at interpreter exit
                why = f"checkpoint {where} is damaged ({_damaged_file(error, where / item)})"
                if not own:
                    say(f"{why}; left where it is, reading the one before")
                    continue
                say(f"{why}; moved to {self._move_aside(step)}, resuming from the one before")
        return None

    @property
    def damaged_directory(self) -> Path:
        """Where damaged checkpoints are moved: beside the good ones, never deleted."""
        return self.directory.parent / "checkpoints-damaged"

    def _move_aside(self, step: int) -> Path:
        aside = self.damaged_directory
        aside.mkdir(exist_ok=True)
        target = aside / str(step)
        suffix = 1
        while target.exists():
            target, suffix = aside / f"{step}.{suffix}", suffix + 1
        (self.directory / str(step)).rename(target)
        if self._manager is not None:  # forget the step it listed
            self._manager.close()
            self._manager = None
        return target

    def saved_config(self, step: int) -> dict[str, Any]:
        """The resolved config the checkpoint of `step` was written with (read through
        orbax, whatever its file layout); a ValueError, as for unreadable JSON, when it
        is not a config's sections (a hand-edited checkpoint)."""
        restored = self.manager.restore(
            step, args=ocp.args.Composite(config=ocp.args.JsonRestore())
        )
        config = restored["config"] or {}
        if not isinstance(config, dict) or not all(isinstance(v, dict) for v in config.values()):
            raise ValueError(f"its config is not a moe_jax config's sections: {config!r:.80}")
        return config

    def save(self, step: int, state, data_state: dict, config: dict) -> bool:
        """Starts an asynchronous save; returns whether one was started. A one-line
        ValueError, before anything is written, when the disk cannot hold it."""
        self.directory.mkdir(parents=True, exist_ok=True)
        if step in self.manager.all_steps():
            return False
        need = bytes_written(state) + SPACE_MARGIN
        free = shutil.disk_usage(self.directory).free
        if free < need:
            raise ValueError(
                f"not enough space to checkpoint step {step} in {self.directory}: "
                f"{need / 1e9:.2f} GB needed, {free / 1e9:.2f} GB free; the previous "
                "checkpoint is intact; free space and run again to resume from it"
            )
        with self._failures():  # the previous save's failure surfaces here
            started = self.manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(pipeline.canonical(state)),
                    data=ocp.args.JsonSave(data_state),
                    config=ocp.args.JsonSave(config),
                ),
            )
        self._writing = step
        return started

    @contextlib.contextmanager
    def _failures(self):
        """Turns a failed asynchronous write into a one-line ValueError. What it left
        half-written (orbax writes into `<step>.orbax-checkpoint-tmp*`) is never listed as
        a step; it is removed now as far as it can be, and by orbax at the next start."""
        try:
            yield
        except Exception as error:  # tensorstore and orbax raise ValueError, OSError, ...
            step, self._writing = self._writing, None
            gc.collect()  # the writes orbax abandoned go now, not at interpreter exit
            for partial in self.directory.glob(f"{step}.orbax-checkpoint-tmp*"):
                shutil.rmtree(partial, ignore_errors=True)  # frees what it can now
            raise ValueError(_write_failure(step, self.directory, error)) from None

    def restore(self, step: int, like):
        """(state, data_state) of `step`, with `like`'s structure, shapes and shardings
        (arrays, or `jax.ShapeDtypeStruct`s carrying shardings: read straight into them)."""
        abstract = jax.tree.map(
            lambda x: (
                x if isinstance(x, jax.ShapeDtypeStruct) else ocp.utils.to_shape_dtype_struct(x)
            ),
            like,
        )
        target = pipeline.canonical(abstract)
        strict = not self._padded_apart(step, target)
        restored = self.manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(target, strict=strict),
                data=ocp.args.JsonRestore(),
            ),
        )
        return pipeline.staged(restored["state"], abstract), restored["data"]

    def _padded_apart(self, step: int, target) -> bool:
        """Whether the saved state differs from `target`'s shapes, and only where ZeRO-1
        pads moments (`moe_jax.parallel.zero_padding`): optimizer state, one dimension
        each. Orbax then pads the zeros or drops them; any other difference stays
        orbax's error."""
        path = epath.Path(self.directory / str(step) / "state")
        saved = ocp.StandardCheckpointHandler().metadata(path).tree
        shapes = {_key(p): leaf.shape for p, leaf in jax.tree_util.tree_leaves_with_path(saved)}
        apart = False
        for p, leaf in jax.tree_util.tree_leaves_with_path(target):
            key, shape = _key(p), tuple(leaf.shape)
            old = tuple(shapes.get(key, shape))
            if old == shape:
                continue
            differ = (
                len(old) == len(shape) and sum(a != b for a, b in zip(old, shape, strict=True)) == 1
            )
            if key[0] != "opt_state" or not differ:
                return False
            apart = True
        return apart

    def wait(self) -> None:
        """Returns once the last save is complete on every process (before exiting on a signal)."""
        if self._manager is not None:
            with self._failures():
                self._manager.wait_until_finished()
            if jax.process_count() > 1:
                multihost_utils.sync_global_devices("moe_jax: checkpoint complete")

    def close(self) -> None:
        """Waits for the save in flight (a one-line ValueError if it failed) and closes."""
        if self._manager is not None:
            manager, self._manager = self._manager, None
            try:
                with self._failures():
                    manager.wait_until_finished()
            finally:
                manager.close()
