"""One name for a compiled workload, so that separate processes of it share what torch.compile learned.

torch.compile starts every process with static shapes and recompiles a graph as dynamic once a size changes
(the packed token and block counts change every training step): a cold process pays each graph twice. With a
`torch.compiler.config.job_id`, dynamo keeps that profile in its cache directory (local PGO), so the next
process of the same workload (calibrate-rates' training steps, then the training job; one extraction job, then
the next) compiles the dynamic graph at once and finds it in inductor's cache. A job id set by the user
(TORCH_COMPILE_JOB_ID) wins; one of ours is replaced by the next stage's in the same process (calibrate-rates
extracts, then trains)."""

from __future__ import annotations

import hashlib
import json

_NAMED_HERE: set[str] = set()


def name_compiled_workload(stage: str, shape: dict) -> str | None:
    """Set the compile job id to `stage` + a hash of what decides the graphs' shapes (model config, layout);
    returns the id in force, or None where torch has no such setting."""
    import torch

    cfg = getattr(getattr(torch, "compiler", None), "config", None)
    if cfg is None or not hasattr(cfg, "job_id"):
        return None
    if cfg.job_id is None or cfg.job_id in _NAMED_HERE:
        digest = hashlib.sha256(json.dumps(shape, sort_keys=True, default=str).encode()).hexdigest()[:16]
        cfg.job_id = f"dflash-{stage}-{digest}"
        _NAMED_HERE.add(cfg.job_id)
    return cfg.job_id
