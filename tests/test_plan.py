"""The plan: numbers, the warning at 27B scale, measured numbers preferred, and the command."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq

from conftest import run_cli
from dflash_pipeline.planning.plan import make_plan, render

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
