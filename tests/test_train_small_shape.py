"""benchmarks/train_small_shape.py (the GPU training-speed benchmark) runs on CPU with --tiny through the train
stage's own settings (parsed by the stage's parser) and TrainingRun. Its GPU-only paths (compile) are not reached
here: on 2026-12-07 it failed every variant on an H100 with hand-built settings that lacked `attention`, and
reported it with exit 0; it now takes the stage's settings and exits 1 when no variant ran."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_tiny_packed_and_padded_give_one_loss(tmp_path):
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'scripts'}{os.pathsep}{ROOT / 'benchmarks'}"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "train_small_shape.py"), "--tiny",
                           "--variants", "packed+b4,padded+b4", "--steps", "1", "--warmup", "1",
                           "--profile-steps", "0", "--samples", "8", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "train_small_shape.json").read_text())["rows"]
    assert [r["variant"] for r in rows] == ["packed+b4", "padded+b4"]
    assert all(math.isfinite(r["loss"]) and r["positions_per_s"] > 0 for r in rows)
    # the same samples and anchors through both layouts: the same loss (the layout is a speed choice only)
    assert math.isclose(rows[0]["loss"], rows[1]["loss"], rel_tol=1e-4)


def test_every_variant_failing_is_a_failed_run(tmp_path):
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'scripts'}{os.pathsep}{ROOT / 'benchmarks'}"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "train_small_shape.py"), "--tiny",
                           "--variants", "padded+b0", "--steps", "1", "--warmup", "1", "--profile-steps", "0",
                           "--samples", "8", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600,
                          env=env)
    assert proc.returncode == 1 and "no variant ran" in proc.stdout, proc.stdout[-2000:]
