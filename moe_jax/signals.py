"""SIGINT and SIGTERM alike for the commands that do one job and end (prepare, sample,
evaluate, convert): one line and exit status 130, with nothing half-written.

Why: Ctrl-C used to print a KeyboardInterrupt traceback and SIGTERM (a scheduler, a
`timeout`) killed the process where it stood. Here both raise KeyboardInterrupt in
the main thread, so every writer's cleanup (`except BaseException`, `finally`) runs
before `interruptible` prints the line.
"""

from __future__ import annotations

import functools
import signal
import sys
from collections.abc import Callable
from typing import Any

EXIT_INTERRUPTED = 130
_received: list[int] = []


def _raise(signum: int, frame: Any) -> None:
    _received.append(signum)
    raise KeyboardInterrupt


def interruptible(what: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorates a command's `main`: SIGINT and SIGTERM stop it with one `error:` line
    naming the signal and `what` was cut short, and exit status 130."""

    def wrap(main: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(main)
        def run(*args: Any, **kwargs: Any) -> Any:
            previous = {s: signal.signal(s, _raise) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                return main(*args, **kwargs)
            except KeyboardInterrupt:
                name = signal.Signals(_received[-1]).name if _received else "SIGINT"
                print(
                    f"error: interrupted ({name}) during {what}; nothing was written",
                    file=sys.stderr,
                    flush=True,
                )
                raise SystemExit(EXIT_INTERRUPTED) from None
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

        return run

    return wrap
