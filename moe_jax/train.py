"""`python -m moe_jax.train [--config=configs/<name>.py] [--config.<a>.<b>=<v>] [--workdir=DIR]`.

With no flags it trains `configs/default.py` on the embedded corpus (the
Python standard library's source) into `runs/default`. Exit status: 0 when
done, 1 on bad input, 75 when a signal (SIGTERM, Ctrl-C) made it save and
stop early; rerunning the same command resumes, and so does `--workdir=RUN`
alone: without `--config`, a run's saved config.json gives the defaults and the
`--config.*` flags given change them (`moe_jax.run_config`).
"""

from __future__ import annotations

import os
import signal
import sys

INTERRUPTED = "error: interrupted (Ctrl-C) before training started; run again to start"


def _interrupted_starting(signum: int, frame: object) -> None:
    """Ctrl-C while the command's modules load, before `main` (a launcher passes one on
    to processes still starting): `main`'s line and status, not an import's traceback."""
    print(INTERRUPTED, file=sys.stderr, flush=True)
    os._exit(130)


if __name__ == "__main__":  # first: the imports below (and `_main`'s) take seconds
    signal.signal(signal.SIGINT, _interrupted_starting)

from pathlib import Path

from absl import app, flags

from moe_jax import cli, quiet, run_config
from moe_jax import config as config_lib

_CONFIG = cli.define_config_flag()
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (default: runs/<config name>).")
_COORDINATOR = flags.DEFINE_string("coordinator", "", "host:port of process 0 (multi-process).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", 0, "Processes in the job.")
_PROCESS_ID = flags.DEFINE_integer("process_id", -1, "This process's index in the job.")


def main(argv: list[str]) -> None:
    try:
        _main(argv)
    except KeyboardInterrupt:  # before training started (the loop saves and stops itself)
        print(INTERRUPTED, file=sys.stderr, flush=True)
        raise SystemExit(130) from None


def _main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise SystemExit(
            f"error: unexpected arguments {argv[1:]}; settings go in --config.<a>.<b>="
        )
    config_path = flags.FLAGS["config"].config_filename
    workdir = Path(_WORKDIR.value or Path("runs") / Path(config_path).stem)
    try:
        config, started = _settings(workdir)
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
    verbose = flags.FLAGS["verbosity"].present  # quiet otherwise (`cli.parse`)

    from moe_jax import distributed, preemption, trainer  # after validation: slow imports

    try:
        joined = distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
    if joined and not verbose:
        quiet.drop_native_lines()

    if started:
        trainer.say(started)
    # From here Ctrl-C is a KeyboardInterrupt (`main`'s line) until the loop's own stop
    # request takes it; before, the quiet exit of `_interrupted_starting` (imports).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        trainer.run(config, workdir)
    except trainer.RunError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    except trainer.Stopped as stopped:
        trainer.say(str(stopped))
        raise SystemExit(preemption.EXIT_REQUEUE) from None


def _settings(workdir: Path) -> tuple[config_lib.Config, str | None]:
    """The run's config and the line that says where it came from. Without `--config`,
    a workdir holding a run's config.json supplies the defaults and the `--config.*`
    flags given change them (`moe_jax.run_config`); otherwise the config file (default:
    configs/default.py) with the flags, as for a new run."""
    config_flag = flags.FLAGS["config"]
    saved = None if config_flag.present else run_config.saved(workdir)
    if saved is None:
        config = config_lib.load(_CONFIG.value)
        alone = flags.FLAGS["workdir"].present and not config_flag.override_values
        if not alone or (workdir / "config.json").exists():
            return config, None
        source = config_flag.config_filename  # `--workdir=RUN` alone: a typo must show
        return config, f"{workdir} holds no run (no config.json): a new one from {source}"
    try:
        config_lib.load(saved)
    except ValueError as error:
        raise ValueError(
            f"{workdir / 'config.json'}: {error}; give --config=FILE to resume from a config file"
        ) from None
    config = config_lib.load(run_config.with_overrides(saved, config_flag.override_values))
    return config, run_config.resume_line(workdir, saved, config)


if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse)
