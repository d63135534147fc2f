"""Run `dflash-pipeline train` in a child process that is SIGKILLed when it reaches a checkpoint save.

    python tests/train_kill_helpers.py --kill-at-save STEP -- train ARGS...

The checkpoint store's `save` is wrapped: when called for step >= STEP the process kills itself with SIGKILL
before writing (a node lost at checkpoint time: nothing flushed, nothing cleaned up). Steps before STEP run
and log normally, so the run leaves the older checkpoints, a live metrics log with lines past the last
checkpoint, and no output: what a resumed run must handle.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve()


def killed_train_run(kill_at_save: int, train_args, env=None) -> subprocess.CompletedProcess:
    """The train CLI with `train_args`, killed at the checkpoint save of step `kill_at_save`."""
    cmd = [sys.executable, str(HERE), "--kill-at-save", str(kill_at_save), "--", *map(str, train_args)]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


def _main(argv: list[str]) -> int:
    from dflash_pipeline.cli import main as cli_main
    from dflash_pipeline.drafter.checkpoints import CheckpointStore

    sep = argv.index("--")
    kill_at = int(argv[argv.index("--kill-at-save") + 1])
    save = CheckpointStore.save

    def save_or_die(self, step, *args, **kwargs):
        if step >= kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return save(self, step, *args, **kwargs)

    CheckpointStore.save = save_or_die
    return cli_main(argv[sep + 1:])


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
