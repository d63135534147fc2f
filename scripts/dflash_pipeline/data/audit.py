"""The data-quality gate: aggregate per-shard token audits into a report, then pass or stop the run.

The report (JSON + a self-contained HTML page with plots) says what the data looks like before any GPU
time is spent: supervision per sample, response lengths, turns, truncation, roles, quarantine reasons,
duplicates and placeholder answers repeated across samples, tool calls (per input file: the share of samples
that call tools, calls per such sample, records quarantined for a malformed call). Thresholds from the config
decide; `min_tool_call_share` (off by default) fails data meant to be agentic that has too few tool calls.

Modes: `full` checks everything (the gate in front of extraction). `prompts` is the gate in front of
generation: responses are about to be regenerated, so response-quality findings are warnings there.
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import json
import os
import sys
from collections import Counter

from dflash_pipeline import settings
from dflash_pipeline.data.audit_stats import AUDIT_FORMAT, TEXTS_KEPT, HashCounter, Histogram
from dflash_pipeline.errors import PipelineError
from dflash_pipeline.storage import atomic_open, read_json, write_json

RESPONSE_CHECKS = {"trivial", "empty", "no_supervision", "placeholder", "truncated", "not_ending_with_assistant"}
HISTOGRAMS = ("loss_tokens", "length", "turns", "assistant_turns", "response_tokens")
TOP_ANSWERS = 50


class _Merged:
    """Per-shard audits merged one file at a time: counters, histograms and answer-hash counts."""

    def __init__(self):
        self.totals: Counter[str] = Counter()
        self.roles, self.failures = Counter(), Counter()
        self.hist = {k: Histogram() for k in HISTOGRAMS}
        self.answers = HashCounter()
        self.texts: dict[str, str] = {}
        self.rejected: list[dict] = []
        self.settings: dict | None = None

    def add(self, a: dict) -> None:
        self.settings = self.settings or a["settings"]
        for key in ("samples", "tokens", "loss_tokens", "generation_failed"):
            self.totals[key] += a.get(key, 0)
        self.totals.update(a["counts"])
        self.failures.update(a.get("generation_failure_reasons", {}))
        self.roles.update(a["roles"])
        for k in HISTOGRAMS:
            self.hist[k].merge_json(a["histograms"][k])
        self.answers.add_many(a["answer_hashes"])
        for h, text in a["answer_texts"].items():
            if len(self.texts) < TEXTS_KEPT:
                self.texts.setdefault(h, text)
        self.rejected.extend(a.get("rejected_examples", [])[:max(0, 20 - len(self.rejected))])


def aggregate(audit_paths: list[str], manifest: dict, min_repeats: int) -> dict:
    merged = _Merged()
    for path in audit_paths:
        a = read_json(path)
        if a.get("format") != AUDIT_FORMAT:
            raise PipelineError(f"{path}: a shard audit of format {a.get('format', 1)}, this audit reads format "
                                f"{AUDIT_FORMAT}: tokenize again (snakemake --forcerun tokenize, or delete the "
                                f"tokens directory)")
        merged.add(a)
    repeated, top = merged.answers.summarize(min_repeats, TOP_ANSWERS)
    quarantine = Counter()
    for f in manifest["files"]:
        quarantine.update(f["quarantine_reasons"])
    return {
        "totals": dict(merged.totals),
        "roles": dict(merged.roles),
        "top_answers": [{"answer": merged.texts.get(h, f"(long answer {h})"), "samples": c} for h, c in top],
        "placeholder_samples": repeated,
        "histograms": {k: h.to_json() for k, h in merged.hist.items()},
        "settings": merged.settings or {},
        "generation_failure_reasons": dict(merged.failures),
        "rejected_examples": merged.rejected,
        "ingest": {
            "totals": manifest["totals"],
            "files": manifest["files"],
            "quarantine_reasons": dict(quarantine.most_common()),
            "duplicate_examples": manifest.get("duplicate_examples", [])[:20],
        },
    }


def _check_specs(agg: dict, thresholds: dict) -> list[tuple]:
    t, ingest = agg["totals"], agg["ingest"]["totals"]
    n, read = max(t.get("samples", 0), 1), max(ingest["records_read"], 1)
    trivial_tokens = agg["settings"].get("trivial_tokens", settings.value(thresholds, "audit.trivial_response_tokens"))
    min_repeats = thresholds["placeholder_min_repeats"]
    placeholders = [a["answer"] for a in agg["top_answers"][:3] if a["samples"] >= min_repeats]
    specs = [
        ("min_samples", t.get("samples", 0), thresholds["min_samples"], ">=",
         "||too few samples survived ingest and tokenization: check the inputs"
         + (f"; {quarantined_files(agg['ingest'])}" if ingest["quarantined"] else "")),
        ("trivial", t.get("trivial", 0) / n, thresholds["max_trivial_fraction"], "<=",
         f"of samples have trivial responses (no turn over {trivial_tokens} supervised tokens, e.g. a bare 'OK.')||"
         "regenerate the responses with the target (generate.enabled: true) or filter these samples"),
        ("no_supervision", t.get("no_supervision", 0) / n, thresholds["max_trivial_fraction"], "<=",
         "of samples have no supervised token at all||no assistant turn lies inside max_length: raise it or filter"),
        ("empty", t.get("empty_response", 0) / n, thresholds["max_empty_fraction"], "<=",
         "of samples contain an empty assistant response||regenerate or filter them"),
        ("placeholder", agg["placeholder_samples"] / n, thresholds["max_placeholder_fraction"], "<=",
         f"of samples end with an answer repeated in >= {min_repeats} samples (placeholders such as "
         f"{', '.join(map(repr, placeholders)) or 'none'})||regenerate the responses"),
        ("truncated", t.get("truncated", 0) / n, thresholds["max_truncated_fraction"], "<=",
         "of samples are longer than tokenize.max_length and were truncated||raise max_length or filter"),
        ("not_ending_with_assistant", t.get("not_ending_with_assistant", 0) / n,
         thresholds["max_not_ending_with_assistant_fraction"], "<=",
         "of conversations do not end with an assistant turn||their last user turn trains nothing"),
        ("control_tokens", t.get("control_tokens", 0) / max(n + t.get("control_tokens", 0), 1),
         thresholds["max_quarantine_fraction"], "<=",
         "of samples were left out because their text contains the template's control tokens (e.g. "
         "'<|im_end|>')||see rejected_examples in the report"),
        ("duplicates", ingest["duplicates"] / read, thresholds["max_duplicate_fraction"], "<=",
         "of records read were exact duplicates (dropped)||check that inputs are not listed twice"),
        ("quarantined", ingest["quarantined"] / read, thresholds["max_quarantine_fraction"], "<=",
         f"of records read were quarantined as malformed||{quarantined_files(agg['ingest'])}"),
    ]
    if thresholds.get("min_tool_call_share") is not None:
        specs.append(_tool_call_spec(agg, thresholds["min_tool_call_share"]))
    return specs


def _tool_call_spec(agg: dict, minimum: float) -> tuple:
    tc = tool_call_summary(agg)
    malformed = sum(f["malformed_quarantined"] for f in tc["files"])
    return ("tool_call_share", tc["share"], minimum, ">=",
            "of samples call tools (audit.min_tool_call_share)||the data is meant to be agentic: "
            f"{malformed} record(s) were quarantined for a malformed tool call, {tc['refused_tools_unsupported']} "
            "sample(s) left out because the target's chat template does not render tools; accepted shapes are in "
            "docs/data.md ('Tool-calling conversations')")


def tool_call_summary(agg: dict) -> dict:
    """Tool calling per input file (from the ingest stats: samples that call tools, their share of the file's
    kept records, calls per such sample, records quarantined for a malformed call) and over what tokenize kept
    (the gate's share: what trains) and refused (a template that cannot render tools)."""
    files = []
    for f in agg["ingest"]["files"]:
        tc = f.get("tool_calls")
        if tc is None:  # ingested before tool calling was counted
            continue
        ingested = f["kept"] + f["duplicates"]  # ingest's kept records, before deduplication
        files.append({"file": f["file"], "samples": tc["samples"], "share": tc["samples"] / max(ingested, 1),
                      "calls": tc["calls"], "calls_per_sample": tc["calls"] / tc["samples"] if tc["samples"] else 0.0,
                      "malformed_quarantined": tc["malformed_quarantined"]})
    t = agg["totals"]
    return {"files": files, "samples": t.get("tool_call_samples", 0),
            "share": t.get("tool_call_samples", 0) / max(t.get("samples", 0), 1),
            "refused_tools_unsupported": t.get("tools_unsupported", 0)}


def quarantined_files(ingest: dict, top: int = 3) -> str:
    """The files with the most quarantined records, each with its commonest reason and its quarantine file."""
    files = sorted((f for f in ingest["files"] if f["quarantined"]), key=lambda f: -f["quarantined"])
    parts = []
    for f in files[:top]:
        reason, count = max(f["quarantine_reasons"].items(), key=lambda kv: kv[1], default=("?", 0))
        where = os.path.join(ingest.get("quarantine_dir", "ingest/files"), f"{f['src']}.quarantine.jsonl")
        parts.append(f"{f['file']}: {f['quarantined']} of {f['records_read']} records quarantined, "
                     f"{count} of them for {reason!r} (all in {where})")
    more = f"; and {len(files) - top} more file(s)" if len(files) > top else ""
    return "; ".join(parts) + more if parts else "see the quarantine files for reasons"


def evaluate_checks(agg: dict, thresholds: dict, mode: str) -> list[dict]:
    out = []
    for name, value, limit, op, message in _check_specs(agg, thresholds):
        ok = value >= limit if op == ">=" else value <= limit
        status = "pass" if ok else ("warn" if mode == "prompts" and name in RESPONSE_CHECKS else "fail")
        shown = f"{value:.1%}" if isinstance(value, float) else str(value)
        limit_shown = f"{limit:.1%}" if isinstance(value, float) else str(limit)
        finding, _, advice = message.partition("||")
        text = f"{shown} {finding}" if isinstance(value, float) else f"{shown} samples"
        if status != "pass":
            text += f": {advice}"
            if status == "warn":
                text += " (generation is on: these responses will be replaced; the gate after generation checks again)"
        out.append({"check": name, "value": value, "threshold": limit, "op": op, "status": status,
                    "message": text, "limit_shown": limit_shown})
    return out


def build_report(audit_paths, manifest_path, thresholds, mode, dataset) -> dict:
    min_repeats = thresholds["placeholder_min_repeats"]
    agg = aggregate(audit_paths, read_json(manifest_path), min_repeats)
    agg["ingest"]["quarantine_dir"] = os.path.join(os.path.dirname(manifest_path), "files")
    checks = evaluate_checks(agg, thresholds, mode)
    t = agg["totals"]
    n = max(t.get("samples", 0), 1)
    return {
        "dataset": dataset,
        "mode": mode,
        "passed": all(c["status"] != "fail" for c in checks),
        "checks": checks,
        "totals": t,
        "fractions": {k: t.get(k, 0) / n for k in ("trivial", "no_supervision", "empty_response", "truncated",
                                                  "not_ending_with_assistant", "system_prompt")},
        "roles": agg["roles"],
        "top_answers": agg["top_answers"][:20],
        "placeholder_answers": [a for a in agg["top_answers"] if a["samples"] >= min_repeats],
        "placeholder_samples": agg["placeholder_samples"],
        "rejected_examples": agg["rejected_examples"],
        "generation_failure_reasons": agg["generation_failure_reasons"],
        "ingest": agg["ingest"],
        "tool_calls": tool_call_summary(agg),
        "histograms": agg["histograms"],
        "settings": agg["settings"],
        "thresholds": thresholds,
    }


def _hist_figure(plt, hist: dict, title: str, xlabel: str):
    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    if hist:
        values, counts = [int(k) for k in hist], list(hist.values())
        bins = min(60, max(5, len(values)))
        ax.hist(values, bins=bins, weights=counts, color="#3b6ea5")
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("samples")
    return fig


def _bar_figure(plt, counts: dict, title: str):
    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    items = sorted(counts.items(), key=lambda kv: -kv[1])[:12]
    ax.barh([str(k)[:40] for k, _ in items][::-1], [v for _, v in items][::-1], color="#a5573b")
    ax.set_title(title)
    fig.tight_layout()
    return fig


def _plots(report: dict) -> list[tuple[str, str]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    h, t = report["histograms"], report["totals"]
    fig = _hist_figure(plt, h["loss_tokens"], "Supervised tokens per sample", "tokens")
    trivial = report["settings"].get("trivial_tokens")
    if trivial is not None:  # where trivial answers pile up (a bare `OK.` turn sits at or left of the line)
        fig.axes[0].axvline(trivial + 0.5, color="#b3261e", linestyle="--", label=f"trivial (<= {trivial})")
        fig.axes[0].legend()
    figs = [
        ("Loss-mask sum per sample (supervised tokens)", fig),
        ("Response length per assistant turn",
         _hist_figure(plt, h["response_tokens"], "Response tokens per assistant turn", "tokens")),
        ("Turns per conversation", _hist_figure(plt, h["turns"], "Messages per conversation", "messages")),
        ("Sequence length", _hist_figure(plt, h["length"], "Tokens per sample (after truncation)", "tokens")),
        ("Truncation", _bar_figure(plt, {"truncated": t.get("truncated", 0),
                                         "complete": t.get("samples", 0) - t.get("truncated", 0)}, "Truncation")),
        ("Role counts", _bar_figure(plt, report["roles"], "Messages by role")),
        ("Quarantine reasons", _bar_figure(plt, report["ingest"]["quarantine_reasons"] or {"none": 0},
                                           "Quarantined records")),
        ("Most repeated final answers",
         _bar_figure(plt, {a["answer"]: a["samples"] for a in report["top_answers"][:10]}, "Final answers")),
    ]
    out = []
    for title, fig in figs:
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=80, bbox_inches="tight")
        plt.close(fig)
        out.append((title, base64.b64encode(buf.getvalue()).decode("ascii")))
    return out


def write_html(report: dict, path: str) -> None:
    esc = html.escape
    verdict = "PASSED" if report["passed"] else "FAILED"
    color = "#1d7a35" if report["passed"] else "#b3261e"
    rows = "".join(
        f"<tr class='{c['status']}'><td>{esc(c['check'])}</td><td>{esc(c['status'].upper())}</td>"
        f"<td>{esc(c['message'])}</td><td>{c['op']} {esc(c['limit_shown'])}</td></tr>"
        for c in report["checks"])
    files = "".join(
        f"<tr><td>{esc(f['file'])}</td><td>{f['records_read']}</td><td>{f['kept']}</td><td>{f['quarantined']}</td>"
        f"<td>{f['duplicates']}</td><td>{esc(json.dumps(f['damage']) if f['damage'] else '')}</td></tr>"
        for f in report["ingest"]["files"])
    tools = _tool_calls_html(report.get("tool_calls"), esc)
    answers = "".join(f"<tr><td>{esc(a['answer'])}</td><td>{a['samples']}</td></tr>" for a in report["top_answers"][:10])
    plots = "".join(f"<figure><img alt='{esc(t)}' src='data:image/png;base64,{b}'><figcaption>{esc(t)}</figcaption></figure>"
                    for t, b in _plots(report))
    t = report["totals"]
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>Data audit: {esc(report['dataset'])}</title>
<style>body{{font-family:system-ui,sans-serif;margin:2em;max-width:1200px}}table{{border-collapse:collapse;margin:1em 0}}
td,th{{border:1px solid #ccc;padding:4px 8px;text-align:left}}tr.fail td{{background:#fde7e6}}tr.warn td{{background:#fff4d6}}
figure{{display:inline-block;margin:0.5em}}h1 span{{color:{color}}}</style></head><body>
<h1>Data audit ({esc(report['dataset'])}, {esc(report['mode'])} gate): <span>{verdict}</span></h1>
<p>{t.get('samples', 0)} samples, {t.get('tokens', 0)} tokens, {t.get('loss_tokens', 0)} supervised;
{t.get('generation_failed', 0)} failed generations excluded.</p>
<h2>Checks</h2><table><tr><th>check</th><th>status</th><th>finding</th><th>threshold</th></tr>{rows}</table>
<h2>Inputs (read = kept + quarantined + duplicates)</h2>
<table><tr><th>file</th><th>read</th><th>kept</th><th>quarantined</th><th>duplicates</th><th>damage</th></tr>{files}</table>
{tools}
<h2>Most repeated final answers</h2><table><tr><th>answer</th><th>samples</th></tr>{answers}</table>
<h2>Plots</h2>{plots}</body></html>"""
    with atomic_open(path, "w", encoding="utf-8") as fh:
        fh.write(page)


def _tool_calls_html(tc: dict | None, esc) -> str:
    """The page's tool-call section: per input file, and what tokenize kept and refused."""
    if not tc:
        return ""
    rows = "".join(
        f"<tr><td>{esc(f['file'])}</td><td>{f['samples']} ({f['share']:.1%})</td><td>{f['calls']}</td>"
        f"<td>{f['calls_per_sample']:.2f}</td><td>{f['malformed_quarantined']}</td></tr>" for f in tc["files"])
    refused = (f"; {tc['refused_tools_unsupported']} left out: the target's chat template does not render tools"
               if tc["refused_tools_unsupported"] else "")
    return (f"<h2>Tool calls</h2><p>{tc['samples']} tokenized samples call tools ({tc['share']:.1%}){refused}.</p>"
            "<table><tr><th>file</th><th>samples with tool calls (share of kept)</th><th>calls</th>"
            f"<th>calls per such sample</th><th>records quarantined for a malformed call</th></tr>{rows}</table>")


def add_audit_arguments(p: argparse.ArgumentParser) -> None:
    # zero audits is legal (every record quarantined): the gate then says "too few samples"
    p.add_argument("--audits", nargs="*", default=[], help="per-shard audit JSON files")
    p.add_argument("--manifest", required=True)
    p.add_argument("--thresholds", required=True, help="the config's audit section (JSON)")
    p.add_argument("--mode", choices=["full", "prompts"], default="full")
    p.add_argument("--dataset", default="source")
    p.add_argument("--out", required=True)
    p.add_argument("--html", required=True)


def run_audit(args) -> int:
    report = build_report(args.audits, args.manifest, json.loads(args.thresholds), args.mode, args.dataset)
    write_html(report, args.html)
    write_json(args.out, report, indent=None)
    for c in report["checks"]:
        print(f"[{c['status'].upper():4}] {c['check']}: {c['message']}")
    print(f"audit {args.dataset}: {'PASSED' if report['passed'] else 'FAILED'} ({args.html})")
    return 0


def add_gate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--report", required=True)
    p.add_argument("--out", required=True, help="written only when the gate passes")


def run_gate(args) -> int:
    report = read_json(args.report)
    failed = [c for c in report["checks"] if c["status"] == "fail"]
    warned = [c for c in report["checks"] if c["status"] == "warn"]
    for c in warned:
        print(f"audit gate ({report['dataset']}): warning: {c['message']}", file=sys.stderr)
    if failed:
        print(f"\nDATA AUDIT GATE FAILED for the {report['dataset']} data: no GPU stage will run.", file=sys.stderr)
        for c in failed:
            print(f"  - {c['message']} (threshold {c['op']} {c['limit_shown']})", file=sys.stderr)
        print(f"  Full report: {args.report.removesuffix('.json')}.html", file=sys.stderr)
        return 1
    with atomic_open(args.out, "w") as fh:
        fh.write(json.dumps({"dataset": report["dataset"], "samples": report["totals"].get("samples", 0),
                             "warnings": [c["message"] for c in warned]}) + "\n")
    print(f"audit gate ({report['dataset']}): passed")
    return 0
