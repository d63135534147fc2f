"""The shard manifest (the workflow's one checkpoint) and the per-shard writer.

`manifest`: reads every ingested file's sample ids in a fixed order, marks exact duplicates (the first
occurrence wins, across files too) and cuts each file's unique records into shards of `shard_size`.
Shards are named `<source>-<k>`, so a change to one raw file changes only that file's shards.

`shard`: writes one shard from its file's records and its manifest entry.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pyarrow.compute as pc
import pyarrow.parquet as pq

from dflash_pipeline.data.conversations import SAMPLE_SCHEMA
from dflash_pipeline.storage import atomic_path, read_json, write_json

DUPLICATE_EXAMPLES = 200


def _src_of(records_path: str) -> str:
    return Path(records_path).name.removesuffix(".parquet")


def build_manifest(records: list[str], stats: list[str], shard_size: int) -> dict:
    stats_by_src = {Path(s).name.removesuffix(".stats.json"): read_json(s) for s in stats}
    seen: dict[str, tuple[str, int]] = {}
    files, shards, examples = [], [], []
    totals = dict(records_read=0, quarantined=0, duplicates=0, samples=0)
    for path in sorted(records, key=_src_of):
        src = _src_of(path)
        st = stats_by_src[src]
        ids = pq.read_table(path, columns=["sample_id"]).column("sample_id").to_pylist()
        duplicate_rows = []
        for row, sid in enumerate(ids):
            if sid in seen:
                duplicate_rows.append(row)
                if len(examples) < DUPLICATE_EXAMPLES:
                    first_src, first_row = seen[sid]
                    examples.append({"sample_id": sid, "file": st["file"], "row": row,
                                     "first_file": stats_by_src[first_src]["file"], "first_row": first_row})
            else:
                seen[sid] = (src, row)
        dup = set(duplicate_rows)
        unique_rows = [r for r in range(len(ids)) if r not in dup]
        n_shards = 0
        for k, start in enumerate(range(0, len(unique_rows), shard_size)):
            members = unique_rows[start:start + shard_size]
            lo, hi = members[0], members[-1] + 1
            shards.append({
                "shard": f"{src}-{k:05d}",
                "src": src,
                "rows": [lo, hi],
                "drop": [r for r in range(lo, hi) if r in dup],
                "samples": len(members),
            })
            n_shards += 1
        kept = len(unique_rows)
        entry = {
            "src": src,
            "file": st["file"],
            "records_read": st["records_read"],
            "quarantined": st["quarantined"],
            "duplicates": len(duplicate_rows),
            "kept": kept,
            "shards": n_shards,
            "quarantine_reasons": st["quarantine_reasons"],
            "damage": st["damage"],
        }
        # exact accounting, per input file
        assert entry["records_read"] == kept + entry["quarantined"] + entry["duplicates"], entry
        files.append(entry)
        totals["records_read"] += st["records_read"]
        totals["quarantined"] += st["quarantined"]
        totals["duplicates"] += len(duplicate_rows)
        totals["samples"] += kept
    return {"shard_size": shard_size, "totals": totals, "files": files, "shards": shards,
            "duplicate_examples": examples}


def write_shard(records_path: str, spec: dict, out: str) -> int:
    lo, hi = spec["rows"]
    table = pq.read_table(records_path).slice(lo, hi - lo)
    if spec["drop"]:
        keep = [i for i in range(hi - lo) if (lo + i) not in set(spec["drop"])]
        table = table.take(keep)
    if table.num_rows != spec["samples"]:
        raise RuntimeError(f"{records_path}: shard {spec['shard']} expects {spec['samples']} samples, "
                           f"found {table.num_rows}: the manifest is stale, rerun the manifest stage")
    table = table.select(SAMPLE_SCHEMA.names).cast(SAMPLE_SCHEMA)
    if pc.count_distinct(table.column("sample_id")).as_py() != table.num_rows:
        raise RuntimeError(f"shard {spec['shard']}: duplicate sample ids survived deduplication")
    with atomic_path(out) as tmp:
        pq.write_table(table, tmp, compression="zstd")
    return table.num_rows


def add_manifest_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--records", nargs="+", required=True, help="ingested files' records (Parquet)")
    p.add_argument("--stats", nargs="+", required=True, help="ingested files' stats (JSON)")
    p.add_argument("--shard-size", type=int, required=True)
    p.add_argument("--out", required=True)


def run_manifest(args) -> int:
    manifest = build_manifest(args.records, args.stats, args.shard_size)
    write_json(args.out, manifest)
    t = manifest["totals"]
    print(f"{t['records_read']} records read: {t['samples']} kept in {len(manifest['shards'])} shards, "
          f"{t['quarantined']} quarantined, {t['duplicates']} duplicates")
    return 0


def add_shard_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--records", required=True)
    p.add_argument("--spec", required=True, help="the shard's manifest entry (JSON)")
    p.add_argument("--out", required=True)


def run_shard(args) -> int:
    n = write_shard(args.records, json.loads(args.spec), args.out)
    print(f"{args.out}: {n} samples")
    return 0
