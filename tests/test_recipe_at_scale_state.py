"""The run's state committed with the repository (benchmarks/recipe_at_scale_state): what the next GPU session
starts from instead of regenerating (~7 device minutes), and the data the peers are compared on. It must be whole
and hold every shard's regenerated ids, each rebuilt on the GPU machine without a mismatch."""

from __future__ import annotations

import hashlib
import io
import json
import sys
import tarfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import recipe_at_scale as ras  # noqa: E402

STATE = Path(__file__).resolve().parents[1] / "benchmarks" / "recipe_at_scale_state"


def test_the_committed_state_is_whole_and_holds_every_shards_regenerated_turns(tmp_path):
    man = json.loads((STATE / "bundle.tar.zst.set.json").read_text())
    blob = b""
    for part in man["parts"]:
        data = (STATE / part["name"]).read_bytes()
        assert len(data) == part["size"] and hashlib.sha256(data).hexdigest() == part["sha256"], part["name"]
        blob += data
    assert hashlib.sha256(blob).hexdigest() == man["sha256"]
    with tarfile.open(fileobj=io.BytesIO(ras.unzstd_bytes(blob))) as tar:
        members = {ti.name: tar.extractfile(ti).read() for ti in tar.getmembers()}
    assert {k: len(v) for k, v in members.items()} == man["members"]
    progress = json.loads(members["progress.json"])
    assert progress["bundle_seq"] == man["seq"]
    gen = progress["generation"]
    assert gen["shards_done"] == gen["shards_total"] == 16
    turns = failed = 0
    for k in range(16):
        shard = f"sharegpt-{k:05d}"
        (tmp_path / f"{shard}.npz.zst").write_bytes(members[f"regen/{shard}.npz.zst"])
        meta, samples = ras.read_regen(tmp_path / f"{shard}.npz.zst")
        assert meta["shard"] == shard and meta["rebuild_mismatches"] == 0
        assert len(samples) == len(meta["sample_ids"]) and all(t and all(t) for t in samples)
        turns += sum(len(t) for t in samples)
        failed += meta["failed"]
    # every generated turn is a training sample: over the 30,000, as progress.json counted them
    assert turns == progress["tokens"]["samples"] > 30_000
    assert failed < 0.01 * 15_705  # conversations whose prompt outgrew the context (25 on 2026-12-07)
