"""The frame of a GPU session (`gpu_check.py`): sections in order, a time budget, and a
report that survives the run being stopped.

A GPU machine is lent for minutes, so one run must keep whatever it measured:

* Each section writes into its own part of the report as it goes (`Section.record`),
  and with `--out DIR` the report is rewritten (atomically: a whole JSON object at
  every moment) after every record and every section, with the full log of stdout
  and stderr beside it, C++ output (XLA, Triton) included.
* A section starts only when the time left covers what it needs; its loops ask the
  same before each item (`Section.time_for`). At the deadline an alarm stops the
  section running then; SIGINT and SIGTERM stop it the same way. A stopped run still
  writes the report, naming the sections done, the one stopped and those not run,
  and ends with the JSON object as the last stdout line.
* A program too large for the device is skipped with a note (`timing.DoesNotFit`),
  any other exception of one item is a failure line; the other items still run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

REPORT, LOG = "gpu_check.json", "gpu_check.log"


class Stopped(BaseException):
    """Raised in the main thread by SIGINT, SIGTERM or the budget's alarm: not an
    Exception, so no check's own `except Exception` swallows it."""


def raised(error: BaseException) -> str:
    """One line for an exception a check caught (so the other checks still run)."""
    lines = str(error).strip().splitlines() or [""]
    return f"raised {type(error).__name__}: {lines[0][:200]}"


def _plain(value):
    """JSON for NumPy and jax scalars (as Python numbers) and anything else (as text)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)


class Report:
    """The run's report; with a directory, rewritten whole after every change."""

    def __init__(self, out: Path | None):
        self.data: dict = {}
        self.path = out / REPORT if out else None

    def text(self) -> str:
        return json.dumps(self.data, default=_plain)

    def save(self) -> None:
        if self.path is None:
            return
        tmp = self.path.with_suffix(".tmp")
        try:
            tmp.write_text(self.text() + "\n")
            os.replace(tmp, self.path)  # readers never see half a report
        except OSError as error:  # a full disk: the run goes on, stdout keeps the report
            print(f"report not written: {error}", file=sys.stderr, flush=True)


@dataclasses.dataclass
class Section:
    """What a section function gets: its part of the report, the deadline, and whether
    this is a `--small` dry run."""

    name: str
    small: bool
    deadline: float  # time.monotonic() at which the budget ends
    results: dict
    failures: list[str]  # the report's, each line prefixed with the section's name
    notes: list[str]
    save: Callable[[], None] = lambda: None

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def record(self, key: str, value, group: str | None = None) -> None:
        """Store `value` under `key` (in the sub-dict `group`), print it, save the report."""
        check_stopped()
        where = self.results.setdefault(group, {}) if group else self.results
        where[key] = value
        shown = f"{value:.2e}" if isinstance(value, float) and abs(value) < 1e-2 else value
        print(f"{self.name} {group + ' ' if group else ''}{key}: {shown}", flush=True)
        self.save()

    def fail(self, line: str) -> None:
        check_stopped()  # an exception caused by the stop is no failure
        self.failures.append(f"{self.name}: {line}")
        print(f"FAILED {self.name}: {line}", flush=True)
        self.save()

    def note(self, line: str) -> None:
        check_stopped()
        self.notes.append(f"{self.name}: {line}")
        print(f"note {self.name}: {line}", flush=True)
        self.save()

    def time_for(self, seconds: float, what: str) -> bool:
        """Whether `what` (about `seconds` long) fits in the time left; a note if not."""
        check_stopped()
        if self.left() >= seconds:
            return True
        self.note(f"{what} skipped: needs about {seconds:.0f} s, {max(self.left(), 0):.0f} s left")
        return False


def timed(ctx: Section, what: str, fn, args, repeats: int) -> float | None:
    """`timing.median_seconds` inside a section: None, with a note, for a program the
    device cannot hold, or with a failure line when it raises (the other items run on)."""
    from timing import DoesNotFit, median_seconds  # jax: not before `versions`

    try:
        return median_seconds(fn, args, repeats)
    except DoesNotFit as why:
        ctx.note(f"{what} not timed: {why}")
    except Exception as error:
        ctx.fail(f"{what} {raised(error)}")
    return None


def unbounded(name: str = "check", small: bool = False) -> Section:
    """A section without a budget, for running one part as a script of its own."""
    return Section(name, small, float("inf"), {}, [], [])


@dataclasses.dataclass(frozen=True)
class Step:
    """One section of the session: its function and the seconds it needs to start
    (`small`: on CPU with --small; `full`: on a GPU)."""

    name: str
    run: Callable[[Section], None]
    small: float
    full: float


class _Tee:
    """Copies file descriptors 1 and 2 (Python's and C++'s output) into a log file too,
    each chunk as soon as it is written, so a killed run keeps its log."""

    def __init__(self, path: Path):
        self.log = open(path, "ab", buffering=0)  # noqa: SIM115 (closed in close())
        self.lock = threading.Lock()
        self.saved, self.threads = {}, []
        for fd in (1, 2):
            read, write = os.pipe()
            self.saved[fd] = os.dup(fd)
            os.dup2(write, fd)
            os.close(write)
            thread = threading.Thread(target=self._pump, args=(read, self.saved[fd]), daemon=True)
            thread.start()
            self.threads.append(thread)

    def _pump(self, read: int, terminal: int) -> None:
        while chunk := os.read(read, 1 << 16):
            with contextlib.suppress(OSError):
                os.write(terminal, chunk)
            with self.lock, contextlib.suppress(OSError):  # a full disk stops only the log
                self.log.write(chunk)
        os.close(read)

    def close(self) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, terminal in self.saved.items():
            os.dup2(terminal, fd)  # the pipe's last writer goes: its reader ends
        for thread in self.threads:
            thread.join(timeout=5)
        self.log.close()


@dataclasses.dataclass
class _StopState:
    reason: str | None = None  # the first signal's ("SIGINT", "SIGTERM", "budget")
    writing: bool = False  # the final report is being written: signals wait


_STOP = _StopState()


def _stop(signum, frame) -> None:
    if _STOP.writing:
        return
    _STOP.reason = _STOP.reason or (
        "budget" if signum == signal.SIGALRM else signal.Signals(signum).name
    )
    raise Stopped(_STOP.reason)


def check_stopped() -> None:
    """Raises Stopped again if a stop arrived and its exception was lost: raised where
    Python ignores exceptions (a __del__, a gc callback) or wrapped by a library into
    an Exception that a check caught. Called at every record and between sections."""
    if _STOP.reason and not _STOP.writing:
        raise Stopped(_STOP.reason)


def run(steps: list[Step], small: bool, budget: float, out: Path | None, start: float) -> int:
    """Runs `steps` in order within `budget` seconds of `start` (time.monotonic());
    prints and returns the exit status: 0 when every check that ran passed, 1 when
    one failed, 128 + the signal's number when a signal stopped the run."""
    report = Report(out)
    tee = None
    if out is not None:
        tee = _Tee(out / LOG)
    deadline = start + budget
    data = report.data
    data[steps[0].name] = {}  # the versions: the report's first field
    data.update(budget_s=budget, small=small, sections={s.name: "not run" for s in steps})
    data.update(seconds={}, failures=[], notes=[], ok=True, complete=False)
    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGALRM, _stop)
    signal.setitimer(signal.ITIMER_REAL, max(deadline - time.monotonic(), 0.01))
    stopped = None
    try:
        for step in steps:
            check_stopped()
            need = step.small if small else step.full
            left = deadline - time.monotonic()
            if left < need:
                data["sections"][step.name] = f"skipped: needs {need:.0f} s, {left:.0f} s left"
                print(f"section {step.name} skipped ({left:.0f} s left)", flush=True)
                report.save()
                continue
            _run_step(step, small, deadline, report)
            if data["sections"][step.name] == "failed" and step.name == "versions":
                stopped = "the imports failed"  # nothing else runs without them
                break
    except Stopped as why:
        stopped = str(why)
    _STOP.writing = True  # from here on the report is written whole, whatever arrives
    signal.setitimer(signal.ITIMER_REAL, 0)
    stopped = stopped if stopped == "the imports failed" else _STOP.reason or stopped
    sections = data["sections"]
    for name, state in sections.items():
        if state == "running":
            sections[name] = f"stopped: {stopped}"
        elif state == "not run" and stopped:
            sections[name] = f"not run: {stopped}"
    data["stopped"] = stopped
    data["complete"] = all(state == "done" for state in sections.values())
    data["ok"] = not data["failures"]
    data["elapsed_s"] = round(time.monotonic() - start, 1)
    for line in data["failures"]:
        print(f"FAILED {line}", flush=True)  # all together, above the JSON
    report.save()
    print(report.text(), flush=True)
    if tee is not None:
        tee.close()
    if stopped in ("SIGINT", "SIGTERM"):
        return 128 + signal.Signals[stopped].value
    return 0 if data["ok"] else 1


def _run_step(step: Step, small: bool, deadline: float, report: Report) -> None:
    """One section; its results, failures and notes land in the report as they come."""
    data, name = report.data, step.name
    section = Section(name, small, deadline, {}, data["failures"], data["notes"], report.save)
    data[name] = section.results
    data["sections"][name] = "running"
    begin = time.monotonic()
    try:
        step.run(section)
        data["sections"][name] = "done"
    except Exception as error:  # the other sections still run
        check_stopped()  # unless the stop caused it
        traceback.print_exc()
        section.fail(raised(error))
        data["sections"][name] = "failed"
    finally:
        data["seconds"][name] = round(time.monotonic() - begin, 1)
        report.save()
        print(f"section {name}: {data['seconds'][name]} s", flush=True)
