"""The peers' steady training rates, read from their own logs (benchmarks/real_target_side_by_side.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import real_target_side_by_side as sbs  # noqa: E402

MANIFEST = {"samples": 100, "tokens": 50_000}  # 500 tokens a sample


def _specforge_log(out: Path, lines: list[dict], batch: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_specforge.log").write_text("".join(f"step {i}: {d!r}\n" for i, d in enumerate(lines)))
    (out / "specforge_run.json").write_text(json.dumps({"batch_size": batch, "steps": len(lines)}))


def test_specforge_rate_counts_every_sample_of_a_batch(tmp_path):
    # its log as SpecForge 0.2.0's controller writes the perf window: step time per optimizer step of 16 samples
    steps = [{"loss": 1.0, "perf/optimizer_step_time_s": t} for t in (9.0, 9.0, 9.0, 0.2, 0.25, 0.2, 0.2, 0.25)]
    _specforge_log(tmp_path, steps, batch=16)
    rate = sbs.steady_rate("specforge", tmp_path, {"_manifest": MANIFEST})
    assert rate == 16 * 500 / 0.2  # warm-up windows dropped, median of the rest


def test_specforge_rate_prefers_its_logged_samples_per_second(tmp_path):
    steps = [{"perf/optimizer_step_time_s": 1.0, "perf/global_samples_per_second": s} for s in (1, 1, 1, 30, 32, 34)]
    _specforge_log(tmp_path, steps, batch=4)
    assert sbs.steady_rate("specforge", tmp_path, {"_manifest": MANIFEST}) == 32 * 500


def test_a_peer_without_a_log_has_no_rate(tmp_path):
    assert sbs.steady_rate("speculators", tmp_path, {}) is None
