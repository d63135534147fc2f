"""A stop asked by a signal ends training at the next step boundary, with a checkpoint of that step.

SIGTERM is how SLURM (at the time limit, on preemption) and Kubernetes (pod eviction) ask a job to stop; SIGINT is
Ctrl-C or a time-limited caller (`timeout -s INT`). Without this, SIGTERM kills the process and the rerun redoes
every step since the last periodic checkpoint. The handlers are installed explicitly: a job that a
non-interactive shell starts in the background inherits SIGINT *ignored*, and Python then never raises
KeyboardInterrupt (on the H100 on 2026-12-07 a training run stepped on for 40 s after its SIGINT, until KILL,
most likely for that reason).
A second signal while the first is pending raises KeyboardInterrupt at once (the caller really wants out), unless
it comes within DUPLICATE_S of the first: a launcher that forwards the signal to its workers (torchrun) while the
scheduler signals the whole process tree (SLURM) delivers one request twice, and that must not cost the checkpoint.
"""

from __future__ import annotations

import logging
import signal
import threading
import time


log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
DUPLICATE_S = 3.0  # a second signal this soon after the first is the same request, delivered twice


class StopSignals:
    """Context manager: while inside, SIGTERM/SIGINT only record a stop request (`signum`); on exit the previous
    handlers come back. Outside the main thread signals cannot be handled, so it does nothing there."""

    def __init__(self):
        self.signum = 0
        self._first = 0.0
        self._previous: dict = {}

    def _handle(self, signum, frame) -> None:
        if self.signum:
            if time.monotonic() - self._first >= DUPLICATE_S:
                raise KeyboardInterrupt
            return
        self.signum, self._first = signum, time.monotonic()
        log.warning("%s received: training stops after this step, with a checkpoint", signal.Signals(signum).name)

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)

    def requested(self, dist) -> int:
        """The signal that asked for a stop (0: none), agreed by every rank: a rank that got none stops with the
        others (one small all-reduce; call it at the same steps on every rank)."""
        if dist.world == 1:
            return self.signum
        import torch

        flags = dist.all_sum(torch.tensor([self.signum, int(self.signum > 0)], dtype=torch.long,
                                          device=dist.device))
        return 0 if not int(flags[1]) else (self.signum or int(flags[0]) // int(flags[1]))
