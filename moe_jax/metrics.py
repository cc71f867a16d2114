"""Where a run's numbers go: `metrics.jsonl`, TensorBoard, the terminal and, when
`train.wandb` asks for it, Weights & Biases (an optional package, never required)."""

from __future__ import annotations

import configparser
import hashlib
import importlib.util
import json
import math
import netrc
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import tqdm
from tensorboardX import SummaryWriter

# What the terminal line shows, in order (metrics.jsonl keeps everything): no plan, no
# wall clock, no per-layer lists.
TERMINAL = (
    ("loss", "loss"),
    ("lm_loss", "lm"),
    ("mtp_loss", "mtp"),
    ("aux_loss", "aux"),
    ("z_loss", "z"),
    ("grad_norm", "grad_norm"),
    ("max_attn_logit", "max_logit"),
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


def check_wandb(mode: str, env: Mapping[str, str] = os.environ) -> None:
    """One line, before anything compiles or is written, when W&B is asked for but not
    installed, or asked to log online without credentials (wandb would fail at its
    start, with a traceback, after the run had written its config and wandb/)."""
    if mode != "off" and importlib.util.find_spec("wandb") is None:
        raise ValueError(
            f"train.wandb={mode!r} needs the wandb package, which is not installed "
            "(pip install wandb), or train.wandb='off'"
        )
    if mode == "online" and not wandb_credentials(env):
        raise ValueError(
            "train.wandb='online' needs W&B credentials and none were found (WANDB_API_KEY, "
            "or `wandb login`, which writes ~/.netrc); log in, or use train.wandb='offline' "
            "(synced later with `wandb sync`) or 'off'"
        )


def wandb_credentials(env: Mapping[str, str] = os.environ) -> bool:
    """Whether wandb finds an API key without asking, where it looks for one: the
    environment (WANDB_API_KEY, an identity token file), the netrc entry for its host
    that `wandb login` writes, the api_key of its settings file. Read here, with no
    network and no wandb import."""
    if env.get("WANDB_API_KEY") or env.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlsplit(env.get("WANDB_BASE_URL") or "https://api.wandb.ai").netloc
    home = Path(env.get("HOME") or Path.home())
    found = [p for p in (home / ".netrc", home / "_netrc") if p.exists()]
    path = Path(env["NETRC"]).expanduser() if env.get("NETRC") else (found or [home / ".netrc"])[0]
    try:
        if netrc.netrc(str(path)).authenticators(host):
            return True
    except (OSError, netrc.NetrcParseError):
        pass
    settings = configparser.ConfigParser()
    config_dir = Path(env.get("WANDB_CONFIG_DIR") or home / ".config" / "wandb")
    try:
        settings.read(config_dir / "settings")
    except (OSError, configparser.Error):
        return False
    return bool(settings.get("default", "api_key", fallback=""))


def _wandb_run(workdir: Path, mode: str, project: str, config: dict[str, Any]):
    """A W&B run kept in `workdir`/wandb; its id comes from the workdir, so a resumed
    run goes on logging into the same W&B run."""
    import wandb

    run_id = hashlib.sha1(str(workdir.resolve()).encode()).hexdigest()[:16]
    (workdir / "wandb").mkdir(parents=True, exist_ok=True)
    settings = wandb.Settings(silent=True, console="off")
    try:
        return wandb.init(
            project=project, id=run_id, resume="allow", mode=mode, dir=str(workdir),
            config=config, name=workdir.name, settings=settings,
        )  # fmt: skip
    except Exception as error:  # wandb's own: a refused key, an unreachable server
        text = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise ValueError(
            f"train.wandb={mode!r}: W&B did not start ({text}); fix that, or use "
            "train.wandb='offline' (synced later with `wandb sync`) or 'off'"
        ) from None


class MetricsLogger:
    """One JSON object per line, the same scalars to TensorBoard, progress to the terminal.

    On resume, lines logged after the restored step (by a run that died before
    its next checkpoint) are dropped, and a torn last line (a crash mid-write) with
    them, so the file reads as one uninterrupted run.
    In a multi-process job only process 0 logs (`enabled`); the others keep quiet.
    """

    def __init__(
        self,
        workdir: Path,
        total_steps: int,
        start_step: int,
        enabled: bool = True,
        wandb: tuple[str, str, dict] | None = None,
    ):
        """`wandb`: (train.wandb mode, project, the run's config) to log there too."""
        self.path = workdir / "metrics.jsonl"
        self.enabled = enabled
        self._wandb = None
        if not enabled:
            return
        if wandb is not None and wandb[0] != "off":
            self._wandb = _wandb_run(workdir, *wandb)
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
        scalars = {
            key: value
            for key, value in row.items()
            if isinstance(value, int | float) and key != "step" and math.isfinite(value)
        }
        for key, value in scalars.items():
            self._tb.add_scalar(key, value, row["step"])
        if self._wandb is not None:
            self._wandb.log(scalars, step=row["step"])
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
        if self._wandb is not None:
            self._wandb.finish()
        if self._bar is not None:
            self._bar.close()
