"""results/report/summary.html is read by people: the figures are embedded (the page stands alone), every
number carries its unit, no cell holds a Python repr, and plan-vs-actual ratios compare like with like."""

from __future__ import annotations

import base64
import json
import re
from html.parser import HTMLParser

from conftest import run_cli

from dflash_pipeline.report import units

PLAN_SCALED = "scaled by parameter count from 28700 tok/s measured on one H200 for a Qwen3-8B-shaped target"


class Page(HTMLParser):
    """The images' sources and the text of every table cell, by row."""

    def __init__(self):
        super().__init__()
        self.images, self.rows, self._cell = [], [], None

    def handle_starttag(self, tag, attrs):
        if tag == "img":
            self.images.append(dict(attrs)["src"])
        elif tag == "tr":
            self.rows.append([])
        elif tag in ("td", "th"):
            self._cell = ""

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self.rows[-1].append(self._cell.strip())
            self._cell = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell += data


def _run(tmp_path, device: str) -> Page:
    tmp_path.mkdir(parents=True, exist_ok=True)
    files = {
        "plan.json": {"generation": {"expected_output_tokens": 1000, "job_hours": 0.5}, "extract_tokens": 2000,
                      "hidden_bytes": 4.1e6, "extract_tok_s": 3.4e6, "extract_tok_s_source": PLAN_SCALED,
                      "extract_gpu_hours": 1.6e-7, "train_gpu_hours": 2.5e-6},
        "cal.json": {"throughput": {"output_tok_s": 181.3, "per_gpu_output_tok_s": None, "basis": "whole window"},
                     "startup_s": 26.0, "window": {"seconds": 1.4},
                     "output_tokens": {"mean": 15.5, "p50": 16, "p90": 16, "p99": 16, "max": 16},
                     "latency_s": {"p50": 1.2, "p90": 1.4, "p99": 1.4, "max": 1.4},
                     "requests": {"samples": 16, "ok": 16, "failed": 0, "workers": 16},
                     "finish_length_rate": 0.9375, "failure_rate": 0.0},
        "a.summary.json": {"samples": 32, "ok": 31, "failed": 1, "completion_tokens": 480, "prompt_tokens": 900,
                           "finish_reason_length": 30, "failure_reasons": {"prompt too long": 1},
                           "calibration": {"live_output_tok_s": 170.0}, "this_run": {"completion_tokens_per_s": 160}},
        "a.stats.json": {"tokens": 2200, "seconds": 4.0, "stored_bytes": 3_900_000, "raw_bf16_bytes": 5_600_000,
                         "file_bytes": 3_910_000, "samples": 31, "codec": "zstd", "device": device,
                         "tokens_per_s": 550.0},
        "report.json": {"passed": True, "block_size": 16, "target_layer_ids": [1, 2], "reasons": [],
                        "trained": {"tau": 9.877551020408163}, "untrained": {"tau": 1.0},
                        "temperatures": {"0": {"untrained": 1.0, "trained": 9.877551020408163},
                                         "0.7": {"untrained": 1.0101, "trained": 4.05}},
                        "prompts": {"count": 16}},
    }
    for name, obj in files.items():
        (tmp_path / name).write_text(json.dumps(obj))
    from dflash_pipeline.drafter.evaluate import plot_acceptance  # the evaluate stage's plot, beside its report

    curve = {"tau": 9.9, "acceptance_per_position": [None] + [0.9 - 0.05 * k for k in range(15)]}
    plot_acceptance({"trained": curve}, {"0.7": {"trained": dict(curve, tau=4.1)}}, tmp_path / "acceptance.png")
    (tmp_path / "drafter").mkdir()
    (tmp_path / "drafter" / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "loss": 3.0 / s, "accuracy": 0.1 * s, "lr": 1e-3, "tokens_per_s": 812.5,
                    **({"heldout_tau": 1.0 + s / 4, "heldout_stopped_improving": False} if s % 2 else {})}) + "\n"
        for s in range(1, 6)))
    for stage, secs in (("extract", 11.58), ("train", 93.0), ("generate", 9.62)):
        (tmp_path / "benchmarks" / stage).mkdir(parents=True)
        (tmp_path / "benchmarks" / stage / "a.tsv").write_text(f"s\th:m:s\n{secs}\t0:00:{secs}\n")
    run_cli("report-figures", "--generation", tmp_path / "a.summary.json", "--extraction", tmp_path / "a.stats.json",
            "--train", tmp_path / "drafter", "--evaluate", tmp_path / "report.json", "--benchmarks",
            tmp_path / "benchmarks", "--plan", tmp_path / "plan.json", "--calibration", tmp_path / "cal.json",
            "--out-dir", tmp_path / "report")
    page = Page()
    page.feed((tmp_path / "report" / "summary.html").read_text())
    return page


def test_summary_embeds_its_figures_and_formats_every_number(tmp_path):
    page = _run(tmp_path, "cpu")
    assert len(page.images) == 5  # tau, the acceptance curve, generation, extraction, training
    for src in page.images:
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1])[:8] == b"\x89PNG\r\n\x1a\n"
    cells = [c for row in page.rows for c in row]
    reprs = [c for c in cells if re.search(r"[{}\[\]]|\bTrue\b|\bFalse\b|\bNone\b|\d\.\d{8}", c)]
    assert not reprs, reprs
    rows = {r[0]: r[1:] for r in page.rows if len(r) == 2}
    assert rows["generated tokens"] == ["480 tokens"] and rows["failure reasons"] == ["prompt too long: 1"]
    assert rows["hidden states stored"] == ["3.90 MB"] and rows["stored / raw bf16"] == ["0.696x"]
    assert rows["throughput, end to end"] == ["550 tok/s"] and rows["final block accuracy"] == ["50%"]
    assert rows["held-out acceptance, last / best (simulated tau)"] == ["2.25 / 2.25"]
    assert rows["held-out acceptance stopped improving"] == ["no"]
    assert rows["tau, trained drafter"] == ["9.878 tokens per target forward"] and rows["trained / untrained"] == ["9.88x"]
    assert rows["evaluation gate passed"] == ["yes"] and rows["target layer ids"] == ["1, 2"]
    assert rows["cut at max_new_tokens"] == ["93.8%"]
    stage_rows = {r[0]: r[1:] for r in page.rows if len(r) == 4}
    assert stage_rows["train"] == ["1", "1 min 33 s", "1 min 33 s"]


def test_plan_vs_actual_compares_like_with_like(tmp_path):
    versus = {(r[0], r[1]): r[2:] for r in _run(tmp_path / "cpu", "cpu").rows if len(r) == 5}
    assert versus[("generation", "output tok/s per job (start-up excluded)")] == ["181 tok/s", "170 tok/s", "0.938x"]
    assert versus[("extraction", "tokens")] == ["2,000 tokens", "2,200 tokens", "1.1x"]
    # the plan's extraction and training rates are a GPU's: on CPU the ratio would only say "CPU is slow"
    for key in (("extraction", "tok/s"), ("extraction", "GPU-hours (job-hours x GPUs per job)"),
                ("training", "GPU-hours (job-hours x GPUs per job)")):
        assert versus[key][2].startswith("not comparable"), versus[key]
    assert versus[("extraction", "tok/s")][:2] == ["3,400,000 tok/s", "550 tok/s"]
    on_gpu = {(r[0], r[1]): r[2:] for r in _run(tmp_path / "gpu", "NVIDIA H200").rows if len(r) == 5}
    assert on_gpu[("extraction", "tok/s")][2] == f"{550 / 3.4e6:.3g}x"
    assert on_gpu[("training", "GPU-hours (job-hours x GPUs per job)")][1] == "0.0258 GPU-hours"
    assert versus[("generation", "mean output tokens per sample")][:2] == ["15.5 tokens", "15.0 tokens"]


def test_units():
    assert units.nbytes(230e9) == "230.00 GB" and units.nbytes(512) == "512 B"
    assert units.seconds(11.58) == "12 s" and units.seconds(9.62) == "9.62 s" and units.seconds(3725) == "1 h 02 min"
    assert units.tok_s(73760.4) == "73,760 tok/s" and units.tok_s(0.5) == "0.5 tok/s"
    assert units.hours(2.5e-6, "GPU-hours") == "0.009 GPU-seconds" and units.hours(0.5, "job-hours") == "0.5 job-hours"
    assert units.percent(0.5) == "50%" and units.ratio(1.153) == "1.15x" and units.listing({}) == "–"


def test_the_summary_leads_with_tau_greedy_and_sampled_then_cost_then_data(tmp_path):
    """Issue 27: tau came last (~2,400 px down), greedy only, without the acceptance curve; one row mixed units."""
    _run(tmp_path, "cpu")
    text = (tmp_path / "report" / "summary.html").read_text()
    headings = re.findall(r"<h2>(.*?)</h2>", text)
    assert headings[0] == "Result: acceptance length (tau)" and headings[1].startswith("Cost:"), headings
    assert all(h.startswith("Data:") for h in headings[3:]), headings
    first = text.split("<h2>", 2)[1]  # the result's section: both temperatures and two figures
    page = Page()
    page.feed(first)
    rows = {r[0]: r[1:] for r in page.rows if len(r) == 4}
    assert rows["greedy (T=0)"] == ["9.878", "1", "9.88x"]
    assert rows["sampled, T=0.7 (speculative sampling)"] == ["4.05", "1.01", "4.01x"]
    assert len(page.images) == 2
    page = Page()
    page.feed(text)
    for r in page.rows:  # one unit per row of plan vs actual
        if len(r) == 5 and "hours" in r[1]:
            units_used = {c.split()[-1] for c in r[2:4] if c != units.NONE}
            assert len(units_used) == 1, r
