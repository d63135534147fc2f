"""`dflash-pipeline calibrate`: measure the real generation rate before the full generation is committed.

It takes `generate`'s own flags (the rule passes the same ones), starts the backend exactly as `generate`
does (`stage.serving` + `stage.make_engine`: the same servers, launch flags and requests in flight) and sends
a calibration sample (`dflash-pipeline calibrate-sample`: the corpus's real prompts, stratified over prompt
lengths and shards) through the same client code (`generate_sample`). The warm-up prompts go first and
are not measured. An engine whose rate grows with the rows decoding together (the hf slot engine: its
`calibration_requests`) gets the sample repeated up to that many requests, so every slot is busy as in the run.
Writes one JSON (`--out`) that the plan projects the whole corpus from and that
`generate --calibration` compares its live rate with.

The rate a long run sees is the steady state: every request slot busy, from start-up to its last requests.
A calibration sample ends with a drain (fewer and fewer requests in flight), so its whole-window rate is low.
The figure used is Little's law over the saturated stretch (>= 90% of the workers in flight): mean requests
in flight x (output tokens / seconds of request life) of the requests that lived entirely inside it; in
simulations it is within 0.1% whether a server shares one rate among its requests or gives each its own. When too few requests
ran inside it (a sample not much larger than the slots; the hf backend's whole-batch answers), the
whole-window rate is used and called a lower bound. An in-process engine that counts its own steady state (the hf
slot engine's `saturated()`: answer tokens and seconds of the rounds run while requests waited for a free slot)
gives the figure directly: the clients' view counts a request's wait for a slot and a first round's ramp as
its life, which put Little's law at 0.57x of what the run sustained on an H100 (16.5K vs 28.8K tok/s).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import math
import random
import signal
import time
from dataclasses import dataclass

from dflash_pipeline import storage
from dflash_pipeline.errors import PipelineError
from dflash_pipeline.generation import stage
from dflash_pipeline.generation.client import Counters, generate_sample
from dflash_pipeline.planning.calibration_sample import read_sample
from dflash_pipeline.process_clock import process_age_s

BUSY_FRACTION = 0.9      # "saturated": at least this share of the workers have a request in flight
MIN_STEADY_REQUESTS = 8  # the steady-state figure needs this many requests (and this share of the sample)
MIN_STEADY_SHARE = 0.1
MIN_ENGINE_S = 1.0       # an engine's own saturated count is used when it covers at least this much time


@dataclass
class Timed:
    start: float
    end: float
    record: dict

    @property
    def tokens(self) -> int:
        return int(self.record["completion_tokens"] or 0)


def add_arguments(p: argparse.ArgumentParser) -> None:
    stage.add_arguments(p)  # generate's flags: --input is the calibration sample, --out the result (JSON)
    p.add_argument("--gpus-per-job", type=int, default=0,
                   help="GPUs a generation job holds (config generate.gpus; 0: CPU / not known)")


# --------------------------------------------------------------------------------------------------------
# measuring
# --------------------------------------------------------------------------------------------------------
async def send_all(engine, rows: list[dict], args, counters: Counters) -> tuple[list[Timed], int]:
    """Every row through the same client as `generate`, `engine.capacity` in flight; (timings, workers)."""
    params, policy = stage.request_settings(args)
    sampling_json, settings, _ = stage.shard_settings(args, engine, params, policy)
    model = settings["model"]
    todo = list(reversed(rows))
    done: list[Timed] = []

    async def worker() -> None:
        while todo:
            row = todo.pop()
            t0 = time.monotonic()
            rec = await generate_sample(engine, row, params, policy, counters, model, sampling_json)
            done.append(Timed(t0, time.monotonic(), rec))

    workers = max(1, min(engine.capacity, len(rows)))
    await asyncio.gather(*(worker() for _ in range(workers)))
    return done, workers


def saturated_window(timed: list[Timed], workers: int) -> tuple[float, float]:
    """(start, end) of the stretch from the first request until fewer than 90% of the workers are busy."""
    t0 = min(t.start for t in timed)
    events = sorted([(t.start, 1) for t in timed] + [(t.end, -1) for t in timed])
    need = math.ceil(BUSY_FRACTION * min(workers, len(timed)))
    level, reached = 0, False
    for when, step in events:
        level += step
        reached = reached or level >= need
        if reached and level < need:
            return t0, when
    return t0, max(t.end for t in timed)


def steady_rate(timed: list[Timed], workers: int) -> tuple[float | None, dict]:
    """Output tok/s with the slots kept busy, by Little's law: mean requests in flight x output tokens per
    second of request life, over the requests that lived entirely inside the saturated window."""
    s0, s1 = saturated_window(timed, workers)
    inside = [t for t in timed if t.end <= s1]
    info = {"saturated_s": round(s1 - s0, 3), "steady_requests": len(inside)}
    if s1 <= s0 or len(inside) < max(MIN_STEADY_REQUESTS, MIN_STEADY_SHARE * len(timed)):
        return None, info
    in_flight = sum(max(0.0, min(t.end, s1) - max(t.start, s0)) for t in timed) / (s1 - s0)
    life = sum(t.end - t.start for t in inside)
    info["mean_in_flight"] = round(in_flight, 2)
    return (in_flight * sum(t.tokens for t in inside) / life if life > 0 else None), info


def rate_figures(timed: list[Timed], workers: int, capacity: int | None = None,
                 engine_saturated: tuple[int, float] | None = None) -> dict:
    """The output rate and how it was measured; `capacity`: the request slots a generation job fills (a sample
    smaller than that measures the servers less loaded than the run will keep them: a lower bound);
    `engine_saturated`: (answer tokens, seconds) an in-process engine decoded with requests waiting for a free
    slot, its own count of the steady state (preferred over Little's law when it covers MIN_ENGINE_S)."""
    t0, t1 = min(t.start for t in timed), max(t.end for t in timed)
    whole = max(t1 - t0, 1e-9)
    whole_rate = sum(t.tokens for t in timed) / whole
    steady, info = steady_rate(timed, workers)
    little = steady
    basis = (f"steady state: {info.get('mean_in_flight', 0):.1f} requests in flight on average x output tokens per "
             f"second of request life, over the {info['steady_requests']} requests that ran while >= "
             f"{BUSY_FRACTION:.0%} of the {workers} request slots were busy ({info['saturated_s']:.1f} s of the "
             f"{whole:.1f} s window)") if steady else (
             f"whole window ({whole:.1f} s) including the drain at its end: a lower bound for a long run (only "
             f"{info['steady_requests']} requests ran with the slots busy; a sample of several times the "
             f"{workers} request slots measures the steady state)")
    tokens_sat, seconds_sat = engine_saturated or (0, 0.0)
    if seconds_sat >= MIN_ENGINE_S and tokens_sat > 0:
        # the clients' view counts a request's wait for a slot and the ramp of a first round as its life; the
        # engine counts only the tokens it decoded while its pool was full (H100, SmolLM2, 2,048 requests on
        # 1,024 slots: Little's law gave 16.5K tok/s, the run then sustained 28.8K)
        steady = tokens_sat / seconds_sat
        basis = (f"engine-side steady state: {tokens_sat:,} answer tokens decoded in {seconds_sat:.1f} s of rounds "
                 f"run with requests waiting for a free slot (of the {whole:.1f} s window)")
        info["engine_saturated_s"] = round(seconds_sat, 3)
    full = capacity is None or workers >= capacity
    if not full:
        basis = (f"only {workers} of the job's {capacity} request slots were used (fewer samples than slots): a lower "
                 f"bound; generate.calibrate.samples >= 2 x {capacity} measures a full engine. {basis}")
    return {
        "output_tok_s": round(steady if steady else whole_rate, 2), "basis": basis,
        "steady_state": bool(steady) and full, "slots": capacity or workers,
        "output_tok_s_whole_window": round(whole_rate, 2),
        "output_tok_s_steady": round(steady, 2) if steady else None,
        "output_tok_s_little": round(little, 2) if little else None,
        "samples_per_s": round(len(timed) / whole, 4), "window_s": round(whole, 3), **info,
    }


def percentiles(values: list[float], qs=(10, 25, 50, 75, 90, 99)) -> dict:
    if not values:
        return {}
    s = sorted(values)
    out = {f"p{q}": round(float(s[min(len(s) - 1, int(q / 100 * len(s)))]), 3) for q in qs}
    return out | {"mean": round(sum(s) / len(s), 3), "max": round(float(s[-1]), 3)}


def histogram(values: list[int], top: int) -> dict[str, int]:
    """Counts in power-of-two bins up to the max_new_tokens budget."""
    edges, e = [0], 64
    while e < top:
        edges.append(e)
        e *= 2
    edges.append(max(top, 1))
    hist = {f"{lo}-{hi}": 0 for lo, hi in zip(edges, edges[1:])} | {f">{edges[-1]}": 0}
    for v in values:
        key = next((f"{lo}-{hi}" for lo, hi in zip(edges, edges[1:]) if v <= hi), f">{edges[-1]}")
        hist[key] += 1
    return hist


def thinking_figures(records: list[dict]) -> dict:
    think = answer = with_thinking = 0
    for r in records:
        turns = [m for m in r["messages"] if m["role"] == "assistant"]
        t = sum(len(m.get("reasoning_content") or "") for m in turns)
        think += t
        answer += sum(len(m["content"] or "") for m in turns)
        with_thinking += t > 0
    return {"share_of_output_chars": round(think / max(think + answer, 1), 4),
            "samples_with_thinking": round(with_thinking / max(len(records), 1), 4)}


def measure(timed: list[Timed], workers: int, max_new_tokens: int, capacity: int | None = None,
            engine_saturated: tuple[int, float] | None = None) -> dict:
    recs = [t.record for t in timed]
    ok = [t for t in timed if t.record["status"] == "ok"]
    failed = len(timed) - len(ok)
    reasons: dict[str, int] = {}
    for r in recs:
        if r["status"] != "ok":
            key = (r["failure_reason"] or "").split(":")[0][:80]
            reasons[key] = reasons.get(key, 0) + 1
    tokens = [t.tokens for t in timed]
    return {
        "throughput": rate_figures(timed, workers, capacity, engine_saturated),
        "latency_s": percentiles([t.end - t.start for t in ok]),
        "output_tokens": {**percentiles(tokens), "histogram": histogram(tokens, max_new_tokens),
                          "per_sample_all": sorted(tokens)},
        "prompt_tokens": percentiles([r["prompt_tokens"] for r in recs]),
        "thinking": thinking_figures([t.record for t in ok]),
        "finish_length_rate": round(sum(r["finish_reason"] == "length" for r in recs) / len(recs), 4),
        "failure_rate": round(failed / len(recs), 4),
        "failure_reasons": reasons,
        "requests": {"samples": len(recs), "ok": len(ok), "failed": failed,
                     "attempts": sum(int(r["attempts"] or 0) for r in recs), "workers": workers},
    }


# --------------------------------------------------------------------------------------------------------
# the command
# --------------------------------------------------------------------------------------------------------
def _iso(wall: float) -> str:
    return dt.datetime.fromtimestamp(wall, dt.timezone.utc).isoformat(timespec="seconds")


async def _calibrate(args, urls, warm: list[dict], rows: list[dict], t_launch: float, process_s: float) -> dict:
    engine = stage.make_engine(args, urls)
    # as `generate`: launched servers are healthy already; running ones get the full budget
    await engine.start(wait_s=60.0 if urls else args.all_down_timeout)
    try:
        engine_s = time.monotonic() - t_launch  # servers healthy / model loaded: what every job pays first
        t_warm = time.monotonic()
        if warm:
            await send_all(engine, warm, args, Counters())
        warm_s = time.monotonic() - t_warm
        rows = fill_slots(rows, getattr(engine, "calibration_requests", 0))
        wall0, mono0 = time.time(), time.monotonic()
        before = engine.saturated() if hasattr(engine, "saturated") else None
        timed, workers = await send_all(engine, rows, args, Counters())
        after = engine.saturated() if before is not None else None
        saturated = (after[0] - before[0], after[1] - before[1]) if before is not None else None
        result = measure(timed, workers, args.max_new_tokens, engine.capacity, saturated)
        t1 = max(t.end for t in timed)
        result["window"] = {"start": _iso(wall0 + min(t.start for t in timed) - mono0),
                            "end": _iso(wall0 + t1 - mono0), "seconds": result["throughput"]["window_s"],
                            "warmup_requests": len(warm), "warmup_s": round(warm_s, 3),
                            "note": "warm-up requests were sent first and are not measured"}
        # a job pays all three before its steady rate: python and imports, the engine, the first requests' graph
        # capture and allocation (the H100 run of stop 36 measured the engine alone: 15 s projected, ~18 s real)
        result["startup_parts"] = {"process_s": round(process_s, 3), "engine_s": round(engine_s, 3),
                                   "warmup_s": round(warm_s, 3)}
        result["startup_s"] = round(process_s + engine_s + warm_s, 3)
        result["engine"] = {"describe": engine.describe(), "capacity": engine.capacity,
                            "model": args.model_name or engine.model_name}
        return result
    finally:
        await engine.close()


def fill_slots(rows: list[dict], requests: int) -> list[dict]:
    """The sample repeated (each repeat a new sample id, so a new seed) up to `requests`: an engine whose rate
    grows with the rows decoding together (the hf slot engine) is measured as full as a run keeps it."""
    out = list(rows)
    k = 1
    while len(out) < requests:
        out += [dict(r, sample_id=f"{r['sample_id']}#{k}") for r in rows[:requests - len(out)]]
        k += 1
    return out


def _terminate(signum, frame):
    raise SystemExit(128 + signum)  # unwinds through `finally`: launched servers are stopped


def settings_of(args) -> dict:
    params, policy = stage.request_settings(args)
    return {"backend": args.backend, "api": args.api, "max_in_flight": args.max_in_flight,
            "sglang": json.loads(args.sglang_json) if args.backend == "sglang" else None,
            "servers": list(args.servers), "gpus_per_job": args.gpus_per_job,
            "sampling": json.loads(params.to_json(**policy.recorded()))}


def run(args) -> int:
    if len(args.input) != 1 or len(args.out) != 1:
        raise PipelineError("calibrate: --input is one calibration sample and --out one JSON file")
    warm, rows, corpus = read_sample(args.input[0])
    if not rows:
        raise PipelineError(f"{args.input[0]}: the calibration sample is empty")
    # the file is in stratum order (shortest prompts first): sent in that order, the requests that finish while
    # the slots are busy (the steady-state figure) would be the short prompts only
    random.Random(corpus.get("seed", 0)).shuffle(rows)
    previous = {s: signal.signal(s, _terminate) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        t_launch, process_s = time.monotonic(), process_age_s()
        with stage.serving(args) as urls:
            result = asyncio.run(_calibrate(args, urls, warm, rows, t_launch, process_s))
    finally:
        for s, handler in previous.items():
            with contextlib.suppress(Exception):
                signal.signal(s, handler)
    if result["requests"]["ok"] == 0 or result["failure_rate"] > 0.5:
        raise PipelineError(f"calibration: {result['requests']['failed']} of {result['requests']['samples']} "
                            f"samples failed ({result['failure_reasons']}): fix the generation settings first")
    gpus = args.gpus_per_job
    rate = result["throughput"]["output_tok_s"]
    result["throughput"]["per_gpu_output_tok_s"] = round(rate / gpus, 2) if gpus else None
    result.update({"version": 1, "settings": settings_of(args), "corpus": corpus,
                   "max_new_tokens": args.max_new_tokens})
    storage.write_json(args.out[0], result)
    print(describe(result))
    return 0


def describe(cal: dict) -> str:
    """The calibration in a few lines (printed by the stage and quoted by the plan)."""
    th, out, lat, win = cal["throughput"], cal["output_tokens"], cal["latency_s"], cal["window"]
    per_gpu = f", {th['per_gpu_output_tok_s']:,.0f} per GPU" if th.get("per_gpu_output_tok_s") else ""
    req = cal["requests"]
    return "\n".join([
        f"CALIBRATION ({req['samples']} samples from {cal['corpus']['sample_shards']} shards, "
        f"{req['workers']} in flight; {cal['engine']['describe']})",
        f"  output rate: {th['output_tok_s']:,.1f} tok/s per job{per_gpu} - {th['basis']}",
        f"  window: {win['start']} to {win['end']} ({win['seconds']:.1f} s); warm-up {win['warmup_requests']} "
        f"requests ({win['warmup_s']:.1f} s) excluded; start-up {cal['startup_s']:.1f} s",
        f"  output tokens per sample (thinking included): mean {out.get('mean', 0):,.0f}, "
        f"p50 {out.get('p50', 0):,.0f}, "
        f"p90 {out.get('p90', 0):,.0f}, max {out.get('max', 0):,.0f}; thinking "
        f"{cal['thinking']['share_of_output_chars']:.0%} of output characters",
        f"  latency: p50 {lat.get('p50', 0):.2f} s, p90 {lat.get('p90', 0):.2f} s, p99 {lat.get('p99', 0):.2f} s",
        f"  finish_reason=length: {cal['finish_length_rate']:.1%}; failed: {cal['failure_rate']:.1%}"
        + (f" {cal['failure_reasons']}" if cal["failure_reasons"] else ""),
    ])
