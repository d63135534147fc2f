"""The seed-scale benchmark at 1/100 (9,138 conversations in 5 raw files) through the real Snakefile: the
accounting is exact per file (read = kept + quarantined + duplicates, as the generator wrote them) and the
gate fails with the generator's placeholder share. The full-size run is `benchmarks/seed_scale.py`."""

from __future__ import annotations

import importlib.util
import json

import pytest

from conftest import REPO


def load_benchmark():
    spec = importlib.util.spec_from_file_location("seed_scale", REPO / "benchmarks" / "seed_scale.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_one_hundredth_of_the_seed_accounting_is_exact(tmp_path, tiny_target):
    seed = load_benchmark()
    expected = seed.write_corpus(tmp_path / "corpus", round(seed.SEED_SIZE / 100))
    assert sum(f["read"] for f in expected["files"].values()) == 9138
    # the demo tokenizer loads faster than the 248K-token vocabulary; its `Okay.` is 10 supervised tokens
    seed.prepare_workdir(tmp_path, tmp_path / "corpus", {"target": {"model_path": str(tiny_target)},
                                                          "audit": {"trivial_response_tokens": 10}})
    proc, _ = seed.run_snakemake(tmp_path, 2, [])
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "DATA AUDIT GATE FAILED" in out, out[-3000:]
    share = f"{expected['trivial_fraction']:.1%}"
    assert share.startswith("87.") and f"{share} of samples have trivial responses" in out
    assert seed.check_accounting(tmp_path / "results", expected) == []
    manifest = json.loads((tmp_path / "results/ingest/manifest.json").read_text())
    assert len(manifest["shards"]) == 20  # shard_size 512, grouped 32 per job: one shard and one tokenize job per file
    bench = seed.job_benchmarks(tmp_path / "results")
    # every job has its benchmark row; max_rss is Snakemake's sample of the job's memory: a job that ends before
    # its first sample (a short job on a loaded machine: the flake of issue 27) has none ("-" -> None), one sampled
    # as it ended 0.00 (the manifest job, under load); a tokenize job (it loads the tokenizer) is always sampled
    rows = [r for rows in bench.values() for r in rows]
    assert len(bench["tokenize"]) == 5 and all(r["s"] > 0 for r in rows)
    assert all(r["max_rss"] is None or r["max_rss"] >= 0 for r in rows)
    assert all(r["max_rss"] and r["max_rss"] > 50 for r in bench["tokenize"]), bench["tokenize"]
