"""The run's state committed with the repository (benchmarks/recipe_at_scale_state): what the next GPU session
starts from instead of regenerating (~7 device minutes), and the data the peers are compared on. It must be whole
and hold every shard's regenerated ids, each rebuilt on the GPU machine without a mismatch."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import recipe_at_scale as ras  # noqa: E402

STATE = Path(__file__).resolve().parents[1] / "benchmarks" / "recipe_at_scale_state"


def test_the_committed_state_is_whole_and_holds_every_shards_regenerated_turns(tmp_path):
    man = json.loads((STATE / "bundle.tar.zst.set.json").read_text())
    for part in man["parts"]:
        data = (STATE / part["name"]).read_bytes()
        assert len(data) == part["size"] and hashlib.sha256(data).hexdigest() == part["sha256"], part["name"]
    # joined (the whole set's sha256 checked) and unpacked as a cold GPU machine's gather does
    assert ras.join_sets(STATE, tmp_path) == [man["set"]]
    w = ras.Work(tmp_path / "work")
    ras.unpack_bundle(w, tmp_path / man["set"], man)
    assert {k: (w.root / k).stat().st_size for k in man["members"]} == man["members"]
    progress = w.progress()
    assert progress["bundle_seq"] == man["seq"]
    gen = progress["generation"]
    assert gen["shards_done"] == gen["shards_total"] == 16
    turns = failed = 0
    for k in range(16):
        shard = f"sharegpt-{k:05d}"
        meta, samples = ras.read_regen(w.regen / f"{shard}.npz.zst")
        assert meta["shard"] == shard and meta["rebuild_mismatches"] == 0
        assert len(samples) == len(meta["sample_ids"]) and all(t and all(t) for t in samples)
        turns += sum(len(t) for t in samples)
        failed += meta["failed"]
    # every generated turn is a training sample: over the 30,000, as progress.json counted them
    assert turns == progress["tokens"]["samples"] > 30_000
    assert failed < 0.01 * 15_705  # conversations whose prompt outgrew the context (25 on 2026-12-07)
