"""Run `dflash-pipeline train` in a child process that is SIGKILLed at a checkpoint save, or signalled in a step.

    python tests/train_kill_helpers.py --kill-at-save STEP -- train ARGS...
    python tests/train_kill_helpers.py --signal-in-step STEP:SIGNAL [--inherit-sigint-ignored] -- train ARGS...

--kill-at-save: the checkpoint store's `save` is wrapped: when called for step >= STEP the process kills itself
with SIGKILL before writing (a node lost at checkpoint time: nothing flushed, nothing cleaned up). Steps before
STEP run and log normally, so the run leaves the older checkpoints, a live metrics log with lines past the last
checkpoint, and no output: what a resumed run must handle.

--signal-in-step: the process sends itself SIGNAL (TERM, INT) during its STEP-th optimizer step (1-based), as
SLURM's time limit or a `timeout -s INT` would; with --inherit-sigint-ignored it starts with SIGINT ignored, as a
job started in the background by a non-interactive shell does.
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


def signalled_train_run(step: int, signame: str, train_args, inherit_sigint_ignored: bool = False,
                        env=None) -> subprocess.CompletedProcess:
    """The train CLI with `train_args`, sent SIG`signame` during its optimizer step `step`."""
    cmd = [sys.executable, str(HERE), "--signal-in-step", f"{step}:{signame}",
           *(["--inherit-sigint-ignored"] if inherit_sigint_ignored else []), "--", *map(str, train_args)]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


def _signal_in_step(argv: list[str], spec: str) -> int:
    from dflash_pipeline.cli import main as cli_main
    from dflash_pipeline.drafter import train

    at, name = spec.split(":")
    sig = getattr(signal, f"SIG{name}")
    if "--inherit-sigint-ignored" in argv:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    step_fn, calls = train.train_step, []

    def step_and_signal(*args, **kwargs):
        calls.append(1)
        if len(calls) == int(at):
            os.kill(os.getpid(), sig)
        return step_fn(*args, **kwargs)

    train.train_step = step_and_signal
    return cli_main(argv[argv.index("--") + 1:])


def _main(argv: list[str]) -> int:
    from dflash_pipeline.cli import main as cli_main
    from dflash_pipeline.drafter.checkpoints import CheckpointStore

    if "--signal-in-step" in argv:
        return _signal_in_step(argv, argv[argv.index("--signal-in-step") + 1])
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
