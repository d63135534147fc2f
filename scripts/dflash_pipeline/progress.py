"""Progress of a long stage (tokenize, extract, train): one log line every `interval_s` seconds while it
works, with what is done of the total, the elapsed time, the rate and the time left, not a line per shard
at its end. The interval comes from `DFLASH_PROGRESS_INTERVAL_S` (default 30 s; 0: every update)."""

from __future__ import annotations

import logging
import os
import time

DEFAULT_INTERVAL_S = 30.0


def duration(seconds: float | None) -> str:
    """`45 s`, `3 min 05 s`, `2 h 07 min`; `?` when unknown."""
    if seconds is None:
        return "?"
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{int(seconds // 60)} min {seconds % 60:02.0f} s"
    return f"{int(seconds // 3600)} h {(seconds % 3600) / 60:02.0f} min"


def interval_from_env() -> float:
    value = os.environ.get("DFLASH_PROGRESS_INTERVAL_S", "")
    try:
        return max(0.0, float(value)) if value else DEFAULT_INTERVAL_S
    except ValueError:
        return DEFAULT_INTERVAL_S


class Progress:
    """`update(n)` as work is done; a line is logged when `interval_s` passed since the last one, and by
    `finish()`. The rate and ETA count only this run's work (`start`: what was already done, e.g. resumed)."""

    def __init__(self, label: str, total: float, unit: str, log: logging.Logger, start: float = 0,
                 interval_s: float | None = None, clock=time.monotonic):
        self.label, self.total, self.unit, self.log = label, total, unit, log
        self.done = self.start = start
        self.interval_s = interval_from_env() if interval_s is None else interval_s
        self.clock = clock
        self.t0 = self.last = clock()

    def line(self) -> str:
        elapsed = self.clock() - self.t0
        rate = (self.done - self.start) / elapsed if elapsed > 0 else 0.0
        left = (self.total - self.done) / rate if rate > 0 else None
        share = f" ({100 * self.done / self.total:.1f}%)" if self.total else ""
        return (f"{self.label}: {self.done:,.0f}/{self.total:,.0f} {self.unit}{share}, elapsed {duration(elapsed)}, "
                f"{rate:,.3g} {self.unit}/s, ETA {duration(left) if self.done < self.total else '0 s'}")

    def update(self, n: float = 1) -> None:
        self.done += n
        now = self.clock()
        if now - self.last >= self.interval_s:
            self.last = now
            self.log.info("%s", self.line())

    def finish(self) -> None:
        self.log.info("%s", self.line())
