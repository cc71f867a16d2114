"""A run's saved settings as a config: resuming with `--workdir RUN` alone, and
`--config=FILE.json` (a run's config.json, or any JSON of settings).

Why: a resume used to need every data, batch and sequence flag retyped, since the
defaults came from configs/default.py, not from the run; and a run's own config.json
could not be passed back as `--config` (ml_collections ran it as Python). The rule:
without `--config`, a workdir that holds a run's config.json supplies the defaults and
the `--config.*` flags given change them (listed in one line at start); with
`--config=FILE` the file is the base, as for a new run, and the checkpoint refuses what
cannot change. Importable without jax.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

from moe_jax import config as config_lib
from moe_jax import paths


def is_run_config(raw: Any) -> bool:
    """Whether `raw` is what a run writes as config.json: every section, nothing else."""
    return isinstance(raw, dict) and set(raw) == set(config_lib.SECTIONS)


def read_json(path: str | Path) -> dict[str, dict[str, Any]]:
    """The sections of settings in the JSON file `path`, or a one-line ValueError."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"not readable ({getattr(error, 'strerror', None) or error})") from None
    try:
        raw = json.loads(text)
    except ValueError as error:
        raise ValueError(f"not JSON (line {error.lineno}: {error.msg})") from None
    if not isinstance(raw, dict) or not all(isinstance(v, dict) for v in raw.values()):
        raise ValueError(
            "not a config: a JSON object of sections of settings is expected "
            f"({sorted(config_lib.SECTIONS)}), as a run's config.json is"
        )
    # A run's config.json stores its paths relative to the run directory (moe_jax.paths).
    return paths.resolved(raw, Path(path).parent) if is_run_config(raw) else raw


def over_defaults(raw: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every setting: `raw`'s where it has one, the default elsewhere. A whole number for
    a float setting becomes a float, so a `--config.<a>.<b>=0.5` override parses."""
    full = dataclasses.asdict(config_lib.Config())
    for section, values in raw.items():
        defaults = full.setdefault(section, {})
        for key, value in values.items():
            is_int = isinstance(value, int) and not isinstance(value, bool)
            defaults[key] = (
                float(value) if is_int and isinstance(defaults.get(key), float) else value
            )
    return full


def load_json(path: str | Path) -> config_lib.Config:
    """The validated config of the JSON file `path`, or a one-line ValueError."""
    return config_lib.load(over_defaults(read_json(path)))


# Settings added with a default that changes what a run computes, and the value that
# reproduces the runs saved before them: such a run resumes as it ran (its data
# iterator's state and its losses assume the old way).
ADDED_SINCE = {"data": {"document_mask": False}}


def saved(workdir: Path) -> dict[str, dict[str, Any]] | None:
    """The settings of the run in `workdir` (its config.json), or None when it holds no
    run's config.json (a file no run wrote is the trainer's to refuse)."""
    path = Path(workdir) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not is_run_config(raw):
        return None
    for section, values in ADDED_SINCE.items():
        for key, value in values.items():
            raw[section].setdefault(key, value)
    return paths.resolved(raw, workdir)


def with_overrides(base: dict, overrides: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """`base` with the `--config.<section>.<key>` values of `overrides` (flat paths)."""
    result = copy.deepcopy(base)
    for path, value in overrides.items():
        section, key = path.split(".", 1)
        result.setdefault(section, {})[key] = value
    return result


def resume_line(workdir: Path, base: dict, config: config_lib.Config) -> str:
    """The line a resume from saved settings starts with: where they came from, and each
    setting the flags changed (`train.steps 4 -> 6`)."""
    ours = dataclasses.asdict(config)
    changed = [
        f"{section}.{key} {base[section][key]!r} -> {value!r}"
        for section, values in ours.items()
        for key, value in values.items()
        if key in base.get(section, {}) and base[section][key] != value
    ]
    line = f"resuming {workdir} with its saved settings ({Path(workdir) / 'config.json'})"
    return f"{line}; changed: {', '.join(changed)}" if changed else line
