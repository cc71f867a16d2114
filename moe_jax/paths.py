"""The paths the commands read and write, checked before anything is built or written,
and the path settings a run stores, kept valid when the run is used from elsewhere.

Why: `convert export --hf /dev/null` and `convert import --workdir` under a file or on
/proc used to fail with a traceback after the weights were loaded, and a run trained on
`data.path=data` (relative to the directory it was started from) could not be sampled
from any other. Every input gets `check_input`, every output `check_output_dir` (one
`error:` line naming the flag and the path, nothing written). A run's `config.json` and
its checkpoints store each path setting relative to the run directory (`stored`), and
readers resolve it against the run directory (`resolved`): the run works from any
directory, and after the run and its data are moved together. docs/configuration.md
("Paths") states the rule.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

from moe_jax import workdir as workdir_lib

# The settings that name a path: stored relative to the run directory in config.json.
PATH_SETTINGS = (("data", "path"), ("train", "init_from"))
NEAR = 2  # levels above the run directory within which a path is stored relative
# Kernel file systems: nothing a command writes belongs there, whatever access() says.
PSEUDO_FS = {
    "proc",
    "sysfs",
    "devtmpfs",
    "devpts",
    "cgroup",
    "cgroup2",
    "debugfs",
    "tracefs",
    "securityfs",
    "pstore",
    "bpf",
    "configfs",
    "fusectl",
    "mqueue",
    "efivarfs",
    "binfmt_misc",
}


def _special(path: Path) -> str | None:
    """'a device', 'a pipe', ... when `path` is neither a regular file nor a directory."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return None
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISFIFO(mode):
        return "a pipe"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return None


def _file_system(path: Path) -> str:
    """The type of the file system holding `path` (the longest mount point above it)."""
    real = os.path.realpath(path)
    best, kind = "", ""
    try:
        with open("/proc/self/mounts", encoding="utf-8") as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) < 3:
                    continue
                point = fields[1].replace("\\040", " ")
                inside = real == point or real.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, kind = point, fields[2]
    except OSError:  # not Linux: no kernel file systems to rule out
        return ""
    return kind


def _existing(path: Path) -> Path:
    """`path` or its nearest existing ancestor."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_input(path: Path | str, flag: str, kind: str = "any") -> Path:
    """`path` when it can be read as `kind` ('file', 'dir' or 'any'); else a one-line
    ValueError naming `flag` and the path."""
    path = Path(path)
    name = f"{flag}={path}"
    if not path.exists():
        above = _existing(path)
        if above.exists() and not above.is_dir():
            raise ValueError(f"{name} does not exist: {above} is a file, not a directory")
        raise ValueError(f"{name} does not exist")
    special = _special(path)
    if special:
        raise ValueError(f"{name} is {special}, not a {'directory' if kind == 'dir' else 'file'}")
    if kind == "dir" and not path.is_dir():
        raise ValueError(f"{name} is a file; give a directory")
    if kind == "file" and not path.is_file():
        raise ValueError(f"{name} is a directory; give a file")
    need = os.R_OK | (os.X_OK if path.is_dir() else 0)
    if not os.access(path, need):
        raise ValueError(f"{name} is not readable by this user")
    return path


def check_output_dir(path: Path | str, flag: str, need_bytes: int = 0) -> Path:
    """`path` when it can be created (or is a directory) and written; else a one-line
    ValueError naming `flag` and the path. Writes nothing."""
    path = Path(path)
    special = _special(path)
    if special:
        raise ValueError(f"{flag}={path} is {special}, not a directory; give a new directory")
    kind = _file_system(_existing(path))
    if kind in PSEUDO_FS:
        raise ValueError(
            f"{flag}={path} is on the kernel's {kind} file system, where nothing can be "
            "written; give a directory on a disk"
        )
    workdir_lib.check(path, flag, need_bytes)
    return path


def umask() -> int:
    """This process's umask (read without changing it where Linux allows)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def follow_umask(path: Path | str) -> None:
    """Gives a file that a library wrote 0600 (safetensors does) the permissions of any
    other file the user writes: colleagues on a shared file system can read it."""
    os.chmod(path, 0o666 & ~umask())


def store(value: str, run_dir: Path) -> str:
    """A path setting as a run stores it: relative to `run_dir` when it lies at most
    `NEAR` levels above the run directory (runs/ and data/ side by side in a project,
    which move together), else absolute (a shared data set, which stays put)."""
    if not value:
        return value
    absolute_value = os.path.abspath(value)
    relative = os.path.relpath(absolute_value, os.path.abspath(run_dir))
    ups = 0
    for part in Path(relative).parts:
        if part != "..":
            break
        ups += 1
    return relative if ups <= NEAR else absolute_value


def stored(config_dict: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """`config_dict` (a resolved config as a dict) with each path setting as `store`
    writes it, as a run's config.json and checkpoints hold it."""
    out = {section: dict(values) for section, values in config_dict.items()}
    for section, key in PATH_SETTINGS:
        value = out.get(section, {}).get(key)
        if value:
            out[section][key] = store(value, run_dir)
    if "data" in out and "sources" in out["data"]:
        out["data"]["sources"] = _sources(out["data"]["sources"], lambda p: store(p, run_dir))
    return out


def _sources(value: Any, each) -> Any:
    """`data.sources` with `each` applied to every entry's directory (DIR:WEIGHT:NAME);
    anything else as it is (the config's checks name it)."""
    if not isinstance(value, str) or not value:
        return value
    entries = [entry.rsplit(":", 2) for entry in value.split(",")]
    if any(len(parts) != 3 for parts in entries):
        return value
    return ",".join(":".join([each(path), weight, name]) for path, weight, name in entries)


def resolve(value: str, run_dir: Path) -> str:
    """A stored path setting as an absolute path: relative ones against `run_dir`; one
    from a run written before that rule (relative to where it started) is taken as is
    when only it exists."""
    if not value or os.path.isabs(value):
        return value
    beside = os.path.normpath(os.path.join(os.path.abspath(run_dir), value))
    if not os.path.exists(beside) and os.path.exists(value):
        return os.path.abspath(value)
    return beside


def resolved(config_dict: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """The inverse of `stored`: each path setting of a run's config absolute."""
    out = {section: dict(values) for section, values in config_dict.items()}
    for section, key in PATH_SETTINGS:
        value = out.get(section, {}).get(key)
        if isinstance(value, str):
            out[section][key] = resolve(value, run_dir)
    if "data" in out and "sources" in out["data"]:
        out["data"]["sources"] = _sources(out["data"]["sources"], lambda p: resolve(p, run_dir))
    return out
