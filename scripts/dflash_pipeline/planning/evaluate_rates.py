"""The evaluation job: its decode steps timed on the run's GPU (by calibrate-rates) and its time projected from
them (by the plan).

The evaluator (drafter/evaluate.py) decodes every prompt set (the held-out split, the prompts file) in batches
of `evaluate.batch_size`: plain greedy once, then each drafter (trained and untrained) at each temperature, then
`speedup_prompts` prompts at batch 1, plain and speculative. Its time is the target's load, one decoder's set-up
(allocation, graph capture) per batch and run, and decode steps: `max_new_tokens` a plain run, at most as many a
speculative one (tau 1: the untrained drafter, and the ASSUMED bound for the trained one, whose tau the plan
cannot know; a drafter at tau 3 takes a third of them). A step costs about the same whatever the weights, so an
untrained drafter of the run's shape times the speculative step. Measured at LADDER batch sizes; between and
beyond them the step time is taken as linear in the batch.
"""

from __future__ import annotations

import math
import os
import time

from dflash_pipeline import settings

LADDER = (1, 64)    # batch sizes timed
WARMUP_STEPS = 8    # an untimed run first, per batch and kind
STEPS = 32          # then TIMED runs of this many steps, each timed after its prefill
TIMED = 2           # the fastest counts: a run stalled by a busy machine does not
PROMPTS = 64        # samples of the measured token shard taken as prompts


def measure(model_dir: str, drafter_config: dict, token_shard: str) -> dict:
    """{"plain_step_s": {batch: s}, "speculative_step_s": {...}, "setup_s": s, "device"}: seconds per decode step
    (graph-captured on a GPU) and the longest decoder set-up, on the first PROMPTS samples of `token_shard` cut as
    the evaluator cuts its held-out prompts (repeated to fill a batch)."""
    import torch

    from dflash_pipeline.drafter.batched_decoding import BatchDecoder
    from dflash_pipeline.drafter.config import DrafterConfig
    from dflash_pipeline.drafter.evaluate import held_out_prompts
    from dflash_pipeline.drafter.model import DFlashDrafter
    from dflash_pipeline.drafter.target_head import load_target_head
    from dflash_pipeline.target import load_model

    prompts = [p["prompt"] for p in held_out_prompts([token_shard], 1.0, PROMPTS)]  # fraction 1: every sample
    target = load_model(model_dir)
    device = next(target.parameters()).device
    dtype = next(target.parameters()).dtype
    torch.manual_seed(0)
    drafter = DFlashDrafter(DrafterConfig.from_dict(drafter_config)).to(device, dtype).eval()
    head = load_target_head(model_dir, dtype=dtype).to(device)
    graphs = device.type == "cuda"
    out: dict = {"plain_step_s": {}, "speculative_step_s": {}, "setup_s": 0.0, "device": str(device)}
    for batch in LADDER:
        rows = (prompts * batch)[:batch]
        for kind, extra in (("plain", {}), ("speculative", {"drafter": drafter, "head": head})):
            # untimed first: the first prefill and steps at a shape pay one-time kernel selection and allocation
            def decode(n: int, rows=rows, extra=extra):
                return BatchDecoder(target, rows, n, set(), graphs=graphs, **extra).run()

            decode(WARMUP_STEPS)
            out[f"{kind}_step_s"][batch], setup_s = _step_seconds(decode, bool(extra))
            out["setup_s"] = max(out["setup_s"], setup_s)
    return out


def _step_seconds(run, speculative: bool) -> tuple[float, float]:
    """(seconds a decode step, the set-up): a STEPS-step run's time after its prefill over its steps, the fastest of
    TIMED runs. Timed within one run, not as the difference of a short and a long one: on a busy CPU (a CI worker
    beside it) the prefill of a batch of 64 varied by more than 32 steps take, so a difference could come out
    negative even as the fastest of three tries."""
    best = (float("inf"), 0.0)
    for _ in range(TIMED):
        r = run(STEPS)
        steps = max(len(row.accepted) for row in r.rows) if speculative else STEPS  # greedy: the same each time
        best = min(best, ((r.decode_seconds - r.prefill_seconds) / max(1, steps), r.setup_seconds))
    return best


def step_time(table: dict, batch: int) -> float:
    """Seconds per step at `batch`, linear through the smallest and the largest measured batch size, never below
    the smallest's (JSON keys are text)."""
    points = sorted((int(b), float(s)) for b, s in table.items())
    (b0, s0), (b1, s1) = (points[0], points[-1]) if len(points) > 1 else (points[0], points[0])
    if b1 == b0:
        return s0
    return max(s0, s0 + (s1 - s0) * (batch - b0) / (b1 - b0))


def prompt_sets(evaluate: dict, samples: float) -> list[int]:
    """Prompts per set: the held-out split (~holdout_fraction of the samples, at most num_prompts) and every
    question of the prompts file (its non-empty lines)."""
    from dflash_pipeline import package_paths

    cap = int(settings.value(evaluate, "evaluate.num_prompts"))
    sets = [min(cap, math.ceil(float(settings.value(evaluate, "evaluate.holdout_fraction")) * samples))]
    path = package_paths.resolve(evaluate["prompts_file"], must_exist=False) if evaluate.get("prompts_file") else ""
    if path and os.path.exists(path):
        with open(path, encoding="utf-8") as fh:
            sets.append(sum(1 for line in fh if line.strip()))
    return [n for n in sets if n > 0]


def project(evaluate: dict, samples: float, rates: dict) -> dict:
    """The evaluation job's seconds from the measured steps (rates["evaluate"]) and the target's load (the
    extraction job's, measured the same way): {"seconds", "steps", "basis"}."""
    ev, ex = rates["evaluate"], rates.get("extract") or {}
    batch = int(settings.value(evaluate, "evaluate.batch_size"))
    max_new = int(settings.value(evaluate, "evaluate.max_new_tokens"))
    runs = 2 * len(evaluate.get("temperatures") or [0])  # trained and untrained, at each temperature
    seconds = float(ex.get("load_s") or 0.0) + float(ex.get("process_start_s") or 0.0)
    for n in prompt_sets(evaluate, samples):
        for size in [batch] * (n // batch) + ([n % batch] if n % batch else []):
            plain, spec = step_time(ev["plain_step_s"], size), step_time(ev["speculative_step_s"], size)
            seconds += (1 + runs) * ev["setup_s"] + max_new * (plain + runs * spec)
    timed = int(settings.value(evaluate, "evaluate.speedup_prompts"))
    seconds += timed * (2 * ev["setup_s"] + max_new * (step_time(ev["plain_step_s"], 1)
                                                       + step_time(ev["speculative_step_s"], 1)))
    return {"seconds": seconds, "basis": f"decode steps measured on {rates.get('device', '?')}; ASSUMED tau 1 for "
                                         "the trained drafter (an upper bound: a better drafter takes fewer steps)"}


def timed_measure(model_dir: str, drafter_config: dict, token_shard: str) -> dict:
    """measure(), or what stopped it (the plan then leaves evaluation unprojected; the other rates stand)."""
    t0 = time.perf_counter()
    try:
        result = measure(model_dir, drafter_config, token_shard)
    except Exception as exc:  # noqa: BLE001 - a rate not measured is named, the calibration goes on
        return {"error": f"{type(exc).__name__}: {exc}"[:500]}
    return {**result, "seconds": round(time.perf_counter() - t0, 2)}
