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
    coordinator = f"localhost:{_free_port()}"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
    workdir = next((a.split("=", 1)[1] for a in train_args if a.startswith("--workdir=")), "")
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
                log = logs.enter_context(open(Path(workdir) / f"process_{i}.log", "w"))
            processes.append(subprocess.Popen(command, env=env, stdout=log, stderr=log))
        codes = [p.wait() for p in processes]
    return next((code for code in codes if code), 0)


if __name__ == "__main__":
    sys.exit(main())
