"""`python launch/local.py -n N [--devices D] -- <python -m moe_jax.train args>`

N training processes on this machine's CPU, each with D forced CPU devices,
joined by `jax.distributed` (gloo collectives) through a coordinator on
localhost: the multi-host path, for development without a cluster. Output of
process 0 is shown; the others write `<workdir>/process_<i>.log` if a
`--workdir` is given, else their output is shown too. Exits with the first
non-zero exit status. SIGTERM and SIGINT are passed on to every process, which
then save one checkpoint at the same step and exit with status 75.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from moe_jax.cli import check_config_args


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, required=True, help="processes")
    parser.add_argument("--devices", type=int, default=4, help="CPU devices per process")
    parser.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then train flags")
    args = parser.parse_args()
    if args.n < 1 or args.devices < 1:
        parser.error(f"-n={args.n} and --devices={args.devices} must be >= 1")
    train_args = [a for a in args.train_args if a != "--"]
    problem = check_config_args(["train", *train_args])
    if problem:  # one line before any process starts or anything is written
        print(f"error: {problem}", file=sys.stderr)
        return 1
    coordinator = f"localhost:{_free_port()}"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=_xla_flags(args.devices))
    workdir = _workdir(train_args)
    existed = bool(workdir) and Path(workdir).exists()
    written: list[Path] = []
    processes: list[subprocess.Popen] = []

    def forward(signum, frame) -> None:
        for process in processes:
            process.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    with contextlib.ExitStack() as logs:
        for i in range(args.n):
            command = [sys.executable, "-m", "moe_jax.train", *train_args]
            command += [f"--coordinator={coordinator}", f"--num_processes={args.n}"]
            command += [f"--process_id={i}"]
            log = None
            if i and workdir:
                Path(workdir).mkdir(parents=True, exist_ok=True)
                written.append(Path(workdir) / f"process_{i}.log")
                log = logs.enter_context(open(written[-1], "w"))
            processes.append(subprocess.Popen(command, env=env, stdout=log, stderr=log))
        codes = [p.wait() for p in processes]
    code = next((code for code in codes if code), 0)
    if code == 1:  # bad input: process 0 said why; leave the workdir as it was
        for path in written:
            path.unlink(missing_ok=True)
        if not existed and workdir and not any(Path(workdir).iterdir()):
            Path(workdir).rmdir()
    return code


def _xla_flags(devices: int) -> str:
    """The user's XLA_FLAGS with this launch's device count in place of any other."""
    kept = [
        flag
        for flag in os.environ.get("XLA_FLAGS", "").split()
        if not flag.startswith("--xla_force_host_platform_device_count")
    ]
    return " ".join([*kept, f"--xla_force_host_platform_device_count={devices}"])


def _workdir(train_args: list[str]) -> str:
    """The training run's --workdir, as `--workdir=DIR` or `--workdir DIR`."""
    for i, arg in enumerate(train_args):
        if arg.startswith("--workdir="):
            return arg.split("=", 1)[1]
        if arg == "--workdir" and i + 1 < len(train_args):
            return train_args[i + 1]
    return ""


if __name__ == "__main__":
    sys.exit(main())
