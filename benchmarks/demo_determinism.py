"""Which stage of two demo runs differs: `python benchmarks/demo_determinism.py RUN_A RUN_B` compares, stage by
stage, what two run directories wrote (by content, not bytes: Parquet and .dfhs files carry write metadata) and
prints one row per stage, then the tau of each. Two clean `make demo` runs of one commit on one machine should
agree everywhere (issue 27: the README's tau did not reproduce)."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path


def _digest(paths) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:12]


def _parquet(run: Path, pattern: str, columns: list[str]) -> str:
    import pyarrow.parquet as pq

    h = hashlib.sha256()
    for p in sorted(run.glob(pattern)):
        rows = pq.read_table(p).to_pylist()
        for r in sorted(rows, key=lambda r: str(r.get("sample_id"))):
            h.update(json.dumps({c: r.get(c) for c in columns}, sort_keys=True, default=str).encode())
    return h.hexdigest()[:12]


def _hidden(run: Path) -> str:
    import torch

    from dflash_pipeline.hidden_states.reader import HiddenStateShardReader

    h = hashlib.sha256()
    for p in sorted(run.glob("results/hidden/groups/*/*.dfhs"), key=lambda p: p.name):  # shard order
        r = HiddenStateShardReader(p)
        for i, sid in enumerate(r.sample_ids):
            h.update(sid.encode())
            for k, v in sorted(r.read(i).items()):
                if torch.is_tensor(v):
                    h.update(v.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        r.close()
    return h.hexdigest()[:12]


def stages(run: Path) -> dict[str, str]:
    return {
        "demo data": _digest(sorted(run.glob("data/demo/*"))),
        "demo target weights": _digest([run / "resources/demo-target/model.safetensors"]),
        "ingested records": _parquet(run, "results/ingest/files/*.parquet", ["sample_id", "messages"]),
        "completions (output_ids)": _parquet(run, "results/completions/*.parquet", ["sample_id", "output_ids"]),
        "regenerated tokens": _parquet(run, "results/tokens/regenerated/*.parquet", ["sample_id", "input_ids"]),
        "hidden states (values)": _hidden(run),
        "trained drafter weights": _digest([run / "results/train/drafter/drafter.safetensors"]),
        "exported drafter": _digest([run / "results/drafter/model.safetensors"]),
    }


def main() -> int:
    a, b = map(Path, sys.argv[1:3])
    sa, sb = stages(a), stages(b)
    print(f"{'stage':<28} {'run A':<14} {'run B':<14} same")
    for k in sa:
        print(f"{k:<28} {sa[k]:<14} {sb[k]:<14} {'yes' if sa[k] == sb[k] else 'NO'}")
    for run in (a, b):
        rep = json.loads((run / "results/evaluate/report.json").read_text())
        print(run, {t: round(v["trained"], 3) for t, v in rep["temperatures"].items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
