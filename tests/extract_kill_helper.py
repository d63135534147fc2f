"""`python tests/extract_kill_helper.py N STAGE ARGS...`: run a dflash-pipeline stage and SIGKILL the process
right after the hidden-state writer's Nth durable flush (fsync + journal line): a crash with no cleanup at the
worst moment, as a preempted job has it. The kill comes from this wrapper, not from the package."""

from __future__ import annotations

import os
import signal
import sys

from dflash_pipeline import cli
from dflash_pipeline.hidden_states.writer import HiddenStateShardWriter


def kill_after_flushes(n: int) -> None:
    durable = HiddenStateShardWriter._sync
    done = [0]

    def sync_then_maybe_die(self, new, total):
        durable(self, new, total)
        done[0] += 1
        if done[0] >= n:
            os.kill(os.getpid(), signal.SIGKILL)

    HiddenStateShardWriter._sync = sync_then_maybe_die


if __name__ == "__main__":
    kill_after_flushes(int(sys.argv[1]))
    sys.exit(cli.main(sys.argv[2:]))
