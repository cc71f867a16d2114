"""Bad input on `launch/local.py` (the rules: `tests/bad_inputs.py`): its own flags, and
train's flags, config and workdir, all refused before any process starts (that none
starts or survives: `tests/test_launch.py`)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from moe_jax import workdir as workdir_lib
from tests.bad_inputs import WORKDIR, Case, Place, check, names
from tests.bad_inputs import case as _c
from tests.commands import TINY

TWO = ["-n", "2", "--devices", "1", "--"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


BUSY_PORT = _free_port()


def _port_in_use(place: Place) -> None:
    listener = place.stack.enter_context(socket.socket())
    listener.bind(("localhost", BUSY_PORT))
    listener.listen()


def _held_by_a_live_run(place: Place) -> None:
    lock = workdir_lib.Lock(place.trained())
    lock.acquire()  # this test process stands for the live run
    place.stack.callback(lock.release)


CASES = [
    # the case: process 0 used to start, then wait for its peer forever
    _c("launch_workdir_is_a_file", "launch", [*TWO, *TINY, "--workdir={root}/blocker"],
       "--workdir={root}/blocker is a file, not a directory", setup=Place.file),
    _c("launch_workdir_under_a_file", "launch", [*TWO, *TINY, "--workdir={root}/blocker/run"],
       "lies under {root}/blocker, which is a file", setup=Place.file),
    _c("launch_workdir_read_only_fs", "launch", [*TWO, *TINY, "--workdir={root}/ro/run"],
       "{root}/ro is on a read-only file system",
       setup=lambda p: p.small_disk("ro", read_only=True)),
    _c("launch_workdir_in_use", "launch", [*TWO, *TINY, WORKDIR],
       "{root}/run is in use by process", setup=_held_by_a_live_run),
    _c("launch_workdir_not_creatable", "launch", [*TWO, *TINY, "--workdir=/proc/moe_jax_run"],
       "--workdir=/proc/moe_jax_run"),
    _c("launch_train_flag_before_dashes", "launch", ["-n", "2", WORKDIR],
       "--workdir={root}/run is not a flag of launch/local.py", "train flags go after --"),
    _c("launch_too_many_processes", "launch", ["-n", "1000", "--"], "-n=1000", "1..64"),
    _c("launch_no_devices", "launch", ["-n", "2", "--devices", "0", "--"], "--devices=0", "1..256"),
    _c("launch_port_not_a_port", "launch", ["-n", "2", "--port", "70000", "--"],
       "--port=70000 is not a port (1..65535"),
    _c("launch_port_busy", "launch", ["-n", "2", "--port", str(BUSY_PORT), "--", *TINY, WORKDIR],
       f"--port={BUSY_PORT} cannot be used on localhost", setup=_port_in_use),
    _c("launch_devices_not_a_number", "launch", ["-n", "2", "--devices", "four", "--"],
       "argument --devices: invalid int value: 'four'"),
    _c("launch_no_process_count", "launch", ["--", *TINY],
       "the following arguments are required: -n"),
    _c("launch_sets_process_id", "launch", [*TWO, "--process_id=1"],
       "--process_id=1: launch/local.py sets --coordinator, --num_processes, --process_id"),
    _c("launch_unknown_train_flag", "launch", [*TWO, "--wokdir={root}/run"],
       "Unknown command line flag 'wokdir'"),
    _c("launch_stray_train_argument", "launch", [*TWO, *TINY, WORKDIR, "steps=2"],
       "unexpected arguments ['steps=2']"),
    _c("launch_config_without_get_config", "launch", [*TWO, "--config={root}/mine.py"],
       "--config={root}/mine.py", "defines no get_config()",
       setup=lambda p: p.file("mine.py", "steps = 2\n")),
]  # fmt: skip
REAL = {"launch_workdir_is_a_file", "launch_train_flag_before_dashes"}


def test_cases_are_launchs_and_real_ones_exist():
    assert len(CASES) >= 6 and {c.command for c in CASES} == {"launch"}
    assert set(names(CASES)) >= REAL


@pytest.mark.parametrize("case", CASES, ids=names(CASES))
def test_bad_launch_is_one_line_and_starts_nothing(tmp_path: Path, bad_input_run: Path, case: Case):
    check(tmp_path, bad_input_run, case, real=case.name in REAL)
