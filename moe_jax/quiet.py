"""Third-party output that means nothing to a user, kept out of a run's output unless
`--verbosity` asks for it.

Why: orbax logs each failed background write as an ERROR with its traceback (and
warns about its own temporary directories), though the trainer reports the failure
itself in one line; gloo, the CPU collectives of a multi-process run, prints a
"[Gloo] Rank i is connected to j peer ranks. Expected number of connected peer ranks is : j"
line for each communicator from C++, straight to file descriptor 1, where no Python setting
reaches (and from several threads at once, so the pieces of two such lines can interleave
on one line, or a line start with the second half of one); and after a failed
checkpoint write or read, orbax's abandoned coroutines and tensorstore's late
callbacks (which find orbax's event loop closed) each print a traceback as an
unraisable exception.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import sys
import threading
import traceback

from absl import logging as absl_logging

QUIET_LIBRARIES = (f"{os.sep}orbax{os.sep}",)
# The fixed pieces of gloo's connection line (`<<`'d one by one, so other threads' pieces
# can come between them); a line made of nothing else but their numbers is gloo's.
GLOO_PIECES = re.compile(
    rb"\[Gloo\] Rank | is connected to | peer ranks\. ?"
    rb"|Expected number of connected peer ranks is : ?"
)


class _NotFrom(logging.Filter):
    """Drops records logged from files whose path contains one of `parts`."""

    def __init__(self, parts: tuple[str, ...]):
        super().__init__()
        self.parts = parts

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(part in record.pathname for part in self.parts)


class _NotAbandoned(logging.Filter):
    """Drops asyncio's reports of futures and tasks whose error nobody awaited: after a
    failed checkpoint read or write, orbax abandons the rest of its batch of reads or
    writes (the trainer reports the first error itself); the trainer has no other
    asyncio work."""

    def filter(self, record: logging.LogRecord) -> bool:
        first = str(record.msg).split("\n", 1)[0]  # "<Future class> exception was never retrieved"
        return not first.endswith("exception was never retrieved")


def _left_by_a_failed_checkpoint(unraisable) -> bool:
    """An error in orbax's abandoned coroutines once a save or restore has failed (the
    trainer reports the failure itself), or a late callback that finds orbax's event
    loop already closed."""
    error = unraisable.exc_value
    if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
        return True
    frames = traceback.extract_tb(unraisable.exc_traceback) if unraisable.exc_traceback else []
    return any(part in frame.filename for frame in frames for part in QUIET_LIBRARIES)


def quiet_libraries() -> None:
    """Warnings and errors only, and none from the libraries whose failures the trainer
    reports itself."""
    absl_logging.set_verbosity(absl_logging.WARNING)
    logging.getLogger("absl").addFilter(_NotFrom(QUIET_LIBRARIES))
    logging.getLogger("asyncio").addFilter(_NotAbandoned())
    default = sys.unraisablehook

    def hook(unraisable) -> None:
        if not _left_by_a_failed_checkpoint(unraisable):
            default(unraisable)

    sys.unraisablehook = hook


def is_gloo_line(line: bytes) -> bool:
    """Whether `line` holds pieces of gloo's connection lines and nothing else but digits."""
    rest, pieces = GLOO_PIECES.subn(b"", line)
    return pieces > 0 and not rest.strip().strip(b"0123456789 ")


def drop_native_lines() -> None:
    """Filters gloo's connection lines out of file descriptor 1.

    fd 1 becomes a pipe that a thread copies to the real stdout line by line; at exit
    fd 1 is put back and the thread drains what is left, so no line is lost or
    reordered."""
    sys.stdout.flush()
    real = os.dup(1)
    read, write = os.pipe()
    os.dup2(write, 1)
    os.close(write)

    sink_fd = os.dup(real)  # the thread's own copy: `restore` closes `real`

    def copy() -> None:
        with os.fdopen(read, "rb") as source, os.fdopen(sink_fd, "wb", 0) as sink:
            for line in source:
                if not is_gloo_line(line):
                    sink.write(line)

    thread = threading.Thread(target=copy, name="stdout-filter", daemon=True)
    thread.start()

    def restore() -> None:
        sys.stdout.flush()
        os.dup2(real, 1)  # closes the pipe's last writer: the thread sees its end
        os.close(real)
        thread.join(timeout=10)

    atexit.register(restore)
