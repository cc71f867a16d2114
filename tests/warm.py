"""The command lines of `tests.commands`, each run in a fresh process forked from one warm
interpreter instead of a new Python: the same module run as `__main__` with the same
argv, in the same directory, environment (one CPU device) and file descriptors, only
without paying for Python's start and the imports (jax, orbax, ...) again.

Why: a bad-input case is answered in well under a second once the libraries are loaded,
and the imports cost seconds per case. The server imports libraries only (never a
command's own module, which defines its flags as it runs) and starts no XLA backend, so
each forked child starts its own. `tests/test_bad_inputs.py` keeps some cases of every
command as real subprocesses to prove the command line itself.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

# Libraries only: a command's own module (moe_jax.train, moe_jax.plan.__main__, ...)
# must first run as __main__ in the child, where it defines its flags.
PRELOAD = (
    "numpy",
    "jax",
    "optax",
    "flax.nnx",
    "orbax.checkpoint",
    "moe_jax.trainer",
    "moe_jax.saved_run",
    "moe_jax.plan.planner",
    "moe_jax.convert.commands",
    "moe_jax.tools.hlo_collectives",
    "moe_jax.tools.lowered_dtypes",
)
COMMAND_MODULES = (
    "moe_jax.train",
    "moe_jax.plan.__main__",
    "moe_jax.tools.comm_report",
    "moe_jax.data.prepare",
    "moe_jax.convert.__main__",
    "moe_jax.sample",
    "moe_jax.evaluate",
)

SERVER = textwrap.dedent(
    """
    import atexit, gc, json, os, runpy, sys, traceback
    preload, commands = json.loads(sys.argv[1])
    for name in preload:
        __import__(name)
    gc.freeze()  # the preloaded modules: never scanned (or copied) by a forked child
    gc.set_threshold(100_000, 50, 100)  # as tests/conftest.py sets it, for tracing
    loaded = [name for name in commands if name in sys.modules]
    assert not loaded, f"preloading imported the commands {loaded}"


    def run(cwd, argv, out, err):
        os.chdir(cwd)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        for fd, path in ((1, out), (2, err)):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        code = 0
        try:
            if argv[0] == "-m":  # python -m MODULE: the working directory first on the path
                sys.argv, sys.path[0] = [argv[1], *argv[2:]], cwd
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            else:  # python SCRIPT: the script's directory first
                sys.argv, sys.path[0] = list(argv), os.path.dirname(os.path.abspath(argv[0]))
                runpy.run_path(argv[0], run_name="__main__")
        except SystemExit as exit:  # as the interpreter reads it
            code = exit.code
            if code is None:
                code = 0
            elif not isinstance(code, int):
                print(code, file=sys.stderr)
                code = 1
        except BaseException:
            traceback.print_exc()
            code = 1
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            run(*request)
        print(pid, flush=True)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status), flush=True)
    """
)


class Server:
    """One warm interpreter (per test process), started on first use."""

    def __init__(self, env: dict[str, str]):
        self.process = subprocess.Popen(
            [sys.executable, "-c", SERVER, json.dumps([PRELOAD, COMMAND_MODULES])],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        if self._line(300) != "ready":
            raise RuntimeError("the warm command server did not start")
        atexit.register(self.close)

    def _line(self, timeout: float) -> str | None:
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        return self.process.stdout.readline().strip() if ready else None

    def run(self, cwd: Path, argv: list[str], timeout: float) -> subprocess.CompletedProcess:
        """`python *argv` in `cwd`, as `subprocess.run(..., capture_output=True, text=True)`
        returns it (TimeoutExpired after `timeout` seconds, the child killed)."""
        with tempfile.TemporaryDirectory() as outputs:
            out, err = Path(outputs, "stdout"), Path(outputs, "stderr")
            request = [str(cwd), list(argv), str(out), str(err)]
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
            pid = int(self._line(60))
            status = self._line(timeout)
            if status is None:
                os.kill(pid, signal.SIGKILL)
                self._line(60)
                raise subprocess.TimeoutExpired(argv, timeout, out.read_text(), err.read_text())
            stdout = out.read_text() if out.exists() else ""
            stderr = err.read_text() if err.exists() else ""
            return subprocess.CompletedProcess(argv, int(status), stdout, stderr)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            self.process.wait(60)


_servers: dict[tuple, Server] = {}


def run(cwd: Path, argv: list[str], env: dict[str, str], timeout: float):
    """`argv` run by the warm server for `env` (one per distinct environment). pytest's
    PYTEST_CURRENT_TEST, which names each test, is left out: with it every test would
    start a server of its own and pay for the imports the server is there to spare."""
    env = {k: v for k, v in env.items() if k != "PYTEST_CURRENT_TEST"}
    key = tuple(sorted(env.items()))
    if key not in _servers or _servers[key].process.poll() is not None:
        _servers[key] = Server(env)
    return _servers[key].run(cwd, argv, timeout)
