"""`report/summary.html`: one self-contained page (figures embedded as base64 PNG) that a person reads after a
run: each stage's figures with units, the stage times, and the plan against what the run measured."""

from __future__ import annotations

import base64
import html
import os
from pathlib import Path

from dflash_pipeline.report import units as u
from dflash_pipeline.storage import atomic_open

STYLE = ("body{font-family:sans-serif;margin:1.5em;max-width:75em}table{border-collapse:collapse;margin-bottom:1em}"
         "th,td{border:1px solid #ccc;padding:3px 8px;text-align:left;font-size:13px}th{background:#f4f4f4}"
         "td.n{text-align:right}img{max-width:100%;display:block;margin:.5em 0 1em}p.note{color:#555;font-size:13px}")

# the unit of each measure of the plan-vs-actual table
MEASURE_FORMAT = {
    "output tok/s per job (start-up excluded)": u.tok_s,
    "mean output tokens per sample": u.mean_tokens,
    "output tokens (whole corpus)": u.tokens,
    "finish_reason=length rate": u.percent,
    "failure rate": u.percent,
    "job-hours (Snakemake benchmarks)": lambda v: u.hours(v, "job-hours"),
    "GPU-hours (job-hours x GPUs per job)": lambda v: u.hours(v, "GPU-hours"),
    "tokens": u.tokens,
    "stored bytes": u.nbytes,
    "tok/s": u.tok_s,
}


HOURS_MEASURES = {"job-hours (Snakemake benchmarks)": "job-hours", "GPU-hours (job-hours x GPUs per job)": "GPU-hours"}


def embedded_png(path: str | Path | None, alt: str) -> str:
    if not path or not os.path.exists(path):
        return ""
    data = base64.b64encode(Path(path).read_bytes()).decode("ascii")
    return f"<img alt='{html.escape(alt)}' src='data:image/png;base64,{data}'>"


def table(rows: list[tuple[str, str]]) -> str:
    body = "".join(f"<tr><th>{html.escape(k)}</th><td class='n'>{html.escape(v)}</td></tr>" for k, v in rows)
    return f"<table>{body}</table>"


def grid(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def generation_rows(d: dict) -> list[tuple[str, str]]:
    return [("shards", u.count(d["shards"])), ("samples", u.count(d["samples"])),
            ("answered (ok)", u.count(d["ok"])), ("failed", u.count(d["failed"])),
            ("cut at max_new_tokens (finish_reason=length)", u.count(d["finish_reason_length"])),
            ("prompt tokens", u.tokens(d["prompt_tokens"])), ("generated tokens", u.tokens(d["completion_tokens"])),
            ("samples resumed from the journal", u.count(d["resumed_from_journal"])),
            ("failure reasons", u.listing(d["failure_reasons"]))]


def extraction_rows(d: dict) -> list[tuple[str, str]]:
    return [("shards", u.count(d["shards"])), ("samples", u.count(d["samples"])), ("tokens", u.tokens(d["tokens"])),
            ("hidden states stored", u.nbytes(d["stored_bytes"])), ("as raw bf16", u.nbytes(d["raw_bf16_bytes"])),
            ("stored / raw bf16", u.ratio(d["stored_vs_raw_bf16"])), ("files on disk", u.nbytes(d["file_bytes"])),
            ("throughput, end to end", u.tok_s(d["tokens_per_s"])), ("codec", u.listing(d["codec"])),
            ("device", u.listing(d.get("device")))]


def training_rows(d: dict) -> list[tuple[str, str]]:
    return [("optimizer steps", u.count(d["steps"])), ("final loss", u.number(d["final_loss"])),
            ("final block accuracy", u.percent(d["final_accuracy"])),
            ("throughput (last step)", u.tok_s(d["tokens_per_s"])),
            ("held-out acceptance, last / best (simulated tau)",
             u.NONE if d.get("heldout_last_tau") is None else
             f"{u.number(d['heldout_last_tau'])} / {u.number(d['heldout_best_tau'])}"),
            ("held-out acceptance stopped improving", u.yes_no(d.get("heldout_stopped_improving")))]


def tau_rows(d: dict) -> list[tuple[str, str]]:
    trained, untrained = d.get("tau_trained"), d.get("tau_untrained")
    gain = trained / untrained if trained is not None and untrained else None
    return [("evaluation gate passed", u.yes_no(d["passed"])), ("block size", u.count(d["block_size"])),
            ("target layer ids", u.listing(d["target_layer_ids"])),
            ("tau, trained drafter", u.number(trained) + " tokens per target forward" if trained else u.NONE),
            ("tau, untrained drafter (same shape)", u.number(untrained) if untrained else u.NONE),
            ("trained / untrained", u.ratio(gain)), ("gate's reasons", u.listing(d["reasons"]))]


def calibration_rows(d: dict) -> list[tuple[str, str]]:
    out, lat, req = d.get("output_tokens") or {}, d.get("latency_s") or {}, d.get("requests") or {}
    window = d.get("window") or {}
    qs = ("mean", "p50", "p90", "p99", "max")
    return [("rate per job", u.tok_s(d["output_tok_s_per_job"])), ("rate per GPU", u.tok_s(d["per_gpu"])),
            ("how the rate was measured", str(d["basis"] or u.NONE)),
            ("measurement window", u.seconds(window.get("seconds"))), ("server start-up", u.seconds(d["startup_s"])),
            ("output tokens per sample: " + ", ".join(qs), ", ".join(u.count(out.get(k)) for k in qs)),
            ("request latency: p50, p90, p99, max", ", ".join(u.seconds(lat.get(k)) for k in qs[1:])),
            ("requests: sent, answered, failed", ", ".join(u.count(req.get(k)) for k in ("samples", "ok", "failed"))),
            ("request slots (in flight at once)", u.count(req.get("workers"))),
            ("cut at max_new_tokens", u.percent(d["finish_length_rate"])), ("failed", u.percent(d["failure_rate"]))]


def stage_time_rows(d: dict) -> list[list[str]]:
    return [[stage, u.count(t["jobs"]), u.seconds(t["seconds"]), u.seconds(t["max_s"])] for stage, t in d.items()]


def versus_rows(rows: list[list]) -> list[list[str]]:
    """[stage, measure, planned, actual, ratio, note] -> cells with units; a ratio the note calls not
    comparable is shown as the note."""
    cells = []
    for stage, measure, planned, actual, ratio, note in rows:
        fmt = MEASURE_FORMAT.get(measure, u.number)
        if measure in HOURS_MEASURES:  # one unit per row: both in seconds, or both in hours
            small = all(v is None or v < 0.01 for v in (planned, actual))
            fmt = lambda v, what=HOURS_MEASURES[measure], small=small: u.hours(v, what, small)  # noqa: E731
        cells.append([stage, measure, fmt(planned), fmt(actual), note or u.ratio(ratio)])
    return cells


def tau_table(d: dict) -> str:
    """The headline: tau per temperature (greedy, then each sampled one), trained vs untrained and their ratio."""
    rows = []
    for t, by in (d.get("temperatures") or {}).items():
        tr, un = by.get("trained"), by.get("untrained")
        how = "greedy (T=0)" if float(t) == 0 else f"sampled, T={t} (speculative sampling)"
        rows.append([how, u.number(tr), u.number(un), u.ratio(tr / un if tr is not None and un else None)])
    note = f"<p class='note'>on {u.count(d['prompts'])} held-out prompts</p>" if d.get("prompts") else ""
    return grid(["decoding", "tau, trained drafter", "tau, untrained drafter", "trained / untrained"], rows) + note


TURN_LABEL = {"tool_call": "tool call", "chat": "chat"}


def turn_table(d: dict) -> str:
    """tau on the held-out turns whose output is a tool call and on chat turns (report.json `turns`), per
    temperature; a target whose template writes no calls gets the reason in a note, an older report nothing."""
    turns = d.get("turns") or {}
    if turns.get("unavailable"):
        return f"<p class='note'>tau by kind of turn: not reported ({html.escape(turns['unavailable'])})</p>"
    rows = []
    for t, by in (turns.get("tau") or {}).items():
        how = "greedy (T=0)" if float(t) == 0 else f"sampled, T={t}"
        for kind, label in TURN_LABEL.items():
            tr, un = by["trained"][kind], by["untrained"][kind]
            rows.append([how, label, u.count(tr["prompts"]), u.number(tr["tau"]), u.number(un["tau"])])
    if not rows:
        return ""
    data = turns.get("data") or {}
    note = (f"<p class='note'>kind of turn: what the target wrote in that run (a tool call opens "
            f"&lt;tool_call&gt;); in the data, {u.count(data.get('tool_call'))} of "
            f"{u.count(sum(data.values()))} held-out next turns call a tool</p>" if data else "")
    return grid(["decoding", "kind of turn (target's output)", "prompts (trained drafter's run)",
                 "tau, trained drafter", "tau, untrained drafter"], rows) + note


def section_body(rows, figure: str | None = None) -> str:
    if not rows:
        return "<p class='note'>not run in this configuration</p>" + (figure or "")
    return (figure or "") + table(rows)


def section(title: str, rows, figure: str | None = None) -> str:
    return f"<h2>{html.escape(title)}</h2>" + section_body(rows, figure)


def write_summary_page(out: Path, parts: list[tuple[str, str]]) -> None:
    """parts: (section title, its HTML) in reading order."""
    body = "".join(f"<h2>{html.escape(title)}</h2>{content}" for title, content in parts)
    page = ("<!DOCTYPE html><html><head><meta charset='utf-8'><title>DFlash pipeline run</title>"
            f"<style>{STYLE}</style></head><body><h1>DFlash pipeline run</h1>{body}</body></html>\n")
    with atomic_open(out, "w", encoding="utf-8") as fh:
        fh.write(page)
