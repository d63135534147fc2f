"""The generation projection: the whole corpus priced from a measured calibration, and the gate on it.

Inputs are measured figures (a `dflash-pipeline calibrate` result): output tokens per sample and the output
rate of one generation job with its GPUs, plus its server start-up. The model of a run: every job pays its
start-up, then generates its share of the tokens at the measured rate; `parallel_jobs` jobs run at a time.

    job-seconds = jobs x start-up + samples x mean output tokens / rate
    wall        = job-seconds / min(jobs, parallel_jobs)
    GPU-hours   = job-seconds x GPUs per job / 3600

Pure functions: the plan command reads the files and renders the result.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash_pipeline import settings


@dataclass(frozen=True)
class RunShape:
    """The configured hardware and split of the full generation."""

    samples: float
    jobs: int                     # generation jobs (groups of generate.shards_per_job shards)
    parallel_jobs: int            # generate.parallel_jobs: how many run at the same time
    gpus_per_job: int             # generate.gpus
    max_new_tokens: int
    gpu_hour_usd: float | None = None


def assumed_calibration(generate: dict) -> dict:
    """Calibration figures from config `generate.assumed` (no GPU ran): what the cost preview prices generation
    with, marked ASSUMED everywhere it is shown. Without a mean answer length it takes max_new_tokens (a bound)."""
    assumed = generate.get("assumed") or {}
    gpus = max(1, int(settings.value(generate, "generate.gpus")))
    assumed = {**settings.defaults("generate.assumed"), **{k: v for k, v in assumed.items() if v is not None}}
    per_gpu = float(assumed["output_tok_s_per_gpu"])
    mean = assumed["mean_output_tokens"] or int(settings.value(generate, "generate.max_new_tokens"))
    return {
        "throughput": {"output_tok_s": per_gpu * gpus, "steady_state": True},
        "output_tokens": {"mean": float(mean)}, "startup_s": float(assumed["startup_s"]),
        "requests": {"samples": 0}, "assumed": True, "finish_length_rate": None, "failure_rate": None,
        "assumed_basis": f"{per_gpu:,.0f} output tok/s per GPU, {float(mean):,.0f} output tokens per sample"
                         + ("" if assumed.get("mean_output_tokens") else " (max_new_tokens: an upper bound)")
                         + f", {float(assumed['startup_s']):.0f} s start-up (config generate.assumed)",
    }


def _timing(shape: RunShape, tokens: float, rate: float, startup_s: float, running: int | None = None) -> dict:
    job_s = shape.jobs * startup_s + tokens / max(rate, 1e-9)
    running = max(1, min(shape.jobs, running or shape.parallel_jobs))
    gpu_h = job_s * shape.gpus_per_job / 3600
    return {"job_hours": job_s / 3600, "wall_hours": job_s / running / 3600, "gpu_hours": gpu_h,
            "cost_usd": gpu_h * shape.gpu_hour_usd if shape.gpu_hour_usd else None}


def drain_seconds(capacity: float, rate: float, longest: float, tokens_per_job: float) -> float:
    """The time a job loses at its end, when its last rows decode in a pool that no longer fills: a step costs
    about the same however few rows it carries (capacity / rate seconds), the last round lasts the longest answer
    (`longest` steps), and its rows have on average half their answers left, so about half that round is lost.
    A job smaller than one round lasts the longest answer whatever its tokens."""
    if capacity <= 0 or rate <= 0 or longest <= 0:  # (a server's step grows cheaper as it empties: no figure)
        return 0.0
    step = capacity / rate
    return max(0.5 * longest * step, longest * step - tokens_per_job / rate)


def project_generation(cal: dict, shape: RunShape) -> dict:
    """Expected output tokens, wall time, GPU-hours and cost of the full generation, with sensitivity."""
    out = cal["output_tokens"]
    mean = float(out["mean"])
    rate = float(cal["throughput"]["output_tok_s"])
    tokens = shape.samples * mean
    slots = (cal.get("settings") or {}).get("backend") == "hf"  # a fixed-width captured step: same cost when emptying
    capacity = float((cal.get("engine") or {}).get("capacity") or 0) if slots else 0.0
    drain = drain_seconds(capacity, rate, float(out.get("max") or 0), tokens / max(1, shape.jobs))
    startup = float(cal.get("startup_s") or 0.0) + drain  # what each job pays besides its tokens at the rate
    proj = {
        "basis": "ASSUMED figures" if cal.get("assumed") else "measured (calibration)",
        "assumed": bool(cal.get("assumed")), "calibrated_samples": cal["requests"]["samples"],
        "window": cal.get("window"), "steady_state": cal["throughput"].get("steady_state"),
        "samples": shape.samples, "mean_output_tokens": mean, "expected_output_tokens": tokens,
        "max_output_tokens": shape.samples * shape.max_new_tokens,
        "output_tok_s_per_job": rate, "output_tok_s_per_gpu": rate / shape.gpus_per_job if shape.gpus_per_job else None,
        "startup_s": startup - drain, "drain_s": drain, "jobs": shape.jobs, "parallel_jobs": min(shape.jobs, shape.parallel_jobs),
        "gpus_per_job": shape.gpus_per_job, "gpu_hour_usd": shape.gpu_hour_usd,
        "finish_length_rate": cal.get("finish_length_rate"), "failure_rate": cal.get("failure_rate"),
        "assumed_basis": cal.get("assumed_basis"),
        **_timing(shape, tokens, rate, startup),
    }
    proj["sensitivity"] = {label: _timing(shape, tokens, rate * f, startup)
                           for label, f in (("throughput -25%", 0.75), ("throughput +25%", 1.25))}
    proj["alternatives"] = alternatives(cal, shape, tokens, rate, startup)
    return proj


def alternatives(cal: dict, shape: RunShape, tokens: float, rate: float, startup: float) -> list[dict]:
    """What changes the projection, each priced from the same measured figures where that is honest."""
    alts = []
    if shape.jobs >= 2 * shape.parallel_jobs:
        alts.append({"change": f"twice the GPUs: generate.parallel_jobs {2 * shape.parallel_jobs}",
                     **_timing(shape, tokens, rate, startup, 2 * shape.parallel_jobs), "note": ""})
    else:  # every job already runs at once: more GPUs per job (dp_size / instances x2)
        wider = RunShape(shape.samples, shape.jobs, shape.parallel_jobs, 2 * shape.gpus_per_job,
                         shape.max_new_tokens, shape.gpu_hour_usd)
        alts.append({"change": "twice the GPUs: generate.sglang dp_size or instances x2 per job (generate.gpus "
                               f"{2 * shape.gpus_per_job})", **_timing(wider, tokens, 2 * rate, startup),
                     "note": "assumes the per-GPU rate holds (data-parallel replicas); calibrate to confirm"})
    lengths = cal["output_tokens"].get("per_sample_all") or []
    cap = shape.max_new_tokens // 2
    if lengths and cap >= 1:
        capped = sum(min(v, cap) for v in lengths) / len(lengths)
        cut = sum(v > cap for v in lengths) / len(lengths)
        alts.append({"change": f"generate.max_new_tokens {shape.max_new_tokens} -> {cap}",
                     **_timing(shape, shape.samples * capped, rate, startup),
                     "note": f"{cut:.0%} of the calibration's answers would be cut at the cap (finish_reason=length); "
                             "a bound from the measured lengths"})
    fewer = RunShape(shape.samples * 0.75, shape.jobs, shape.parallel_jobs, shape.gpus_per_job,
                     shape.max_new_tokens, shape.gpu_hour_usd)
    alts.append({"change": "25% fewer samples", **_timing(fewer, tokens * 0.75, rate, startup), "note": ""})
    alts.append({"change": "fp8 weights / KV cache (generate.sglang.extra_args, e.g. --quantization fp8 "
                           "--kv-cache-dtype fp8_e4m3)", "wall_hours": None, "gpu_hours": None, "cost_usd": None,
                 "note": "not projected: calibrate with it to measure the rate"})
    share = shape.jobs * startup / max(shape.jobs * startup + tokens / max(rate, 1e-9), 1e-9)
    if shape.jobs > 1 and share >= 0.01:
        alts.append({"change": f"fewer server start-ups (raise generate.shards_per_job): {shape.jobs} jobs pay "
                               f"{startup:.0f} s each (start-up and drain)", "wall_hours": None, "gpu_hours": None, "cost_usd": None,
                     "note": f"{share:.0%} of the job time above"})
    return alts


def fmt_hours(h: float | None) -> str:
    if h is None:
        return "n/a"
    if h >= 48:
        return f"{h / 24:.1f} days ({h:,.0f} h)"
    if h >= 1:
        return f"{h:.1f} h"
    return f"{h * 60:.1f} min"


def _money(usd: float | None) -> str:
    return f"${usd:,.0f}" if usd is not None else ""


def render_generation(proj: dict) -> list[str]:
    f = lambda x: f"{x:,.0f}"  # noqa: E731
    per_gpu = (f" ({f(proj['output_tok_s_per_gpu'])} per GPU, {proj['gpus_per_job']} GPU(s) per job)"
               if proj["output_tok_s_per_gpu"] else " (no GPUs: generate.gpus is 0)")
    window = proj.get("window") or {}
    cost = (f"; {_money(proj['cost_usd'])} at ${proj['gpu_hour_usd']:.2f}/GPU-hour" if proj["cost_usd"] is not None
            else ("" if not proj["gpus_per_job"] else "; set cost.gpu_hour_usd for the cost"))
    source = (f"ASSUMED figures ({proj['assumed_basis']}; not measured: the calibration measures them on the GPUs)"
              if proj.get("assumed_basis") else
              f"ASSUMED calibration figures ({proj['calibrated_samples']} samples, not measured)" if proj.get("assumed")
              else f"the calibration ({proj['calibrated_samples']} samples measured {window.get('start', '?')} to "
                   f"{window.get('end', '?')})")
    lines = [
        f"  generate, projected from {source}:",
        f"    expected output tokens: {f(proj['expected_output_tokens'])} ({f(proj['samples'])} samples x "
        f"{proj['mean_output_tokens']:,.0f} mean, thinking included; at most {f(proj['max_output_tokens'])} at "
        f"max_new_tokens)",
        f"    rate: {f(proj['output_tok_s_per_job'])} output tok/s per job{per_gpu}"
        + ("" if proj.get("steady_state") else " - a lower bound (the calibration did not load the engine as the "
                                              "run will; see its basis)")
        + f"; start-up {proj['startup_s']:.0f} s"
        + (f" and drain {proj['drain_s']:.0f} s (the last round's unfilled slots)" if proj.get("drain_s") else "")
        + " per job",
        f"    wall time: {fmt_hours(proj['wall_hours'])} with {proj['parallel_jobs']} of {proj['jobs']} job(s) at a "
        f"time; {proj['gpu_hours']:,.1f} GPU-hours{cost}",
        "    sensitivity: " + "; ".join(f"{k}: {fmt_hours(v['wall_hours'])}" for k, v in proj["sensitivity"].items()),
        "    what changes it:",
    ]
    if proj.get("finish_length_rate") is not None:
        lines.insert(-1, f"    finish_reason=length in the calibration: {proj['finish_length_rate']:.1%}; failed: "
                         f"{proj['failure_rate']:.1%}")
    for alt in proj["alternatives"]:
        figures = (f"{fmt_hours(alt['wall_hours'])}, {alt['gpu_hours']:,.1f} GPU-hours"
                   + (f", {_money(alt['cost_usd'])}" if alt.get("cost_usd") is not None else "")
                   if alt["wall_hours"] is not None else "")
        note = f" ({alt['note']})" if alt["note"] else ""
        lines.append(f"      - {alt['change']}: {figures}{note}" if figures else f"      - {alt['change']}{note}")
    return lines


def gate_failures(proj: dict, max_wall_hours: float | None, max_gpu_hours: float | None) -> list[str]:
    """The limits the projection exceeds, each as a sentence ([] when it passes)."""
    failures = []
    if max_wall_hours is not None and proj["wall_hours"] > max_wall_hours:
        failures.append(f"projected wall time {fmt_hours(proj['wall_hours'])} exceeds generate.max_wall_hours "
                        f"{max_wall_hours:g}")
    if max_gpu_hours is not None and proj["gpu_hours"] > max_gpu_hours:
        failures.append(f"projected {proj['gpu_hours']:,.1f} GPU-hours exceed generate.max_gpu_hours {max_gpu_hours:g}")
    return failures
