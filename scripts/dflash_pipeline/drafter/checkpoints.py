"""Resumable training state: `step-XXXXXXXX.pt` files in the checkpoint directory, mirrored to S3 when a
mirror is configured (checkpoint_mirror.py is the back end).

A checkpoint holds model, optimizer, scheduler, step, RNG states and the run's fingerprint (settings and data
size). `restore` resumes from the newest checkpoint that loads: a damaged one (a node died during the copy,
a truncated download) is renamed `*.damaged`, named in the log, and the next older one is tried, so a
retry never fails on the same file again. A checkpoint of other settings is moved aside, never resumed from.
Checkpoints are read with `torch.load(weights_only=True)`: tensors and plain containers only, no pickle code.
"""

from __future__ import annotations

import json
import logging
import random
import time
from pathlib import Path

import torch

from dflash_pipeline import storage

log = logging.getLogger(__name__)
STATE_KEYS = ("model", "optimizer", "scheduler", "step", "rng", "fingerprint")


class DamagedCheckpoint(Exception):
    pass


def rng_state(device: torch.device) -> dict:
    state = {"torch": torch.get_rng_state(), "python": list(random.getstate()[1])}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate((3, tuple(state["python"]), None))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def load_checkpoint(path: Path) -> dict:
    """A checkpoint's state; DamagedCheckpoint (with the reason) when it is unreadable or incomplete."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as exc:  # noqa: BLE001 - a damaged zip/pickle stream fails in many ways; all mean damaged
        raise DamagedCheckpoint(f"{path}: unreadable checkpoint ({type(exc).__name__}: {exc})") from None
    missing = [k for k in STATE_KEYS if not isinstance(state, dict) or k not in state]
    if missing:
        raise DamagedCheckpoint(f"{path}: incomplete checkpoint (no {', '.join(missing)})")
    return state


class CheckpointStore:
    """restore / save / finish for one training run (all ranks call each; rank 0 writes)."""

    def __init__(self, ckpt_dir: str | Path, fingerprint: dict, keep: int, dist_, mirror_uri: str = ""):
        self.dir = Path(ckpt_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.fingerprint = json.loads(json.dumps(fingerprint))  # as it reads back from a checkpoint
        self.keep = max(1, keep)
        self.dist = dist_
        self.mirror = None
        if mirror_uri:
            from dflash_pipeline.drafter.checkpoint_mirror import CheckpointMirror

            self.mirror = CheckpointMirror(mirror_uri, self.keep)
        self.metrics_path = self.dir / "metrics.jsonl"

    def local(self) -> list[Path]:
        return sorted(self.dir.glob("step-*.pt"))

    # -- restore ------------------------------------------------------------------------------------------

    def restore(self, drafter, opt, sched, device: torch.device) -> int:
        """Load the newest valid checkpoint of this run into the objects; the step to start at (0: none)."""
        if self.mirror is not None and self.dist.main and not self.local():
            self._fetch_from_mirror()  # a new machine: bring the newest valid checkpoint back
        self.dist.barrier()
        path, state = self._newest_valid()
        if state is not None and json.loads(state["fingerprint"]) != self.fingerprint:
            self._set_aside(path)
            path, state = None, None
        start = 0
        if state is not None:
            drafter.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
            sched.load_state_dict(state["scheduler"])
            set_rng_state(state["rng"], device)
            start = int(state["step"])
            if self.dist.main:
                log.info("resumed from %s at step %d", path, start)
        if self.dist.main:
            self._truncate_metrics(start)
        return start

    def _newest_valid(self) -> tuple[Path | None, dict | None]:
        for path in reversed(self.local()):
            try:
                return path, load_checkpoint(path)
            except (DamagedCheckpoint, FileNotFoundError) as exc:
                self._mark_damaged(path, exc)
        return None, None

    def _mark_damaged(self, path: Path, reason) -> None:
        log.warning("%s; resuming from an older checkpoint instead", reason)
        if self.dist.main and path.exists():
            path.rename(path.with_name(path.name + ".damaged"))  # kept for inspection, never tried again

    def _fetch_from_mirror(self) -> None:
        for key in reversed(self.mirror.keys()):
            path = self.mirror.fetch(key, self.dir)
            try:
                load_checkpoint(path)
                return
            except DamagedCheckpoint as exc:
                self._mark_damaged(path, exc)

    def _set_aside(self, path: Path) -> None:
        """Checkpoints of other settings or data (a config change reruns the rule): keep them, never mix runs."""
        self.dist.barrier()
        if self.dist.main:
            aside = self.dir / f"stale-{time.strftime('%Y%m%d-%H%M%S')}"
            aside.mkdir()
            for f in self.local() + [self.metrics_path]:
                if f.exists():
                    f.rename(aside / f.name)
            log.warning("%s was written by a run with other settings; moved to %s, starting at step 0", path, aside)
        self.dist.barrier()

    def _truncate_metrics(self, start_step: int) -> None:
        """The live metrics log continues from the checkpoint: drop the lines of steps that were lost."""
        lines = self.metrics_path.read_text().splitlines() if self.metrics_path.exists() and start_step else []
        kept = [ln for ln in lines if ln.strip() and json.loads(ln)["step"] <= start_step]
        self.metrics_path.write_text("".join(ln + "\n" for ln in kept))

    # -- save / finish ------------------------------------------------------------------------------------

    def save(self, step: int, drafter, opt, sched, device: torch.device) -> None:
        if self.dist.main:
            path = self.dir / f"step-{step:08d}.pt"
            state = {"model": drafter.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                     "step": step, "rng": rng_state(device), "fingerprint": json.dumps(self.fingerprint)}
            with storage.atomic_path(path) as tmp:
                torch.save(state, tmp)
            for old in self.local()[:-self.keep]:
                old.unlink(missing_ok=True)
            log.info("checkpoint %s", path)
            if self.mirror is not None:
                self.mirror.upload(path)
        self.dist.barrier()

    def finish(self) -> None:
        """The last checkpoint is on S3 before the job reports success."""
        if self.mirror is not None:
            self.mirror.wait()
