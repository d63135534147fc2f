"""The plan: numbers, the warning at 27B scale, measured numbers preferred, and the command."""

from __future__ import annotations

import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq

from conftest import run_cli
from dflash_pipeline.planning.plan import make_plan, render, shard_bytes_warning
from dflash_pipeline.planning.projection import (
    RunShape, assumed_calibration, gate_failures, project_generation, render_generation,
)
from dflash_pipeline.report.figures import plan_vs_actual

SHAPE_27B = {"hidden_size": 5120, "num_layers": 64, "active_params": 25e9, "model_type": "qwen3_5"}
IDS_27B = [1, 16, 31, 46, 61]


def _tok(samples, length, loss):
    return {"samples": samples, "tokens": samples * length, "loss_tokens": samples * loss,
            "lengths": [length] * samples, "prompt_lengths": [length - loss] * samples}


def test_27b_scale_says_tens_of_terabytes_and_names_alternatives():
    # 800K samples of 2,000 tokens = 1.6B tokens: the incident's scale
    plan = make_plan(_tok(1000, 2000, 1200), SHAPE_27B, IDS_27B, generate={"enabled": False},
                     tokenize={"max_length": 3072}, extract={"codec": "zstd"}, scale=800)
    assert plan["extract_tokens"] == 1.6e9
    assert plan["hidden_bytes_raw"] == 1.6e9 * 5 * 5120 * 2  # ~82 TB, DESIGN's ~80 TB
    text = render(plan, SHAPE_27B, IDS_27B)
    assert "tens of terabytes" in text and "81.9 TB raw bf16" in text
    for alternative in ("fewer samples", "max_length", "fp8", "online training"):
        assert alternative in text
    assert "GPU-hours" in text
    # training without a measurement: the cost model (ASSUMED), the same rate in the GPU-hours; online adds the
    # target's forward at the extraction rate
    offline = plan["train_tok_s"]
    assert plan["train_tok_s_source"].startswith("ASSUMED") and plan["train_mode"] == "offline"
    assert abs(plan["train_gpu_hours"] - (plan["train_startup_s"] + 1.6e9 * 6 / offline) / 3600) < 1e-6
    online = make_plan(_tok(1000, 2000, 1200), SHAPE_27B, IDS_27B, generate={"enabled": False},
                       tokenize={"max_length": 3072}, extract={"codec": "zstd"}, train={"mode": "online"}, scale=800)
    assert abs(1 / online["train_tok_s"] - (1 / offline + 1 / online["extract_tok_s"])) < 1e-12


def test_generation_bounds_extract_tokens_and_demo_has_no_warning():
    tok = _tok(100, 300, 200)  # prompts of 100 tokens
    plan = make_plan(tok, {"hidden_size": 128, "num_layers": 8, "active_params": 1e6, "model_type": "qwen3"}, [1, 5],
                     generate={"enabled": True, "max_new_tokens": 48}, tokenize={"max_length": 120},
                     extract={"codec": "fp8"})
    assert plan["extract_tokens"] == 100 * 120  # prompt + 48 new tokens, cut at max_length
    assert plan["generate_response_tokens_max"] == 4800
    assert plan["ratio"] == 0.41
    assert "WARNING" not in render(plan, {"hidden_size": 128, "num_layers": 8, "active_params": 1e6,
                                          "model_type": "qwen3"}, [1, 5])


def test_plan_command_uses_measured_stats(tiny_target, tmp_path):
    schema = pa.schema([("length", pa.int32()), ("num_loss_tokens", pa.int32())])
    pq.write_table(pa.table({"length": [100, 200], "num_loss_tokens": [50, 20]}, schema=schema), tmp_path / "a.parquet")
    (tmp_path / "hidden").mkdir()
    (tmp_path / "hidden" / "a.stats.json").write_text(json.dumps(
        {"tokens": 1000, "seconds_extract": 2.0, "stored_bytes": 600, "raw_bf16_bytes": 1000}))
    cfg = {"generate": {"enabled": False}, "tokenize": {"max_length": 150}, "extract": {"codec": "zstd"},
           "drafter": {"num_layers": 2}}
    proc = run_cli("plan", "--tokens", tmp_path / "a.parquet", "--model", tiny_target, "--config", json.dumps(cfg),
                   "--hidden-stats", str(tmp_path / "hidden" / "*.stats.json"), "--out", tmp_path / "plan.txt",
                   "--json", tmp_path / "plan.json")
    assert "PLAN" in proc.stdout and "measured on 1 extracted shard" in proc.stdout
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["extract_tokens"] == 250 and plan["extract_tok_s"] == 500 and plan["ratio"] == 0.6
    assert plan["target_layer_ids"] == [1, 5]
    assert (tmp_path / "plan.txt").read_text() == proc.stdout


# ------------------------------------------------------------------------------------------------------
# generation: the projection from a calibration, the gate, the README example, the report's comparison
# ------------------------------------------------------------------------------------------------------
def _calibration(rate=1000.0, lengths=(100, 300, 500, 700, 900), startup=60.0):
    return {"throughput": {"output_tok_s": rate, "steady_state": True}, "startup_s": startup,
            "output_tokens": {"mean": sum(lengths) / len(lengths), "per_sample_all": list(lengths)},
            "requests": {"samples": len(lengths)}, "window": {"start": "a", "end": "b"},
            "finish_length_rate": 0.2, "failure_rate": 0.0}


def test_generation_projection_from_measured_figures():
    proj = project_generation(_calibration(), RunShape(samples=100_000, jobs=10, parallel_jobs=4, gpus_per_job=2,
                                                       max_new_tokens=1000, gpu_hour_usd=2.0))
    job_s = 10 * 60 + 100_000 * 500 / 1000  # every job's start-up + the tokens at the measured rate
    assert proj["expected_output_tokens"] == 5e7 and proj["output_tok_s_per_gpu"] == 500
    assert abs(proj["wall_hours"] - job_s / 4 / 3600) < 1e-9
    assert abs(proj["gpu_hours"] - job_s * 2 / 3600) < 1e-9 and abs(proj["cost_usd"] - proj["gpu_hours"] * 2) < 1e-9
    slow = proj["sensitivity"]["throughput -25%"]["wall_hours"]
    assert abs(slow - (600 + 5e7 / 750) / 4 / 3600) < 1e-9
    alts = {a["change"].split(":")[0].split(" (")[0]: a for a in proj["alternatives"]}
    assert abs(alts["twice the GPUs"]["wall_hours"] - job_s / 8 / 3600) < 1e-9  # 10 jobs: 8 can run at once
    capped = next(a for a in proj["alternatives"] if "max_new_tokens 1000 -> 500" in a["change"])
    assert "40% of the calibration's answers would be cut" in capped["note"]  # 700 and 900 of the five
    assert abs(capped["wall_hours"] - (600 + 100_000 * 380 / 1000) / 4 / 3600) < 1e-9
    assert gate_failures(proj, max_wall_hours=1.0, max_gpu_hours=None)[0].startswith("projected wall time 3.5 h")
    assert gate_failures(proj, max_wall_hours=None, max_gpu_hours=20) and not gate_failures(proj, 4.0, 30.0)


def test_generation_gate_command_stops_with_the_figures_and_alternatives(tmp_path):
    plan = make_plan(_tok(1000, 300, 200), SHAPE_27B, IDS_27B, generate={"enabled": True, "max_new_tokens": 1000,
                                                                         "gpus": 1, "parallel_jobs": 1},
                     tokenize={"max_length": 3072}, extract={"codec": "zstd"}, calibration=_calibration(), jobs=1)
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    proc = run_cli("generation-gate", "--plan", tmp_path / "plan.json", "--max-wall-hours", "0.01",
                   "--out", tmp_path / "gate.ok", check=False)
    assert proc.returncode == 1 and not (tmp_path / "gate.ok").exists()
    assert "GENERATION GATE: STOP before the full generation (nothing was generated)" in proc.stderr
    assert "exceeds generate.max_wall_hours 0.01" in proc.stderr
    assert "1,000 output tok/s per job" in proc.stderr and "25% fewer samples" in proc.stderr
    run_cli("generation-gate", "--plan", tmp_path / "plan.json", "--max-wall-hours", "1", "--out", tmp_path / "gate.ok")
    assert json.loads((tmp_path / "gate.ok").read_text())["max_wall_hours"] == 1.0
    # the extraction tokens come from the measured answer lengths: prompt 100 + mean 500, not + 1000
    assert plan["extract_tokens"] == 1000 * 600 and plan["extract_tokens_bound"] == 1000 * 1100


def test_readme_example_is_what_the_code_prints(repo_root):
    out = subprocess.run([sys.executable, str(repo_root / "benchmarks/plan_example_27b.py")], capture_output=True,
                         text=True, check=True).stdout
    readme = (repo_root / "docs" / "generation.md").read_text()  # the README links the example there
    prefixes = ("  generate", "    ", "  extract", "  train", "GENERATION GATE")
    shown = [line for line in out.splitlines() if line.startswith(prefixes)]
    assert "16.5 days" in out and len(shown) > 10
    missing = [line for line in shown if line not in readme and not line.startswith("    - ")]  # warning list
    assert not missing, missing


def test_report_compares_calibration_and_plan_with_the_run(tmp_path):
    cal = _calibration()
    plan = {"generation": {"expected_output_tokens": 1000, "job_hours": 0.5}, "extract_tokens": 2000,
            "hidden_bytes": 4000, "extract_tok_s": 100, "extract_gpu_hours": 0.01}
    for name, obj in (("plan.json", plan), ("cal.json", cal),
                      ("a.summary.json", {"samples": 2, "ok": 2, "completion_tokens": 1100, "finish_reason_length": 1,
                                          "calibration": {"live_output_tok_s": 900.0}}),
                      ("a.stats.json", {"tokens": 2200, "seconds": 20, "stored_bytes": 4400})):
        (tmp_path / name).write_text(json.dumps(obj))
    rows = plan_vs_actual(str(tmp_path / "plan.json"), str(tmp_path / "cal.json"), [str(tmp_path / "a.summary.json")],
                          [str(tmp_path / "a.stats.json")], None)
    by = {(r[0], r[1]): r[2:5] for r in rows}  # planned, actual, ratio (then a note)
    assert by[("generation", "output tok/s per job (start-up excluded)")] == [1000.0, 900.0, 0.9]
    assert by[("generation", "output tokens (whole corpus)")] == [1000, 1100, 1.1]
    assert by[("generation", "finish_reason=length rate")] == [0.2, 0.5, 2.5]
    assert by[("extraction", "tokens")] == [2000, 2200, 1.1] and by[("extraction", "tok/s")] == [100, 110.0, 1.1]
    bench = tmp_path / "benchmarks"
    for stage, seconds in (("extract", 72.0), ("train", 180.0), ("evaluate", 36.0)):
        (bench / stage).mkdir(parents=True)
        (bench / stage / "x.tsv").write_text(f"s\th:m:s\n{seconds}\t0:01:00\n")
    plan.update({"extract_gpu_hours": 0.02, "train_gpu_hours": 0.04})
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    rows = plan_vs_actual(str(tmp_path / "plan.json"), None, [], [str(tmp_path / "a.stats.json")], str(bench))
    by = {(r[0], r[1]): r[2:6] for r in rows}  # per stage: the plan's job time against the benchmark files
    assert by[("extraction", "job-hours (Snakemake benchmarks)")][:3] == [0.02, 0.02, 1.0]
    assert by[("training", "job-hours (Snakemake benchmarks)")][:3] == [0.04, 0.05, 1.25]
    assert by[("evaluation", "job-hours (Snakemake benchmarks)")] == [None, 0.01, None, "not projected by the plan"]
    run_cli("report-figures", "--generation", tmp_path / "a.summary.json", "--extraction", tmp_path / "a.stats.json",
            "--plan", tmp_path / "plan.json", "--calibration", tmp_path / "cal.json", "--out-dir", tmp_path / "report")
    page = (tmp_path / "report" / "summary.html").read_text()
    assert "calibration and plan vs actual" in page and "<td>output tok/s per job (start-up excluded)</td>" in page
    assert "generation calibration" in page.lower()


def test_shard_size_by_bytes_and_assumed_generation():
    """The schema's old default, 4,096 samples per shard, is ~230 GB of hidden states per shard for an 8B target:
    the plan says so and names the shard size that fits; the cost preview prices generation from ASSUMED figures."""
    shape_8b = {"hidden_size": 4096, "num_layers": 36, "active_params": 7.57e9, "model_type": "qwen3"}
    ids = [1, 9, 17, 25, 33]
    tok = _tok(4096, 2000, 1200)  # one shard of 4,096 samples of 2,000 tokens
    generate = {"enabled": True, "max_new_tokens": 4096, "gpus": 8, "assumed": {"output_tok_s_per_gpu": 750,
                                                                                "mean_output_tokens": 2500}}
    cal = assumed_calibration(generate)
    plan = make_plan(tok, shape_8b, ids, generate=generate, tokenize={"max_length": 3072}, extract={"codec": "zstd"},
                     calibration=cal, scale=10)
    (blank, line) = shard_bytes_warning(plan, 10, 64e9)
    per_shard = plan["hidden_bytes"] / 10
    assert per_shard > 200e9, per_shard  # 4,096 x (800 + 2,500 tokens, cut at 3,072) x 40 KiB x 0.69: ~356 GB
    assert f"{4096 * 64e9 / per_shard:,.0f}"[:3] in line and "ingest.shard_size to about" in line, line
    assert shard_bytes_warning(plan, 10 * 8, 64e9) == []  # 512 per shard: under the limit
    text = "\n".join(render_generation(plan["generation"]))
    assert "projected from ASSUMED figures (750 output tok/s per GPU, 2,500 output tokens per sample" in text, text
    assert plan["generation"]["output_tok_s_per_job"] == 6000 and "finish_reason" not in text
    # without a mean: max_new_tokens, said to be a bound
    assert "(max_new_tokens: an upper bound)" in assumed_calibration({**generate, "assumed": {}})["assumed_basis"]
