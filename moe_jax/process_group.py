"""Child processes that live and die together, for `launch/local.py`.

Why: the processes of one multi-process run wait for each other, so one that fails
leaves its peers waiting forever, and a launcher that dies leaves them orphaned (a
process 0 waiting for its peer with parent 1). `Group` owns its children:

- Each child gets `PR_SET_PDEATHSIG` = SIGKILL (Linux `prctl`, set between fork and
  exec): the kernel kills it when the launcher dies, even by SIGKILL, which no handler
  sees. The setting survives the exec of the child's Python (it is cleared only on a
  set-user-id exec), and is checked against a launcher that died before it was set.
  SIGKILL, not SIGTERM: a launcher killed outright is an emergency, a multi-process
  checkpoint needs every peer, and a child blocked in a collective would ignore
  anything gentler; the run resumes from its last checkpoint.
- Each child runs in its own process group, so a terminal's Ctrl-C reaches the
  launcher alone, which passes it on exactly once (SIGINT as SIGINT; SIGTERM and
  SIGHUP as SIGTERM, which a training process answers by saving and stopping). A
  second signal, or children still alive `STOP_GRACE_S` later, kills them.
- When a child fails, the others get SIGTERM and `FAIL_GRACE_S` later SIGKILL: a
  run missing a peer cannot go on or save.
- Each child's output passes through the launcher, which keeps its last stderr line
  to name the failure in one line; an `error: ` line of a shown child is held back
  until the child goes on or ends, so that a failure is said once, by the launcher.
  JAX's C++ lines about a signal (`NATIVE_NOISE`) and the KeyboardInterrupt traceback
  of a child that got a Ctrl-C while still importing are left out.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import re
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import BinaryIO

PR_SET_PDEATHSIG = 1
FAIL_GRACE_S = 5.0
STOP_GRACE_S = 60.0
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
ERROR = b"error: "
TRACEBACK = b"Traceback (most recent call last):"
# JAX's C++ runtime logging a signal that the run itself answers with its own line.
NATIVE_NOISE = re.compile(rb"[IW]\d{4} [\d:.]+ +\d+ preemption_\w+\.cc:\d+\] ")


@dataclasses.dataclass
class Stream:
    """One pipe of a child: where its bytes go, and whether `error: ` lines wait."""

    child: Child
    sink: BinaryIO
    is_stderr: bool
    hold: bool
    quiet: bool
    partial: bytes = b""
    held: bytes = b""
    trace: list[bytes] | None = None  # a traceback being read, shown unless Ctrl-C's
    gone: bool = False  # the sink's reader left

    def feed(self, data: bytes) -> None:
        *lines, self.partial = (self.partial + data).split(b"\n")
        for line in lines:
            self._line(line + b"\n")

    def _line(self, line: bytes) -> None:
        if self.quiet and NATIVE_NOISE.match(line):
            return
        if self.is_stderr and line.strip():
            self.child.last_line = line.decode(errors="replace").strip()
        if self.quiet and (self.trace is not None or line.startswith(TRACEBACK)):
            self._traceback(line)
            return
        self.release()
        if self.hold and line.startswith(ERROR):
            self.held = line
        else:
            self._write(line)

    def _traceback(self, line: bytes) -> None:
        """Drops the KeyboardInterrupt traceback of a child that the launcher passed a
        Ctrl-C on to before it could catch it (while it imports); shows any other."""
        self.trace = [*(self.trace or []), line]
        if line[:1].isspace() or line.startswith(TRACEBACK) or not line.strip():
            return  # inside it: shown, or not, once its last line names the exception
        if not (self.child.signalled and line.startswith(b"KeyboardInterrupt")):
            self._write(b"".join(self.trace))
        self.trace = None

    def release(self) -> None:
        """Shows the held-back line (the child went on, or it is not the failure)."""
        if self.held:
            self._write(self.held)
            self.held = b""

    def end(self) -> None:
        if self.partial:
            self._line(self.partial + b"\n")
            self.partial = b""
        if self.trace:
            self._write(b"".join(self.trace))
            self.trace = None

    def _write(self, data: bytes) -> None:
        if self.gone:
            return
        try:
            self.sink.write(data)
            self.sink.flush()
        except BrokenPipeError:  # the reader left (`| head`): the run goes on unshown
            self.gone = True


@dataclasses.dataclass
class Child:
    name: str
    process: subprocess.Popen
    last_line: str = ""
    streams: list[Stream] = dataclasses.field(default_factory=list)
    signalled: bool = False  # by the launcher: its own end is no failure

    @property
    def code(self) -> int | None:
        return self.process.poll()


@dataclasses.dataclass
class Outcome:
    """How the group ended: `failed` names the first child that failed by itself,
    `stopped_by` the signal the launcher got (0 for none)."""

    codes: list[int]
    failed: Child | None
    stopped_by: int


def describe(code: int) -> str:
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit status {code}"


def _die_with_parent() -> Callable[[], None] | None:
    """The child's pre-exec step that ties its life to this process (Linux only)."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before any fork
    parent = os.getpid()

    def tie() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the launcher died before the tie was made
            os.kill(os.getpid(), signal.SIGKILL)

    return tie


class Group:
    """Starts `commands` as children and supervises them until all have ended."""

    def __init__(self, quiet: bool = True) -> None:
        self.quiet = quiet  # shown output without the noise of JAX's runtime
        self.children: list[Child] = []
        self._selector = selectors.DefaultSelector()
        self._signals: list[int] = []
        self._previous: dict[int, object] = {}

    def __enter__(self) -> Group:
        for sig in STOP_SIGNALS:  # before the first child: no signal falls between
            self._previous[sig] = signal.signal(sig, self._note)
        return self

    def __exit__(self, *exc) -> None:
        for child in self.children:  # an error in the launcher itself leaves no child
            if child.code is None:
                child.process.kill()
                child.process.wait()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._selector.close()

    def _note(self, signum, frame) -> None:
        self._signals.append(signum)

    def start(self, name: str, command: list[str], env: dict, sinks: tuple, hold: bool):
        """A child running `command`, its stdout and stderr written to `sinks`."""
        process = subprocess.Popen(
            command,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            process_group=0,
            preexec_fn=_die_with_parent(),
        )
        child = Child(name, process)
        for pipe, sink, is_stderr in (
            (process.stdout, sinks[0], False),
            (process.stderr, sinks[1], True),
        ):
            stream = Stream(child, sink, is_stderr, hold and is_stderr, hold and self.quiet)
            child.streams.append(stream)
            os.set_blocking(pipe.fileno(), False)
            self._selector.register(pipe, selectors.EVENT_READ, stream)
        self.children.append(child)
        return child

    def wait(self) -> Outcome:
        """Passes output and signals on until every child has ended."""
        failed: Child | None = None
        stopped_by = 0
        deadline = float("inf")
        while any(child.code is None for child in self.children) or self._selector.get_map():
            self._pump(0.1)
            while self._signals:
                signum = self._signals.pop(0)
                if stopped_by:  # asked twice: stop now
                    self._signal_all(signal.SIGKILL)
                    continue
                stopped_by = signum
                self._signal_all(signal.SIGINT if signum == signal.SIGINT else signal.SIGTERM)
                deadline = min(deadline, time.monotonic() + STOP_GRACE_S)
            if failed is None and not stopped_by:
                failed = next((c for c in self.children if c.code and not c.signalled), None)
                if failed is not None:
                    self._signal_all(signal.SIGTERM)
                    deadline = time.monotonic() + FAIL_GRACE_S
            if time.monotonic() > deadline:
                self._signal_all(signal.SIGKILL)
                deadline = float("inf")
            if all(child.code is not None for child in self.children):
                self._drain()
        for child in self.children:
            for stream in child.streams:
                stream.end()
                if child is not failed and not (child.signalled and child.code):
                    stream.release()
        return Outcome([child.code for child in self.children], failed, stopped_by)

    def _signal_all(self, signum: int) -> None:
        for child in self.children:
            if child.code is None:
                child.signalled = True
                child.process.send_signal(signum)

    def _pump(self, timeout: float) -> None:
        for key, _ in self._selector.select(timeout):
            try:
                data = os.read(key.fileobj.fileno(), 65536)
            except BlockingIOError:
                continue
            if data:
                key.data.feed(data)
            else:
                self._selector.unregister(key.fileobj)
                key.fileobj.close()

    def _drain(self, timeout: float = 2.0) -> None:
        """The rest of the output of children that have all ended (a pipe that a
        grandchild still holds open is given up after `timeout`)."""
        end = time.monotonic() + timeout
        while self._selector.get_map() and time.monotonic() < end:
            self._pump(0.05)
        for key in list(self._selector.get_map().values()):
            self._selector.unregister(key.fileobj)
            key.fileobj.close()
