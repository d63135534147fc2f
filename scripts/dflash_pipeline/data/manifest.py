"""The shard manifest (the workflow's one checkpoint) and the per-shard writer.

`manifest`: streams every ingested file's sample ids in a fixed order through a bounded-memory deduplicator
(data/dedup.py) that marks exact duplicates (the first occurrence wins, across files too) and cuts each file's
unique records into shards of `shard_size`.
Shards are named `<source>-<k>`, so a change to one raw file changes only that file's shards. Each entry
carries `content`, a digest of its samples' ids (ids are content hashes): the workflow's shard job takes its
entry as its parameter, so a raw file with one record changed rewrites only the shard that holds it.

`shard`: writes one shard from its file's records and its manifest entry.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dflash_pipeline.data.conversations import SAMPLE_SCHEMA, with_sample_columns
from dflash_pipeline.data.dedup import Deduplicator
from dflash_pipeline.errors import PipelineError
from dflash_pipeline.storage import atomic_path, read_json, write_json

DUPLICATE_EXAMPLES = 200


def _src_of(records_path: str) -> str:
    return Path(records_path).name.removesuffix(".parquet")


def _dedup_files(paths: list[str]) -> tuple[np.ndarray, tuple]:
    """Each file's record count, and (positions, first positions, ids) of the duplicates, positions counting
    records across the files in order. Ids stream through the Deduplicator a row group at a time."""
    dedup, sizes = Deduplicator(), []
    for path in paths:
        n = 0
        for batch in pq.ParquetFile(path).iter_batches(columns=["sample_id"], batch_size=65536):
            ids = batch.column(0).to_numpy(zero_copy_only=False).astype(np.bytes_)
            dedup.add(ids)
            n += len(ids)
        sizes.append(n)
    return np.cumsum([0] + sizes), dedup.duplicates()


def _cut_shards(src: str, is_first: np.ndarray, shard_size: int) -> list[dict]:
    unique_rows = np.flatnonzero(is_first)
    shards = []
    for k, begin in enumerate(range(0, len(unique_rows), shard_size)):
        members = unique_rows[begin:begin + shard_size]
        lo, hi = int(members[0]), int(members[-1]) + 1
        shards.append({"shard": f"{src}-{k:05d}", "src": src, "rows": [lo, hi],
                       "drop": (np.flatnonzero(~is_first[lo:hi]) + lo).tolist(), "samples": len(members)})
    return shards


def _add_content_digests(path: str, shards: list[dict]) -> None:
    """Each shard's `content`: sha256 over its kept samples' ids, in order (a second, streaming pass)."""
    if not shards:
        return
    digests = [hashlib.sha256() for _ in shards]
    drops = [set(s["drop"]) for s in shards]
    k, row = 0, 0
    for batch in pq.ParquetFile(path).iter_batches(columns=["sample_id"], batch_size=65536):
        for sid in batch.column(0).to_pylist():
            while k < len(shards) and row >= shards[k]["rows"][1]:
                k += 1
            if k < len(shards) and row >= shards[k]["rows"][0] and row not in drops[k]:
                digests[k].update(sid.encode() + b"\n")
            row += 1
    for shard, digest in zip(shards, digests):
        shard["content"] = digest.hexdigest()[:16]


def _file_entry(src: str, st: dict, duplicates: int, kept: int, n_shards: int) -> dict:
    entry = {"src": src, "file": st["file"], "records_read": st["records_read"], "quarantined": st["quarantined"],
             "decontaminated": st.get("decontaminated", 0), "duplicates": duplicates, "kept": kept, "shards": n_shards,
             "quarantine_reasons": st["quarantine_reasons"], "damage": st["damage"],
             "tool_calls": st.get("tool_calls")}  # tool-calling samples/calls/malformed (None: stats from before)
    if entry["records_read"] != kept + entry["quarantined"] + entry["decontaminated"] + duplicates:  # exact, per file
        raise RuntimeError(f"{st['file']}: accounting broken: {entry}")
    return entry


def build_manifest(records: list[str], stats: list[str], shard_size: int) -> dict:
    stats_by_src = {Path(s).name.removesuffix(".stats.json"): read_json(s) for s in stats}
    missing = sorted(_src_of(p) for p in records if _src_of(p) not in stats_by_src)
    if missing:
        raise PipelineError(f"manifest: no stats file for the records of {', '.join(missing)} (give --stats for each)")
    paths = sorted(records, key=_src_of)
    srcs = [_src_of(p) for p in paths]
    starts, dups = _dedup_files(paths)
    files, shards = [], []
    for i, src in enumerate(srcs):
        lo, hi = int(starts[i]), int(starts[i + 1])
        is_first = np.ones(hi - lo, dtype=bool)
        is_first[dups[0][(dups[0] >= lo) & (dups[0] < hi)] - lo] = False
        own = _cut_shards(src, is_first, shard_size)
        _add_content_digests(paths[i], own)
        kept = int(is_first.sum())
        files.append(_file_entry(src, stats_by_src[src], hi - lo - kept, kept, len(own)))
        shards.extend(own)
    totals = {k: sum(f[k] for f in files) for k in ("records_read", "quarantined", "decontaminated", "duplicates")}
    totals["samples"] = sum(f["kept"] for f in files)
    return {"shard_size": shard_size, "totals": totals, "files": files, "shards": shards,
            "duplicate_examples": _duplicate_examples(dups, starts, srcs, stats_by_src)}


def _duplicate_examples(dups, starts, srcs, stats_by_src) -> list[dict]:
    def where(g: int) -> tuple[str, int]:
        f = int(np.searchsorted(starts, g, side="right")) - 1
        return stats_by_src[srcs[f]]["file"], int(g - starts[f])

    out = []
    for g, first, sid in zip(*(x[:DUPLICATE_EXAMPLES] for x in dups)):
        (file, row), (first_file, first_row) = where(int(g)), where(int(first))
        out.append({"sample_id": sid.decode(), "file": file, "row": row, "first_file": first_file,
                    "first_row": first_row})
    return out


def _read_rows(records_path: str, lo: int, hi: int) -> pa.Table:
    """Rows [lo, hi) of a records file, reading only the row groups that hold them."""
    pf = pq.ParquetFile(records_path)
    sizes = [pf.metadata.row_group(g).num_rows for g in range(pf.num_row_groups)]
    bounds = np.cumsum([0] + sizes)
    groups = [g for g in range(len(sizes)) if bounds[g] < hi and bounds[g + 1] > lo]
    if not groups:
        return pf.schema_arrow.empty_table()
    return pf.read_row_groups(groups).slice(lo - int(bounds[groups[0]]), hi - lo)


def write_shard(records_path: str, spec: dict, out: str) -> int:
    lo, hi = spec["rows"]
    table = _read_rows(records_path, lo, hi)
    if spec["drop"]:
        keep = np.ones(table.num_rows, dtype=bool)
        drop = np.asarray(spec["drop"], dtype=np.int64) - lo
        keep[drop[(drop >= 0) & (drop < len(keep))]] = False
        table = table.filter(pa.array(keep))
    if table.num_rows != spec["samples"]:
        raise PipelineError(f"{records_path}: shard {spec['shard']} expects {spec['samples']} samples, "
                           f"found {table.num_rows}: the manifest is stale, rerun the manifest stage")
    table = with_sample_columns(table).select(SAMPLE_SCHEMA.names).cast(SAMPLE_SCHEMA)  # records from before tools
    if pc.count_distinct(table.column("sample_id")).as_py() != table.num_rows:
        raise PipelineError(f"shard {spec['shard']}: duplicate sample ids survived deduplication: the manifest "
                            f"is stale, rerun the manifest stage")
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
          f"{t['quarantined']} quarantined, {t['duplicates']} duplicates, {t['decontaminated']} evaluation prompts "
          f"left out")
    return 0


def add_shard_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--records", required=True)
    p.add_argument("--spec", help="one shard's manifest entry (JSON)")
    p.add_argument("--out", help="the shard (with --spec)")
    p.add_argument("--specs", help="several shards' manifest entries of one file (JSON list), with --out-dir")
    p.add_argument("--out-dir", help="write SHARD.parquet for each of --specs here")


def run_shard(args) -> int:
    if args.specs and args.out_dir:
        jobs = [(spec, os.path.join(args.out_dir, f"{spec['shard']}.parquet")) for spec in json.loads(args.specs)]
        os.makedirs(args.out_dir, exist_ok=True)
    elif args.spec and args.out:
        jobs = [(json.loads(args.spec), args.out)]
    else:
        raise PipelineError("shard: give --spec and --out, or --specs and --out-dir")
    for spec, out in jobs:
        print(f"{out}: {write_shard(args.records, spec, out)} samples")
    return 0
