"""The run directory: checked before anything else, and held by one run at a time.

Why: a workdir that cannot be written used to fail after model init with a traceback,
and two runs started on one workdir both trained, interleaving their metrics and
checkpoints. `check` says in one line why a path cannot be a workdir, writing nothing.
`Lock` makes the run own the directory: an advisory `flock` on `workdir/.lock`,
which the kernel releases when the process dies, so a crashed run never leaves it
stuck; the file says who held it, so a second run can name the live one, and a run
that finds a stale holder says it takes over.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import time
from pathlib import Path

LOCK_NAME = ".lock"


def check(workdir: Path, flag: str = "--workdir", need_bytes: int = 0, purpose: str = "") -> None:
    """A one-line ValueError when `workdir` cannot be made and written as a directory
    (named as `flag` in the message), or has not `need_bytes` free (for `purpose`, said
    in the message); writes nothing."""
    path = Path(workdir).absolute()
    if path.exists() and not path.is_dir():
        raise ValueError(f"{flag}={workdir} is a file, not a directory")
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"{flag}={workdir} lies under {existing}, which is a file")
    if os.statvfs(existing).f_flag & os.ST_RDONLY:
        raise ValueError(f"{flag}={workdir}: {existing} is on a read-only file system")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{flag}={workdir}: {existing} is not writable by this user")
    if not need_bytes:
        return
    free = shutil.disk_usage(existing).free
    if free < need_bytes:
        raise ValueError(
            f"{flag}={workdir}: {need_bytes / 1e6:,.1f} MB needed{purpose}, "
            f"{free / 1e6:,.1f} MB free "
            f"on {existing}"
        )


def _holder(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _describe(holder: dict) -> str:
    if not holder:
        return "another run"
    return f"process {holder.get('pid')} on {holder.get('host')} (since {holder.get('since')})"


class Lock:
    """Exclusive use of a workdir by this process while the run lasts."""

    def __init__(self, workdir: Path):
        self.path = Path(workdir) / LOCK_NAME
        self._fd: int | None = None

    def check_free(self) -> None:
        """A one-line ValueError when a live run holds the workdir; writes nothing."""
        if not self.path.exists():
            return
        fd = os.open(self.path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ValueError(self._busy()) from None
        finally:
            os.close(fd)

    def _busy(self) -> str:
        return (
            f"{self.path.parent} is in use by {_describe(_holder(self.path))}; wait for it, "
            "stop it, or use another --workdir"
        )

    def acquire(self) -> str | None:
        """Takes the workdir (creating it); returns a line to print when it took over from
        a run that died holding it, else None."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ValueError(self._busy()) from None
        stale = _holder(self.path)
        me = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        os.ftruncate(fd, 0)
        os.write(fd, (json.dumps(me) + "\n").encode())
        self._fd = fd
        if stale:
            return f"took over {self.path.parent} from {_describe(stale)}, which is gone"
        return None

    def release(self) -> None:
        if self._fd is None:
            return
        os.ftruncate(self._fd, 0)  # a clean exit leaves no holder behind
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None
