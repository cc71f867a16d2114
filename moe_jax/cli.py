"""What every command line shares: the `--config` flag and one-line errors for bad flags.

Why: absl and ml_collections report an unknown `--config.<section>.<key>` override, a
missing config file or a malformed flag as a 40-line traceback raised while the flags
are parsed, before `main` runs. `parse` is the flags parser the commands hand to
`absl.app.run`: it turns each of those into `error: ...` on one line and exit status 1,
naming the setting, what was probably meant and what is valid.
"""

from __future__ import annotations

import dataclasses
import difflib
import runpy
import sys
from pathlib import Path
from typing import Any

import ml_collections
from absl import flags
from ml_collections import config_flags
from ml_collections.config_flags.config_flags import ConfigFileFlagParser

from moe_jax import config as config_lib
from moe_jax import config_help, quiet, run_config

# The repository's configs, found from the package so that a command works from any
# directory (`pip install -e .` keeps the package inside the repository).
CONFIGS = Path(__file__).resolve().parents[1] / "configs"
DEFAULT_CONFIG = CONFIGS / "default.py"
CONFIG_HELP = (
    "Config file (default: configs/default.py); --config.<section>.<key>=VALUE overrides "
    "one setting; --config_help lists every setting with its value and meaning, and exits."
)


def define_config_flag(argv: list[str] | None = None):
    """`--config=FILE` (default: the repository's configs/default.py, from any directory).

    ml_collections reads the file and applies the `--config.*` overrides in `argv`
    (default: sys.argv) as soon as the flag is defined, so they are checked first.
    `--config_help` prints every setting with its value in that file (overrides
    applied) and its meaning, and exits."""
    argv = sys.argv if argv is None else argv
    if "--config_help" in argv:  # every setting, its value and meaning; then stop
        print(config_help.text(given_values(argv)))
        raise SystemExit(0)
    problem = check_config_args(argv)
    if problem:
        raise SystemExit(f"error: {problem}")
    holder = config_flags.DEFINE_config_file("config", str(DEFAULT_CONFIG), CONFIG_HELP)
    flags.FLAGS[holder.name].parser = _ConfigFileParser(holder.name)  # .json files too
    # `--help` lists the main module's flags: --config (and its --config_help) among them.
    flags.FLAGS.register_key_flag_for_module(sys.argv[0], flags.FLAGS["config"])
    return holder


def given_values(argv: list[str]) -> dict[str, Any]:
    """The settings of `--config=FILE` (default: configs/default.py) with the
    `--config.*` overrides in `argv` applied, as a plain dict, unvalidated: what
    `--config_help` shows. One line for a file or override that gives none."""
    problem = check_config_args(argv)
    if problem:
        raise SystemExit(f"error: {problem}")
    given = flags.FlagValues()
    config_flags.DEFINE_config_file("config", str(DEFAULT_CONFIG), flag_values=given, sys_argv=argv)
    given["config"].parser = _ConfigFileParser("config")
    try:
        given(argv, known_only=True)
        values = given.config
        return values.to_dict() if hasattr(values, "to_dict") else dict(values)
    except (flags.Error, KeyError, AttributeError, TypeError, ValueError) as error:
        message = str(error).strip("'\"").splitlines()[0]
        raise SystemExit(f"error: bad --config override: {message}") from None


class _ConfigFileParser(ConfigFileFlagParser):
    """ml_collections' parser of `--config=FILE`, which also reads a `.json` file of
    settings (a run's config.json: `moe_jax.run_config`) as a config; `check_config_args`
    has refused a bad one in one line before this runs."""

    def parse(self, path):
        if not str(path).endswith(".json"):
            return super().parse(path)
        config = ml_collections.ConfigDict(run_config.over_defaults(run_config.read_json(path)))
        if self._lock_config:
            config.lock()
        return config


def _config_file(argv: list[str]) -> str | None:
    """The FILE of `--config=FILE` or `--config FILE`, if given."""
    for i, arg in enumerate(argv[1:], 1):
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
    return None


def check_config_args(argv: list[str]) -> str | None:
    """The first problem of the config flags in `argv` (a missing file, an override that
    names no setting), as one line, or None."""
    name = _config_file(argv)
    if name is not None:
        check = _json_config_problem if name.endswith(".json") else _config_file_problem
        problem = check(name)
        if problem:
            return f"cannot load --config={name}: {problem}"
    for path in _overrides(argv):
        problem = unknown_setting(path)
        if problem:
            return problem
    return None


def _config_file_problem(name: str) -> str | None:
    """Why the config file `name` (`path[:argument]`) cannot give a config, or None. The
    file is run here, so its own errors read as one line and not as ml_collections'
    traceback."""
    path, _, argument = name.partition(":")
    if not Path(path).is_file():
        return f"no such file (configs are in {CONFIGS})"
    try:
        get_config = runpy.run_path(path).get("get_config")
    except SyntaxError as error:
        return f"SyntaxError at line {error.lineno}: {error.msg}"
    except Exception as error:  # whatever the user's file raises
        return f"running it raised {_one_line(error)}"
    if not callable(get_config):
        return "it defines no get_config()"
    try:
        made = get_config(*([argument] if argument else []))
    except Exception as error:
        return f"get_config() raised {_one_line(error)}"
    if not isinstance(made, (dict, ml_collections.ConfigDict)):
        kind = type(made).__name__
        what = "None" if made is None else f"{'an' if kind[0] in 'aeiou' else 'a'} {kind}"
        return f"get_config() returned {what}, not a ConfigDict"
    return None


def _json_config_problem(name: str) -> str | None:
    """Why the JSON config file `name` cannot give a valid config, or None."""
    if not Path(name).is_file():
        return "no such file"
    try:
        run_config.load_json(name)
    except ValueError as error:
        return str(error)
    return None


def _one_line(error: Exception) -> str:
    text = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _closest(word: str, valid: list[str]) -> str | None:
    close = difflib.get_close_matches(word, valid, n=1)
    return close[0] if close else None


def unknown_setting(path: str) -> str | None:
    """Why `--config.<path>` names no setting (with the closest one that exists and
    what is valid), or None when it names one."""
    section, _, key = path.partition(".")
    name = key.split(".")[0]
    sections = sorted(config_lib.SECTIONS)
    if section not in config_lib.SECTIONS:
        guess = _closest(section, sections)
        meant = f"{guess}.{name}" if guess else None
        if guess and name not in _fields(guess):
            meant = guess
        hint = f" (did you mean {meant}?)" if meant else ""
        return f"unknown setting {path}{hint}; valid sections: {sections}"
    fields = _fields(section)
    if name not in fields:
        guess = _closest(name, fields)
        hint = f" (did you mean {section}.{guess}?)" if guess else ""
        return f"unknown setting {section}.{name}{hint}; valid settings of {section}: {fields}"
    return None


def _fields(section: str) -> list[str]:
    return sorted(f.name for f in dataclasses.fields(config_lib.SECTIONS[section]))


def _overrides(argv: list[str]) -> list[str]:
    """The `<section>.<key>` paths of the `--config.<section>.<key>[=value]` flags."""
    found = []
    for arg in argv[1:]:
        if arg.startswith("--config."):
            found.append(arg[len("--config.") :].split("=", 1)[0])
    return found


def overridden(argv: list[str], config, sections: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """section -> {setting: value} for the `--config.<section>.<key>` flags in `argv`
    (values as the loaded `config` holds them), for commands that start from a run's
    saved config and change only what is given; one line for a section they keep."""
    given: dict[str, dict[str, Any]] = {s: {} for s in sections}
    for path in _overrides(argv):
        section, key = path.split(".", 1)
        if section not in given:
            raise SystemExit(
                f"error: --config.{path}: this command keeps the run's {section} settings; "
                f"it takes {', '.join(f'--config.{s}.*' for s in sections)}"
            )
        given[section][key] = config[section][key]
    return given


def parse(argv: list[str]) -> list[str]:
    """absl's flags parser with every flag error as one line (exit status 1); then, unless
    `--verbosity` is given, third-party INFO lines (jax's backend probing among them) and
    the noise of `moe_jax.quiet` stay out of the command's output."""
    problem = check_config_args(argv)
    if problem:
        raise SystemExit(f"error: {problem}")
    try:
        rest = flags.FLAGS(argv)
        if "config" in flags.FLAGS:
            flags.FLAGS.config  # noqa: B018  (loads the file: a missing one fails here)
    except flags.Error as error:
        raise SystemExit(f"error: {error}") from None
    except OSError:
        name = flags.FLAGS["config"].config_filename
        raise SystemExit(
            f"error: cannot load --config={name}: no such file or not readable"
        ) from None
    except (KeyError, AttributeError, TypeError, ValueError) as error:
        message = str(error).strip("'\"").splitlines()[0]
        raise SystemExit(f"error: bad --config override: {message}") from None
    if not flags.FLAGS["verbosity"].present:  # every command's rule: --verbosity shows them
        quiet.quiet_libraries()
    return rest
