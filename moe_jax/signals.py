"""SIGINT and SIGTERM alike for the commands that do one job and end (prepare, sample,
evaluate, convert): one line and exit status 130, with nothing half-written.

Why: Ctrl-C used to print a KeyboardInterrupt traceback and SIGTERM (a scheduler, a
`timeout`) killed the process where it stood. Here both raise KeyboardInterrupt in
the main thread, so every writer's cleanup (`except BaseException`, `finally`) runs
before `interruptible` prints the line; one that arrives inside an import (the
commands import jax late), a garbage-collector callback or a finalizer is raised again
once that is done (SIGALRM).
"""

from __future__ import annotations

import functools
import gc
import signal
import sys
from collections.abc import Callable
from typing import Any

EXIT_INTERRUPTED = 130
_received: list[int] = []


RETRY_S = 0.05  # how soon an interrupt that arrived where it was deferred is raised again
RESEND_S = 2.0  # how soon an interrupt that has not stopped the command is raised again


def _deferred(frame: Any) -> bool:
    """Whether `frame` runs where an exception would not stop the command cleanly: inside
    an import (numpy's turns it into an ImportError, printed with its trace), or inside a
    garbage-collector callback or a `__del__` (Python prints "Exception ignored in ..."
    with a traceback and carries on; jax registers such a callback)."""
    callbacks = {getattr(callback, "__code__", None) for callback in gc.callbacks}
    while frame is not None:
        code = frame.f_code
        if code.co_filename.startswith("<frozen importlib") or code.co_name == "__del__":
            return True
        if code in callbacks:
            return True
        frame = frame.f_back
    return False


def _raise(signum: int, frame: Any) -> None:
    """SIGINT, SIGTERM and the retry's SIGALRM: KeyboardInterrupt, once out of imports,
    garbage-collector callbacks and finalizers (`_deferred`)."""
    if signum != signal.SIGALRM:
        _received.append(signum)
    if _deferred(frame):
        signal.setitimer(signal.ITIMER_REAL, RETRY_S)
        return
    # Raised again later should a library swallow it (a worker pool's wait, say); the
    # command's wrapper stops the timer when the interrupt reaches it.
    signal.setitimer(signal.ITIMER_REAL, RESEND_S)
    raise KeyboardInterrupt


def interruptible(what: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorates a command's `main`: SIGINT and SIGTERM stop it with one `error:` line
    naming the signal and `what` was cut short, and exit status 130."""

    def wrap(main: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(main)
        def run(*args: Any, **kwargs: Any) -> Any:
            _received.clear()
            handled = (signal.SIGINT, signal.SIGTERM, signal.SIGALRM)
            previous = {s: signal.signal(s, _raise) for s in handled}
            try:
                return main(*args, **kwargs)
            except BaseException as error:
                signal.setitimer(signal.ITIMER_REAL, 0)
                # A library may turn the KeyboardInterrupt into its own error (numpy's
                # import raises ImportError): what was received decides.
                if not _received or isinstance(error, SystemExit):
                    raise
                name = signal.Signals(_received[-1]).name
                print(
                    f"error: interrupted ({name}) during {what}; nothing was written",
                    file=sys.stderr,
                    flush=True,
                )
                raise SystemExit(EXIT_INTERRUPTED) from None
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

        return run

    return wrap
