"""`python tests/chaos.py POINT N [train flags]`: `python -m moe_jax.train` that kills
itself with SIGKILL (as a lost node does) the N-th time it reaches POINT.

Test-side fault injection for test_chaos.py; nothing in moe_jax knows about it. The
points, in the order a run reaches them:
- step: just after a step is dispatched;
- metrics_line: half-way through writing a metrics.jsonl line (a torn line);
- eval: during an evaluation, before its loss is logged;
- checkpoint_data: while a checkpoint's data files are being written;
- checkpoint_rename: before one of the renames that publish a checkpoint (each item's
  directory, then the step's own).
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import sys
import threading
import time
from pathlib import Path


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class _Countdown:
    def __init__(self, n: int):
        self.left = n

    def reached(self) -> bool:
        self.left -= 1
        return self.left == 0


def _step(n: int) -> None:
    from moe_jax.metrics import MetricsLogger

    countdown, advance = _Countdown(n), MetricsLogger.advance

    def advanced(self, steps: int = 1) -> None:
        advance(self, steps)
        if countdown.reached():
            _die()

    MetricsLogger.advance = advanced


def _metrics_line(n: int) -> None:
    from moe_jax.metrics import MetricsLogger

    countdown, write = _Countdown(n), MetricsLogger.write

    def written(self, row: dict) -> None:
        if countdown.reached():
            line = json.dumps(row) + "\n"
            with open(self.path, "a") as f:
                f.write(line[: len(line) // 2])
            _die()
        write(self, row)

    MetricsLogger.write = written


def _eval(n: int) -> None:
    from moe_jax import trainer

    countdown, evaluate = _Countdown(n), trainer._evaluate

    def evaluated(*args, **kwargs):
        if not countdown.reached():
            return evaluate(*args, **kwargs)
        threading.Timer(0.005, _die).start()  # most often mid-way
        evaluate(*args, **kwargs)
        _die()  # else just after, before the loss is logged

    trainer._evaluate = evaluated


def _watch_data_files(directory: Path, step: int) -> None:
    """Kills as soon as the save of `step` has written a data file (or has finished)."""
    deadline = time.time() + 30
    while time.time() < deadline:
        partial = directory.glob(f"{step}.orbax-checkpoint-tmp*/state*/**/d/*")
        if any(p.is_file() for p in partial) or (directory / str(step)).exists():
            break
        time.sleep(0.0005)
    _die()


def _checkpoint_data(n: int) -> None:
    from moe_jax.checkpoint import Checkpointer

    countdown, save = _Countdown(n), Checkpointer.save

    def saved(self, step: int, *args, **kwargs) -> bool:
        started = save(self, step, *args, **kwargs)
        if started and countdown.reached():
            watch = threading.Thread(target=_watch_data_files, args=(self.directory, step))
            watch.start()
        return started

    Checkpointer.save = saved


def _checkpoint_rename(n: int) -> None:
    countdown, rename = _Countdown(n), os.rename

    def renamed(source, target, *args, **kwargs):
        if f"{os.sep}checkpoints{os.sep}" in str(target) and countdown.reached():
            _die()
        return rename(source, target, *args, **kwargs)

    os.rename = renamed


POINTS = {
    "step": _step,
    "metrics_line": _metrics_line,
    "eval": _eval,
    "checkpoint_data": _checkpoint_data,
    "checkpoint_rename": _checkpoint_rename,
}

if __name__ == "__main__":
    point, n, *train_flags = sys.argv[1:]
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    POINTS[point](int(n))
    sys.argv = ["moe_jax.train", *train_flags]
    runpy.run_module("moe_jax.train", run_name="__main__", alter_sys=True)
