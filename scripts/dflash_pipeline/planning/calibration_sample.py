"""`dflash-pipeline calibrate-sample`: the prompts a generation calibration sends, drawn from the real corpus.

A stratified sample: the corpus's prompts are sorted by length (from the source token files: `length -
num_loss_tokens`, the tokens that are not an answer) and cut into `samples` strata of equal count; one prompt
is drawn from each stratum, from the shard drawn least so far. So the sample covers the prompt-length
distribution quantile by quantile (equal-count strata make it self-weighting: its plain mean estimates the
corpus mean) and spreads over the shards. A few extra prompts from the rest are the warm-up: sent first and
left out of every measurement.

Draws go by a hash of the sample id and the seed (as the held-out split does), not by a random stream: a
change to a few records moves few picks, so a redrawn sample is mostly the old one. The shards drawn from
are recorded in the file (`drawn_from`): the workflow keeps drawing from the same shards while they all exist
and the sample met its size, so adding data keeps the sample and its calibration.

Writes one Parquet file: the ingested rows (SAMPLE_SCHEMA) of the chosen samples plus `shard`, `stratum`,
`prompt_tokens_est` and `phase` (warmup | measure); the corpus's size and prompt-length quantiles go into
the file's metadata (key `calibration_sample`), so the calibration can state how representative it is.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from collections import defaultdict
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from dflash_pipeline import storage
from dflash_pipeline.data.conversations import SAMPLE_SCHEMA
from dflash_pipeline.errors import PipelineError

SAMPLE_FILE_SCHEMA = pa.schema(list(SAMPLE_SCHEMA) + [
    ("shard", pa.string()), ("stratum", pa.int32()), ("prompt_tokens_est", pa.int64()), ("phase", pa.string()),
])
METADATA_KEY = b"calibration_sample"


def shard_name(path: str) -> str:
    return Path(str(path).rstrip("/")).name.removesuffix(".parquet")


def read_prompt_lengths(token_files: list[str]) -> list[tuple[str, str, int]]:
    """(shard, sample_id, prompt tokens) of every sample, from the source token files' small columns."""
    out = []
    for path in token_files:
        with storage.open_binary(path) as fh:
            try:
                t = pq.read_table(fh, columns=["sample_id", "length", "num_loss_tokens"])
            except (pa.ArrowInvalid, KeyError) as exc:
                raise PipelineError(f"{path}: not a token file (sample_id, length, num_loss_tokens): {exc}") from None
        name = shard_name(path)
        ids = t.column("sample_id").to_pylist()
        lengths = t.column("length").to_pylist()
        loss = t.column("num_loss_tokens").to_pylist()
        out.extend((name, sid, int(n - m)) for sid, n, m in zip(ids, lengths, loss))
    return out


def draw_key(sample_id: str, seed: int) -> bytes:
    """The order in which samples are drawn: a hash of the id, fixed by the seed."""
    return hashlib.sha256(f"dflash-calibration:{seed}:{sample_id}".encode()).digest()


def stratified(population: list[tuple[str, str, int]], samples: int, warmup: int, seed: int):
    """(measured, warm-up) lists of (shard, sample_id, prompt_len, stratum) drawn from `population`."""
    if not population:
        raise PipelineError("calibration: the corpus has no samples")
    keys = [draw_key(p[1], seed) for p in population]
    order = sorted(range(len(population)), key=lambda i: (population[i][2], keys[i]))
    n = min(samples, len(order))
    used: dict[str, int] = defaultdict(int)
    chosen: list[int] = []
    for k in range(n):
        stratum = order[k * len(order) // n:(k + 1) * len(order) // n]
        fewest = min(used[population[i][0]] for i in stratum)
        pick = min((i for i in stratum if used[population[i][0]] == fewest), key=keys.__getitem__)
        used[population[pick][0]] += 1
        chosen.append(pick)
    strata = {i: k for k, i in enumerate(chosen)}
    rest = sorted(set(range(len(population))) - set(chosen), key=keys.__getitem__)
    warm = rest[:warmup]
    pick = lambda idx, stratum: (*population[idx], stratum)  # noqa: E731
    return [pick(i, strata[i]) for i in chosen], [pick(i, -1) for i in warm]


def quantiles(values: list[int], qs=(0.1, 0.25, 0.5, 0.75, 0.9, 0.99)) -> dict[str, float]:
    if not values:
        return {}
    s = sorted(values)
    return {f"p{round(q * 100)}": float(s[min(len(s) - 1, int(q * len(s)))]) for q in qs} | {
        "mean": sum(s) / len(s), "max": float(s[-1])}


def read_rows(shard_files: dict[str, str], wanted: dict[str, set[str]]) -> dict[str, dict]:
    """sample_id -> ingested row, reading only the shards that hold a wanted sample."""
    rows = {}
    for shard, ids in wanted.items():
        if shard not in shard_files:
            raise PipelineError(f"calibration: token file of shard {shard!r} has no ingested shard among --shards")
        with storage.open_binary(shard_files[shard]) as fh:
            table = pq.read_table(fh, columns=["sample_id", "source", "source_id", "messages"])
        sids = table.column("sample_id").to_pylist()
        take = [i for i, s in enumerate(sids) if s in ids]
        for row in table.take(take).to_pylist():
            rows[row["sample_id"]] = row
        missing = ids - {sids[i] for i in take}
        if missing:
            raise PipelineError(f"{shard_files[shard]}: samples {sorted(missing)[:3]} of its token file are missing "
                                "(token files and shards out of step)")
    return rows


def build(token_files: list[str], shard_files: list[str], samples: int, warmup: int, seed: int):
    """The sample table and the corpus description that goes into its metadata."""
    population = read_prompt_lengths(token_files)
    measured, warm = stratified(population, samples, warmup, seed)
    wanted: dict[str, set[str]] = defaultdict(set)
    for shard, sid, _, _ in measured + warm:
        wanted[shard].add(sid)
    rows = read_rows({shard_name(p): p for p in shard_files}, wanted)
    records = [{**rows[sid], "shard": shard, "stratum": stratum, "prompt_tokens_est": plen, "phase": phase}
               for phase, picks in (("warmup", warm), ("measure", measured)) for shard, sid, plen, stratum in picks]
    corpus = {
        "samples": len(population), "shards": len({p[0] for p in population}),
        "prompt_tokens_est": quantiles([p[2] for p in population]),
        "sample_prompt_tokens_est": quantiles([p[2] for p in measured]),
        "sample_shards": len({p[0] for p in measured}), "measured": len(measured), "warmup": len(warm),
        "seed": seed, "method": "equal-count prompt-length strata, one draw each (by a hash of the sample id), "
                                "from the least-drawn shard",
        "drawn_from": sorted({shard_name(p) for p in token_files}),
        "settings": {"samples": samples, "warmup_requests": warmup, "seed": seed},
    }
    table = pa.Table.from_pylist(records, schema=SAMPLE_FILE_SCHEMA)
    return table.replace_schema_metadata({METADATA_KEY: json.dumps(corpus).encode()}), corpus


def read_sample(path: str) -> tuple[list[dict], list[dict], dict]:
    """(warm-up rows, measured rows, corpus description) of a calibration sample file."""
    with storage.open_binary(path) as fh:
        table = pq.read_table(fh)
    meta = (table.schema.metadata or {}).get(METADATA_KEY)
    if meta is None or "phase" not in table.column_names:
        raise PipelineError(f"{path}: not a calibration sample (written by `dflash-pipeline calibrate-sample`)")
    rows = table.to_pylist()
    return ([r for r in rows if r["phase"] == "warmup"], [r for r in rows if r["phase"] == "measure"],
            json.loads(meta))


def drawn_from(path: str) -> dict | None:
    """What a sample file was drawn from ({shards, settings, full}), or None (no readable sample there)."""
    try:
        meta = (pq.read_schema(path).metadata or {}).get(METADATA_KEY)
        corpus = json.loads(meta) if meta else {}
    except (OSError, ValueError, pa.ArrowException):
        return None
    if "drawn_from" not in corpus:
        return None
    full = corpus["measured"] == corpus["settings"]["samples"]
    return {"shards": corpus["drawn_from"], "settings": corpus["settings"], "full": full}


def settings_of(generate: dict) -> dict:
    """The config's generate.calibrate settings that decide the draw (what drawn_from's `settings` records)."""
    return {k: generate["calibrate"][k] for k in ("samples", "warmup_requests", "seed")}


def shards_to_draw(drawn: dict | None, settings: dict, current: list[str]) -> list[str]:
    """The shards a calibration sample is drawn from: those of the sample already drawn (`drawn`: drawn_from's
    answer) while they all still exist and it met its size with the same settings, so that added data keeps the
    sample and the calibration; else every shard."""
    if drawn and drawn["settings"] == settings and drawn["full"] and set(drawn["shards"]) <= set(current):
        return drawn["shards"]
    return current


def sample_identity(source) -> str:
    """A digest of which prompts a sample file (a path or an open binary file) holds, in which phase (sample ids
    are content hashes)."""
    table = pq.read_table(source, columns=["sample_id", "phase"])
    pairs = sorted(zip(table.column("phase").to_pylist(), table.column("sample_id").to_pylist()))
    return hashlib.sha256(json.dumps(pairs).encode()).hexdigest()[:16]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", nargs="+", required=True, help="source token files (prompt lengths)")
    p.add_argument("--shards", nargs="+", required=True, help="the ingested shards (the prompts themselves)")
    p.add_argument("--samples", type=int, help="measured prompts (config generate.calibrate.samples)")
    p.add_argument("--warmup", type=int, help="extra prompts sent first and not measured")
    p.add_argument("--seed", type=int)
    p.add_argument("--out", required=True, help="the sample (Parquet)")


def run(args) -> int:
    if args.samples < 1:
        raise PipelineError("--samples must be at least 1")
    table, corpus = build(args.tokens, args.shards, args.samples, args.warmup, args.seed)
    with storage.atomic_path(args.out, suffix=".parquet") as tmp:
        pq.write_table(table, tmp, compression="zstd")
    print(f"calibration sample: {corpus['measured']} prompts (+{corpus['warmup']} warm-up) from "
          f"{corpus['sample_shards']} of {corpus['shards']} shards, {corpus['samples']:,} samples in the corpus; "
          f"median prompt {corpus['sample_prompt_tokens_est'].get('p50', 0):.0f} tokens "
          f"(corpus {corpus['prompt_tokens_est'].get('p50', 0):.0f})")
    return 0
