"""How long this process has lived: a job's start-up counts python and its imports, which no in-process timer sees."""

from __future__ import annotations

import os


def process_age_s() -> float:
    """Seconds since this process started (python and its imports included); 0 where /proc cannot tell."""
    try:
        with open("/proc/self/stat") as fh:
            start_ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as fh:
            uptime = float(fh.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0
