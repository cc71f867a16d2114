"""Third-party noise is kept out of a run's output, and nothing else is."""

from __future__ import annotations

import subprocess
import sys

PROGRAM = """
import os, sys
from moe_jax import quiet
quiet.drop_native_lines()
print("before", flush=True)
gloo = b"[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1"
os.write(1, gloo + b"\\n")  # as gloo's C++ writes it
# two of gloo's threads at once: one's line inside the other's, its end on a line alone
os.write(1, b"[Gloo] Rank 2 is connected to 7 peer ranks. [Gloo] Rank 3 is connected to 7 peer"
            b" ranks. Expected number of connected peer ranks is : 7\\n")
os.write(1, b"Expected number of connected peer ranks is : 7\\n")
os.write(1, b"7 of our own 7\\n")
os.write(1, b"a line of our own that mentions [Gloo] later\\n")
print("after")
"""


def test_native_gloo_lines_are_dropped_and_the_rest_kept_in_order():
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    ours = "7 of our own 7\na line of our own that mentions [Gloo] later\n"
    assert done.stdout == f"before\n{ours}after\n"


UNRAISABLE = """
from moe_jax import quiet
quiet.quiet_libraries()
class Raises:  # an exception in __del__ reaches sys.unraisablehook, as tensorstore's do
    def __init__(self, error):
        self.error = error
    def __del__(self):
        raise self.error
Raises(RuntimeError("Event loop is closed"))
Raises(ValueError("a real problem"))
"""


def test_only_orbaxs_leftovers_are_hidden():
    done = subprocess.run(
        [sys.executable, "-c", UNRAISABLE], capture_output=True, text=True, timeout=60
    )
    assert "Event loop is closed" not in done.stderr
    assert "ValueError: a real problem" in done.stderr


ABANDONED = """
import logging
from moe_jax import quiet
quiet.quiet_libraries()
log = logging.getLogger("asyncio")
log.error("_GatheringFuture exception was never retrieved\\nfuture: <_GatheringFuture>")
log.error("Task exception was never retrieved\\ntask: <Task>")
log.error("an asyncio error of another kind")
"""


def test_asyncios_reports_of_abandoned_futures_are_hidden():
    done = subprocess.run(
        [sys.executable, "-c", ABANDONED], capture_output=True, text=True, timeout=60
    )
    assert "never retrieved" not in done.stderr
    assert "an asyncio error of another kind" in done.stderr
