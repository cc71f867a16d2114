"""`python launch/local.py -n N [--devices D] [--port P] -- <python -m moe_jax.train flags>`

N training processes on this machine's CPU, each with D forced CPU devices, joined
by `jax.distributed` (gloo collectives) through a coordinator on localhost port P
(default: a free one): the multi-host path, for development without a cluster.

Everything is checked before the first process starts, through train's own front
door: the launcher's flags, the config file, the `--config.*` overrides and the
workdir, each as one `error:` line. Output of process 0 is shown; the others write
`<workdir>/process_<i>.log` if a `--workdir` is given, else their output is shown
too. No process outlives the launcher (`moe_jax.process_group`): when one fails, the
others are stopped and one line names it and its last error line; SIGINT, SIGTERM
and SIGHUP are passed on to every process, which then saves one checkpoint at the
same step and stops, and the launcher exits 75 (130 when Ctrl-C came before
training started, as `train`); a launcher killed outright takes its processes along.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
from pathlib import Path

from moe_jax import process_group
from moe_jax import workdir as workdir_lib

MAX_PROCESSES = 64
MAX_DEVICES = 256
SET_HERE = ("--coordinator", "--num_processes", "--process_id")  # one per process
USAGE = "launch/local.py -n N [--devices D] [--port P] -- <train flags>"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, as every command
        raise SystemExit(f"error: {message}; usage: {USAGE}")


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The launcher's own flags (before `--`) and train's (after it), checked."""
    split = argv.index("--") if "--" in argv else len(argv)
    mine, train_args = argv[:split], argv[split + 1 :]
    parser = _Parser(prog="launch/local.py", description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, required=True, help="processes")
    parser.add_argument("--devices", type=int, default=4, help="CPU devices per process")
    parser.add_argument("--port", type=int, default=0, help="coordinator port (0: a free one)")
    parser.allow_abbrev = False
    args, unknown = parser.parse_known_args(mine)
    if unknown:
        raise SystemExit(
            f"error: {unknown[0]} is not a flag of launch/local.py (-n, --devices, --port); "
            f"train flags go after --: {USAGE}"
        )
    if not 1 <= args.n <= MAX_PROCESSES:
        raise SystemExit(f"error: -n={args.n}: the number of processes must be 1..{MAX_PROCESSES}")
    if not 1 <= args.devices <= MAX_DEVICES:
        raise SystemExit(
            f"error: --devices={args.devices}: CPU devices per process must be 1..{MAX_DEVICES}"
        )
    for arg in train_args:
        if arg.split("=", 1)[0] in SET_HERE:
            raise SystemExit(f"error: {arg}: launch/local.py sets {', '.join(SET_HERE)}; use -n")
    return args, train_args


def coordinator_port(port: int) -> int:
    """`port` (or a free one for 0), checked to be free on localhost."""
    if not 0 <= port <= 65535:
        raise SystemExit(f"error: --port={port} is not a port (1..65535; 0 picks a free one)")
    with socket.socket() as s:
        try:
            s.bind(("localhost", port))
        except OSError as error:
            raise SystemExit(
                f"error: --port={port} cannot be used on localhost ({error.strerror}); "
                "leave --port out to pick a free one"
            ) from None
        return s.getsockname()[1]


def check_train(train_args: list[str]) -> Path:
    """Train's own flag, config and workdir checks, run here before any process starts
    (no jax is imported); returns the workdir the processes will use."""
    import importlib

    from absl import flags

    argv, sys.argv = sys.argv, ["moe_jax.train", *train_args]
    try:  # train defines its flags (and reads the overrides) as it is imported
        importlib.import_module("moe_jax.train")
    finally:
        sys.argv = argv
    from moe_jax import cli
    from moe_jax import config as config_lib

    rest = cli.parse(["moe_jax.train", *train_args])
    if len(rest) > 1:
        raise SystemExit(
            f"error: unexpected arguments {rest[1:]}; settings go in --config.<a>.<b>="
        )
    try:
        config_lib.load(flags.FLAGS.config)
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
    config_file = Path(flags.FLAGS["config"].config_filename)
    workdir = Path(flags.FLAGS.workdir or Path("runs") / config_file.stem)  # as train's
    try:
        workdir_lib.check(workdir)
        workdir_lib.Lock(workdir).check_free()
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
    return workdir


def xla_flags(devices: int) -> str:
    """The user's XLA_FLAGS with this launch's device count in place of any other."""
    kept = [
        flag
        for flag in os.environ.get("XLA_FLAGS", "").split()
        if not flag.startswith("--xla_force_host_platform_device_count")
    ]
    return " ".join([*kept, f"--xla_force_host_platform_device_count={devices}"])


class Logs:
    """`<workdir>/process_<i>.log`, appended to; put back as they were after bad input."""

    def __init__(self, workdir: Path | None):
        self.workdir, self.files, self.sizes = workdir, [], {}
        self.created: list[Path] = []  # the directories that mkdir will make, deepest first
        missing = workdir.absolute() if workdir is not None else None
        while missing is not None and not missing.exists():
            self.created.append(missing)
            missing = missing.parent

    def open(self, i: int):
        path = self.workdir / f"process_{i}.log"
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.sizes[path] = path.stat().st_size if path.exists() else None
        self.files.append(open(path, "ab"))  # noqa: SIM115 (closed by close())
        return self.files[-1]

    def close(self, undo: bool) -> None:
        for file in self.files:
            file.close()
        if not undo:
            return
        for path, size in self.sizes.items():
            if size is None:
                path.unlink(missing_ok=True)
            else:
                os.truncate(path, size)
        for directory in self.created:
            if directory.is_dir() and not any(directory.iterdir()):
                directory.rmdir()


def main(argv: list[str]) -> int:
    args, train_args = parse(argv)
    workdir = check_train(train_args)
    coordinator = f"localhost:{coordinator_port(args.port)}"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(args.devices))
    env["PYTHONUNBUFFERED"] = "1"  # lines pass through the launcher as they are printed
    logged = any(a == "--workdir" or a.startswith("--workdir=") for a in train_args)
    logs = Logs(workdir if logged else None)
    shown = (sys.stdout.buffer, sys.stderr.buffer)
    try:
        sinks = [(logs.open(i),) * 2 if i and logged else shown for i in range(args.n)]
    except OSError as error:
        logs.close(undo=True)
        raise SystemExit(
            f"error: --workdir={workdir}: cannot write {error.filename}: {error.strerror}"
        ) from None
    verbose = any(a.split("=")[0] in ("--verbosity", "-v") for a in train_args)
    with process_group.Group(quiet=not verbose) as group:
        for i in range(args.n):
            command = [sys.executable, "-m", "moe_jax.train", *train_args]
            command += [f"--coordinator={coordinator}", f"--num_processes={args.n}"]
            command += [f"--process_id={i}"]
            group.start(f"process {i} of {args.n}", command, env, sinks[i], hold=sinks[i] is shown)
        outcome = group.wait()
    return report(outcome, logs)


def report(outcome: process_group.Outcome, logs: Logs) -> int:
    """One line on how the processes ended; the launcher's exit status."""
    codes = ", ".join(process_group.describe(code) for code in outcome.codes)
    if outcome.stopped_by:
        name = signal.Signals(outcome.stopped_by).name
        logs.close(undo=False)
        if all(code == 75 for code in outcome.codes):
            print(f"stopped by {name}: all {len(outcome.codes)} processes saved and stopped")
            return 75
        print(
            f"error: stopped by {name} before every process saved ({codes}); "
            "run the same command again to resume from the last checkpoint",
            file=sys.stderr,
        )
        return 130 if outcome.stopped_by == signal.SIGINT else 75
    failed = outcome.failed
    if failed is None:
        logs.close(undo=False)
        return 0
    code = failed.code
    logs.close(undo=code == 1)  # bad input (said by the process): leave nothing behind
    last = failed.last_line.removeprefix("error: ") or "no error output"
    how = process_group.describe(code)
    print(f"error: {failed.name} failed ({how}), the others were stopped: {last}", file=sys.stderr)
    return code if code > 0 else 128 - code


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except KeyboardInterrupt:  # before any process started
        print("error: interrupted (Ctrl-C) before any process started", file=sys.stderr)
        sys.exit(130)
