"""Where a run's numbers go: `metrics.jsonl`, TensorBoard, and the terminal."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import tqdm
from tensorboardX import SummaryWriter

# What the terminal line shows, in order (metrics.jsonl keeps everything): no plan, no
# wall clock, no per-layer lists.
TERMINAL = (
    ("loss", "loss"),
    ("lm_loss", "lm"),
    ("aux_loss", "aux"),
    ("z_loss", "z"),
    ("grad_norm", "grad_norm"),
    ("lr", "lr"),
    ("step_time_s", "step_s"),
    ("tokens_per_sec", "tok/s"),
    ("mfu", "mfu"),
    ("expert_load_max_over_mean", "load_max/mean"),
    ("dropped_fraction", "dropped"),
    ("eta_s", "eta_s"),
    ("val_loss", "val_loss"),
)


def _short(value: float) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The logged rows; a torn last line (a crash mid-write) is left out."""
    return _read(path)[0]


def _read(path: Path) -> tuple[list[dict[str, Any]], bool]:
    """(rows, whether a torn last line was left out)."""
    if not path.exists():
        return [], False
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    rows = []
    for i, line in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except ValueError:
            if i == len(lines) - 1:
                return rows, True
            raise ValueError(f"{path} line {i + 1} is not JSON; move the file aside") from None
    return rows, False


def _rewrite(path: Path, rows: list[dict[str, Any]]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(row) + "\n" for row in rows))
    os.replace(tmp, path)


class MetricsLogger:
    """One JSON object per line, the same scalars to TensorBoard, progress to the terminal.

    On resume, lines logged after the restored step (by a run that died before
    its next checkpoint) are dropped, and a torn last line (a crash mid-write) with
    them, so the file reads as one uninterrupted run.
    In a multi-process job only process 0 logs (`enabled`); the others keep quiet.
    """

    def __init__(self, workdir: Path, total_steps: int, start_step: int, enabled: bool = True):
        self.path = workdir / "metrics.jsonl"
        self.enabled = enabled
        if not enabled:
            return
        rows, torn = _read(self.path)
        kept = [row for row in rows if row["step"] <= start_step]
        if torn or len(kept) != len(rows):
            _rewrite(self.path, kept)
        self._file = self.path.open("a")
        self._tb = SummaryWriter(str(workdir / "tb"))
        self._bar = None
        if sys.stderr.isatty():
            self._bar = tqdm.tqdm(total=total_steps, initial=start_step, unit="step")

    def write(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        for key, value in row.items():
            if isinstance(value, int | float) and key != "step" and math.isfinite(value):
                self._tb.add_scalar(key, value, row["step"])
        shown = [(label, row.get(key)) for key, label in TERMINAL]
        summary = " ".join(
            [f"step={row['step']}"]
            + [f"{label}={_short(v)}" for label, v in shown if isinstance(v, int | float)]
        )
        if self._bar is not None:
            self._bar.write(summary)
        else:
            print(summary, flush=True)

    def advance(self, steps: int = 1) -> None:
        if self.enabled and self._bar is not None:
            self._bar.update(steps)

    def close(self) -> None:
        if not self.enabled:
            return
        self._file.close()
        self._tb.close()
        if self._bar is not None:
            self._bar.close()
