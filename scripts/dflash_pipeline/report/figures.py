"""`dflash-pipeline report-figures`: the figures and tables of `snakemake --report` for one run.

Reads what the stages already wrote (generation summaries, extraction stats, the training metrics log, the
evaluation report, Snakemake's per-job benchmark files) and writes, into `--out-dir`:
`generation.png`, `extraction.png`, `training.png`, `tau.png` and `summary.html` (the numbers behind them, with
units, and the figures embedded: the page stands alone).
The rules mark these with `report()`, so `snakemake --report report.html` collects them beside the audit
reports and the evaluation plot. A stage that did not run in this configuration gets a figure saying so.
"""

from __future__ import annotations

import argparse
import csv
import glob
import json
import os
from collections import defaultdict
from pathlib import Path

from dflash_pipeline.hidden_states.group_stats import read_shard_stats
from dflash_pipeline.report import summary_page as page
from dflash_pipeline.storage import atomic_path

FIGURES = ("generation.png", "extraction.png", "training.png", "tau.png")


def _read_json(path):
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def _shard_name(path: str) -> str:
    """A generation summary's shard (extraction's rows are named by read_shard_stats)."""
    return Path(path).name.removesuffix(".summary.json")


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, out: Path) -> None:
    with atomic_path(out, suffix=".png") as tmp:
        fig.savefig(tmp, format="png", dpi=100, bbox_inches="tight")
    _plt().close(fig)


def _placeholder(out: Path, title: str, text: str) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 1.6))
    ax.axis("off")
    ax.set_title(title)
    ax.text(0.5, 0.4, text, ha="center", va="center", wrap=True)
    _save(fig, out)


def generation_figure(summaries: list[str], out: Path) -> dict:
    if not summaries:
        _placeholder(out, "Generation", "not run in this configuration (generate.enabled: false)")
        return {}
    rows = [(_shard_name(p), _read_json(p)) for p in sorted(summaries)]
    plt = _plt()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.6))
    names = [n for n, _ in rows]
    ok = [s.get("ok", 0) for _, s in rows]
    failed = [s.get("failed", 0) for _, s in rows]
    length = [s.get("finish_reason_length", 0) for _, s in rows]
    x = range(len(rows))
    ax1.bar(x, ok, label="ok")
    ax1.bar(x, failed, bottom=ok, label="failed")
    ax1.plot(list(x), length, "k.", label="finish_reason=length")
    ax1.set_title("Samples per shard")
    ax1.set_xticks(list(x), names, rotation=60, ha="right", fontsize=7)
    ax1.set_ylim(0, max([a + b for a, b in zip(ok, failed)] + length + [1]) * 1.15)  # headroom: no bar at the top
    ax1.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))  # beside the bars, never over one
    tps = [(s.get("this_run") or {}).get("completion_tokens_per_s", 0) for _, s in rows]
    ax2.bar(x, tps)
    ax2.set_ylim(0, max(tps + [1e-9]) * 1.15)
    ax2.set_title("Completion tokens/s (last run of each shard)")
    ax2.set_xticks(list(x), names, rotation=60, ha="right", fontsize=7)
    _save(fig, out)
    reasons: dict[str, int] = defaultdict(int)
    for _, s in rows:
        for k, v in (s.get("failure_reasons") or {}).items():
            reasons[k] += v
    return {
        "shards": len(rows), "samples": sum(s.get("samples", 0) for _, s in rows), "ok": sum(ok),
        "failed": sum(failed), "finish_reason_length": sum(length),
        "prompt_tokens": sum(s.get("prompt_tokens", 0) for _, s in rows),
        "completion_tokens": sum(s.get("completion_tokens", 0) for _, s in rows),
        "resumed_from_journal": sum(s.get("resumed_from_journal", 0) for _, s in rows),
        "failure_reasons": dict(reasons),
    }


def extraction_figure(stats: list[str], out: Path) -> dict:
    if not stats:
        _placeholder(out, "Extraction", "no hidden-state shards in this configuration (train.mode: online)")
        return {}
    rows = read_shard_stats(stats)
    plt = _plt()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.6))
    names = [n for n, _ in rows]
    x = list(range(len(rows)))
    ax1.bar(x, [s.get("tokens_per_s", 0) for _, s in rows])
    ax1.set_title("Extraction throughput (tokens/s, end to end)")
    ax1.set_xticks(x, names, rotation=60, ha="right", fontsize=7)
    per_token = [s.get("stored_bytes", 0) / max(1, s.get("tokens", 1)) for _, s in rows]
    raw = [s.get("raw_bf16_bytes", 0) / max(1, s.get("tokens", 1)) for _, s in rows]
    ax2.bar([i - 0.2 for i in x], raw, width=0.4, label="raw bf16")
    ax2.bar([i + 0.2 for i in x], per_token, width=0.4, label="stored")
    ax2.set_title("Bytes per token")
    ax2.set_xticks(x, names, rotation=60, ha="right", fontsize=7)
    ax2.legend(fontsize=7)
    _save(fig, out)
    tokens = sum(s.get("tokens", 0) for _, s in rows)
    stored = sum(s.get("stored_bytes", 0) for _, s in rows)
    raw_total = sum(s.get("raw_bf16_bytes", 0) for _, s in rows)
    seconds = sum(s.get("seconds", 0) for _, s in rows)
    return {
        "shards": len(rows), "samples": sum(s.get("samples", 0) for _, s in rows), "tokens": tokens,
        "stored_bytes": stored, "raw_bf16_bytes": raw_total,
        "stored_vs_raw_bf16": round(stored / raw_total, 4) if raw_total else None,
        "file_bytes": sum(s.get("file_bytes", 0) for _, s in rows),
        "tokens_per_s": round(tokens / seconds, 1) if seconds else None,
        "codec": sorted({str(s.get("codec")) for _, s in rows}),
        "device": sorted({str(s.get("device")) for _, s in rows if s.get("device")}),
    }


def training_figure(metrics: str | None, out: Path) -> dict:
    records = []
    if metrics and os.path.exists(metrics):
        with open(metrics, encoding="utf-8") as fh:
            records = [json.loads(line) for line in fh if line.strip()]
    if not records:
        _placeholder(out, "Training", "no training metrics found")
        return {}
    plt = _plt()
    fig, axes = plt.subplots(1, 4, figsize=(17, 3.4))
    steps = [r["step"] for r in records]
    axes[0].plot(steps, [r.get("loss") for r in records], marker=".")
    axes[0].set_title("loss")
    axes[1].plot(steps, [r.get("accuracy") for r in records], marker=".")
    axes[1].set_title("block accuracy")
    axes[2].plot(steps, [r.get("lr") for r in records], marker=".")
    axes[2].set_title("learning rate")
    held = [r for r in records if r.get("heldout_tau") is not None]
    axes[3].plot([r["step"] for r in held], [r["heldout_tau"] for r in held], marker="o")
    axes[3].set_title("held-out acceptance (simulated tau)")
    for ax in axes:
        ax.set_xlabel("optimizer step")
    _save(fig, out)
    last = records[-1]
    return {"steps": last.get("step"), "final_loss": last.get("loss"), "final_accuracy": last.get("accuracy"),
            "tokens_per_s": last.get("tokens_per_s"),
            "heldout_last_tau": held[-1]["heldout_tau"] if held else None,
            "heldout_best_tau": max((r["heldout_tau"] for r in held), default=None),
            "heldout_stopped_improving": bool(held[-1].get("heldout_stopped_improving")) if held else None}


def tau_figure(report: str | None, out: Path) -> dict:
    if not report or not os.path.exists(report):
        _placeholder(out, "Acceptance length", "no evaluation report")
        return {}
    rep = _read_json(report)
    names = [n for n in ("untrained", "trained") if isinstance(rep.get(n), dict)]
    temps = rep.get("temperatures") or {"0": {n: rep[n].get("tau") for n in names}}
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.2))
    width = 0.8 / max(1, len(names))
    top = 0.0
    for j, (name, color) in enumerate(zip(names, ("#999999", "#1f77b4"))):
        for i, by in enumerate(temps.values()):
            t = by.get(name) or 0.0
            top = max(top, t)
            ax.bar(i + (j - (len(names) - 1) / 2) * width, t, width, color=color, label=name if i == 0 else None)
            ax.text(i + (j - (len(names) - 1) / 2) * width, t, f"{t:.2f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(temps)), [TEMPERATURE_LABEL(t) for t in temps])
    ax.set_ylim(0, top * 1.2 or 1)  # headroom for the labels
    ax.set_ylabel("tau (tokens per target forward)")
    ax.set_title(f"Acceptance length, block size {rep.get('block_size')}")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    _save(fig, out)
    return {"passed": rep.get("passed"), "block_size": rep.get("block_size"),
            "target_layer_ids": rep.get("target_layer_ids"), **{f"tau_{n}": rep[n].get("tau") for n in names},
            "reasons": rep.get("reasons"), "temperatures": temps,
            "prompts": (rep.get("prompts") or {}).get("count"), "turns": rep.get("turns"),
            "acceptance_plot": str(Path(report).with_name("acceptance.png"))}


def TEMPERATURE_LABEL(t: str) -> str:  # noqa: N802 - used like a constant table
    return "greedy (T=0)" if float(t) == 0 else f"sampled, T={t}"


def stage_times(bench_dir: str | None) -> dict:
    """Wall seconds per rule from Snakemake's benchmark files (benchmarks/<rule>[/...].tsv)."""
    totals: dict[str, list[float]] = defaultdict(list)
    if not bench_dir or not os.path.isdir(bench_dir):
        return {}
    for path in glob.glob(os.path.join(bench_dir, "**", "*.tsv"), recursive=True):
        rel = os.path.relpath(path, bench_dir)
        stage = rel.split(os.sep)[0].removesuffix(".tsv")
        if stage == "tokenize":
            parts = rel.split(os.sep)
            stage = f"tokenize ({parts[1]})" if len(parts) > 2 else stage
        with open(path, encoding="utf-8") as fh:
            for row in csv.DictReader(fh, delimiter="\t"):
                try:
                    totals[stage].append(float(row["s"]))
                except (KeyError, ValueError):
                    pass
    return {k: {"jobs": len(v), "seconds": round(sum(v), 2), "max_s": round(max(v), 2)} for k, v in sorted(totals.items())}


def _ratio(actual, planned):
    """actual / planned to 4 significant digits (rounding to decimals turned 0.00016 into 0)."""
    return float(f"{actual / planned:.4g}") if actual is not None and planned else None


def _job_hours(bench_dir: str | None, stage: str) -> float | None:
    seconds = (stage_times(bench_dir).get(stage) or {}).get("seconds")
    return round(seconds / 3600, 4) if seconds is not None else None


def _gpu_hours(bench_dir: str | None, stage: str, gpus: float) -> float | None:
    hours = _job_hours(bench_dir, stage)
    return round(hours * gpus, 4) if hours is not None else None


def generation_vs_calibration(plan: dict, cal: dict, summaries: list[str], bench_dir: str | None) -> list[list]:
    """[stage, measure, calibrated/planned, actual, actual/planned, note] rows for generation: the calibration
    ran on this run's own backend and hardware, so every ratio compares like with like."""
    proj = plan.get("generation") or {}
    rows = [_read_json(p) for p in summaries]
    samples = sum(s.get("samples", 0) for s in rows)
    ok = sum(s.get("ok", 0) for s in rows)
    tokens = sum(s.get("completion_tokens", 0) for s in rows)
    live = sorted((s.get("calibration") or {}).get("live_output_tok_s") for s in rows
                  if (s.get("calibration") or {}).get("live_output_tok_s"))
    actual = {
        "output tok/s per job (start-up excluded)": live[len(live) // 2] if live else None,
        "mean output tokens per sample": round(tokens / samples, 1) if samples else None,
        "output tokens (whole corpus)": tokens if rows else None,
        "finish_reason=length rate": round(sum(s.get("finish_reason_length", 0) for s in rows) / ok, 4) if ok else None,
        "failure rate": round((samples - ok) / samples, 4) if samples else None,
        "job-hours (Snakemake benchmarks)": _job_hours(bench_dir, "generate"),
    }
    planned = {
        "output tok/s per job (start-up excluded)": (cal.get("throughput") or {}).get("output_tok_s"),
        "mean output tokens per sample": (cal.get("output_tokens") or {}).get("mean"),
        "output tokens (whole corpus)": proj.get("expected_output_tokens"),
        "finish_reason=length rate": cal.get("finish_length_rate"),
        "failure rate": cal.get("failure_rate"),
        "job-hours (Snakemake benchmarks)": round(proj["job_hours"], 4) if "job_hours" in proj else None,
    }
    return [["generation", k, planned[k], actual[k], _ratio(actual[k], planned[k]), None] for k in planned]


def _not_comparable(plan: dict, devices: list[str]) -> str | None:
    """Why the plan's GPU rates say nothing about this run, or None: the plan prices extraction and training
    from a reference GPU's measured rate (scaled to the target), unless it measured this run's own shards;
    a run on CPU (the demo) is then thousands of times slower, and the ratio only says so."""
    if str(plan.get("extract_tok_s_source", "")).startswith("measured on") or devices != ["cpu"]:
        return None
    return "not comparable: the plan's rate is a GPU's (scaled from one H200); this run ran on CPU"


def extraction_vs_plan(plan: dict, rows: list[dict], bench_dir: str | None, gpus: float = 1) -> list[list]:
    """`rows`: every extracted shard's stats (read_shard_stats)."""
    if not rows:
        return []
    tokens = sum(s.get("tokens", 0) for s in rows)
    seconds = sum(s.get("seconds", 0) for s in rows)
    hardware = _not_comparable(plan, sorted({str(s.get("device")) for s in rows if s.get("device")}))
    pairs = {
        "tokens": (plan.get("extract_tokens"), tokens, None),
        "stored bytes": (plan.get("hidden_bytes"), sum(s.get("stored_bytes", 0) for s in rows), None),
        "tok/s": (plan.get("extract_tok_s"), round(tokens / seconds, 1) if seconds else None, hardware),
        "GPU-hours (job-hours x GPUs per job)": (plan.get("extract_gpu_hours"),
                                                _gpu_hours(bench_dir, "extract", gpus), hardware),
        # the plan's job time: every job's start-up + tokens at its rate (measured or ASSUMED: plan.txt says)
        "job-hours (Snakemake benchmarks)": (plan.get("extract_gpu_hours"), _job_hours(bench_dir, "extract"),
                                             hardware),
    }
    return [["extraction", k, p, a, None if note else _ratio(a, p), note] for k, (p, a, note) in pairs.items()]


def plan_vs_actual(plan_path: str | None, cal_path: str | None, summaries: list[str], stats: list[str],
                   bench_dir: str | None, extract_gpus: float = 1, train_gpus: float = 1) -> list[list]:
    """The calibration and the plan against what the run measured, per stage: [stage, measure, planned,
    actual, actual/planned, note], the ratio None where the note says why it would mean nothing."""
    plan = _read_json(plan_path) if plan_path and os.path.exists(plan_path) else {}
    cal = _read_json(cal_path) if cal_path and os.path.exists(cal_path) else {}
    rows = generation_vs_calibration(plan, cal, summaries, bench_dir) if cal else []
    if plan:
        shard_stats = [s for _, s in read_shard_stats(stats)]  # read once: extraction's rows and its devices
        rows += extraction_vs_plan(plan, shard_stats, bench_dir, extract_gpus)
        actual = _gpu_hours(bench_dir, "train", train_gpus)
        if plan.get("train_gpu_hours") is not None and actual is not None:
            devices = sorted({str(s.get("device")) for s in shard_stats})
            note = _not_comparable(plan, devices)
            rows.append(["training", "GPU-hours (job-hours x GPUs per job)", plan["train_gpu_hours"], actual,
                         None if note else _ratio(actual, plan["train_gpu_hours"]), note])
            hours = _job_hours(bench_dir, "train")
            rows.append(["training", "job-hours (Snakemake benchmarks)", plan["train_gpu_hours"], hours,
                         None if note else _ratio(hours, plan["train_gpu_hours"]), note])
        evaluated = _job_hours(bench_dir, "evaluate")
        if evaluated is not None:
            planned = plan.get("evaluate_hours")
            rows.append(["evaluation", "job-hours (Snakemake benchmarks)", planned, evaluated,
                         _ratio(evaluated, planned) if planned else None,
                         None if planned else plan.get("evaluate_basis") or "not projected by the plan"])
    return rows


def calibration_summary(path: str | None) -> dict:
    if not path or not os.path.exists(path):
        return {}
    cal = _read_json(path)
    th, out = cal.get("throughput") or {}, cal.get("output_tokens") or {}
    return {"output_tok_s_per_job": th.get("output_tok_s"), "per_gpu": th.get("per_gpu_output_tok_s"),
            "basis": th.get("basis"), "window": cal.get("window"), "startup_s": cal.get("startup_s"),
            "output_tokens": {k: out.get(k) for k in ("mean", "p50", "p90", "p99", "max")},
            "latency_s": cal.get("latency_s"), "finish_length_rate": cal.get("finish_length_rate"),
            "failure_rate": cal.get("failure_rate"), "thinking": cal.get("thinking"), "requests": cal.get("requests")}


def write_summary(out_dir: Path, sections: dict[str, dict], versus: list[list]) -> None:
    """summary.html: one self-contained page, figures embedded, every number with its unit. The result leads (tau
    greedy and sampled, trained vs untrained, the acceptance curve), then the cost, then the data: each part is
    one (title, html) entry of `parts`, so a new section slots in where it belongs."""
    tau = sections.get("Acceptance length (tau)") or {}
    result = (page.tau_table(tau) + page.turn_table(tau) + page.embedded_png(out_dir / "tau.png", "tau")
              + page.embedded_png(tau.get("acceptance_plot"), "acceptance per block position")
              + page.table(page.tau_rows(tau))) if tau else "<p class='note'>no evaluation report</p>"
    times = sections.get("Stage wall time (Snakemake benchmarks)") or {}
    parts = [("Result: acceptance length (tau)", result),
             ("Cost: stage wall time (Snakemake benchmarks)",
              page.grid(["stage", "jobs", "wall time, all jobs", "longest job"], page.stage_time_rows(times))
              if times else "<p class='note'>no benchmark files</p>"),
             ("Cost: calibration and plan vs actual",
              page.grid(["stage", "measure", "calibrated / planned", "actual", "actual / planned"],
                        page.versus_rows(versus)) if versus else "<p class='note'>no plan in this run</p>")]
    data = {"Generation": (page.generation_rows, "generation.png"),
            "Generation calibration": (page.calibration_rows, None),
            "Extraction": (page.extraction_rows, "extraction.png"), "Training": (page.training_rows, "training.png")}
    for title, (make_rows, fig) in data.items():
        d = sections.get(title) or {}
        img = page.embedded_png(out_dir / fig, title) if fig else None
        parts.append((f"Data: {title.lower()}", page.section_body(make_rows(d) if d else [], img)))
    page.write_summary_page(out_dir / "summary.html", parts)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--generation", nargs="*", default=[], help="completions/*.summary.json")
    p.add_argument("--extraction", nargs="*", default=[], help="hidden/groups/*.stats.json (each extraction group's)")
    p.add_argument("--train", default=None, help="the trained drafter directory (its metrics.jsonl)")
    p.add_argument("--evaluate", default=None, help="evaluate/report.json")
    p.add_argument("--benchmarks", default=None, help="the run's benchmarks directory")
    p.add_argument("--plan", default=None, help="plan.json (projections to compare with the actual run)")
    p.add_argument("--calibration", default=None, help="the generation calibration (calibration/generation.json)")
    p.add_argument("--extract-gpus", type=float, default=1, help="GPUs per extraction job (for GPU-hours)")
    p.add_argument("--train-gpus", type=float, default=1, help="GPUs per training job, all nodes (for GPU-hours)")
    p.add_argument("--out-dir", required=True)


def run(args) -> int:
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    metrics = os.path.join(args.train, "metrics.jsonl") if args.train else None
    sections = {
        "Generation": generation_figure(args.generation, out / "generation.png"),
        "Extraction": extraction_figure(args.extraction, out / "extraction.png"),
        "Training": training_figure(metrics, out / "training.png"),
        "Acceptance length (tau)": tau_figure(args.evaluate, out / "tau.png"),
        "Stage wall time (Snakemake benchmarks)": stage_times(args.benchmarks),
        "Generation calibration": calibration_summary(args.calibration),
    }
    versus = plan_vs_actual(args.plan, args.calibration, args.generation, args.extraction, args.benchmarks,
                            args.extract_gpus, args.train_gpus)
    write_summary(out, sections, versus)
    print(json.dumps({k: v for k, v in sections.items()}, default=str)[:2000])
    return 0
