"""Stop requests (SIGTERM from a scheduler, Ctrl-C) turned into one agreed step.

A single process sets a flag and stops after the current step. In a
multi-process job every process must save the same step, but the signal
reaches them at different steps; JAX's preemption service (started by
`jax.distributed.initialize`, which owns SIGTERM there) spreads the notice
and names the first step all processes can still reach.
"""

from __future__ import annotations

import os
import signal

import jax
from jax.experimental import multihost_utils

# Exit status of a run that saved a checkpoint because it was asked to stop:
# EX_TEMPFAIL, "try again later"; launch/slurm/train.sbatch requeues on it.
EXIT_REQUEUE = 75


class StopRequest:
    """Context manager; `reached(step)` says whether to save and stop after `step`."""

    def __init__(self):
        self.signal: int | None = None
        self._multi = jax.process_count() > 1
        self._previous = {}

    def __enter__(self) -> StopRequest:
        # With many processes SIGTERM already belongs to JAX's preemption notifier;
        # Ctrl-C is passed on to it so that it, too, stops every process together.
        handled = (signal.SIGINT,) if self._multi else (signal.SIGTERM, signal.SIGINT)
        for sig in handled:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.signal = signum
        if self._multi:
            os.kill(os.getpid(), signal.SIGTERM)

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def reached(self, step: int) -> bool:
        """Call after every step, on every process, from the first step on."""
        if self._multi:
            if multihost_utils.reached_preemption_sync_point(step):
                self.signal = self.signal or signal.SIGTERM
                return True
            return False
        return self.signal is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signal).name if self.signal else ""
