"""Ingest of the same records as a JSON array and as JSONL, side by side in one run.

    python benchmarks/ingest_json_array.py [--mb 8] [--repeats 3]

The JSON-array reader finds each element with a byte scanner and parses it alone (offsets counted in
bytes, never recomputed by encoding text), so it should cost about what JSONL costs. Short ShareGPT
records, English and Chinese text; the whole stage (read, parse, normalize, hash, write Parquet) is timed.
Prints a table with the array/JSONL ratio of CPU time, runs interleaved.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from dflash_pipeline.data.ingest import ingest_file  # noqa: E402

WORDS = "the model answers each question with a short and clear sentence about data code and time".split()
HANZI = "的一是在不了有和人这中大为上个国我以要他时来用们生到作地于出就分对成会可也你能而说下过学子"


def records(mb: float, chinese: bool, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out, size = [], 0
    while size < mb * 1e6:
        if chinese:
            q, a = "".join(rng.choices(HANZI, k=20)), "".join(rng.choices(HANZI, k=40))
        else:
            q, a = " ".join(rng.choices(WORDS, k=12)), " ".join(rng.choices(WORDS, k=25))
        rec = {"id": str(len(out)), "conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}
        out.append(rec)
        size += len(json.dumps(rec, ensure_ascii=False).encode())
    return out


def once(path: Path, tmp: Path) -> float:
    t0 = time.process_time()  # CPU time: the machine may be shared, wall time would measure the neighbours
    ingest_file(str(path), str(tmp / "r.parquet"), str(tmp / "s.json"), str(tmp / "q.jsonl"))
    return time.process_time() - t0


def timed_pair(a: Path, b: Path, tmp: Path, repeats: int) -> tuple[float, float]:
    """Median CPU seconds of each, runs interleaved (a, b, a, b, ...)."""
    times_a, times_b = [], []
    for _ in range(repeats):
        times_a.append(once(a, tmp))
        times_b.append(once(b, tmp))
    return statistics.median(times_a), statistics.median(times_b)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=8.0)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for label, chinese in (("English", False), ("Chinese", True)):
            recs = records(args.mb, chinese)
            array, jsonl = tmp / "a.json", tmp / "a.jsonl"
            array.write_text(json.dumps(recs, ensure_ascii=False, indent=1), encoding="utf-8")
            jsonl.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs), encoding="utf-8")
            t_jsonl, t_array = timed_pair(jsonl, array, tmp, args.repeats)
            rows.append((label, len(recs), array.stat().st_size / 1e6, t_jsonl, t_array))
    print(f"\n{'text':8} {'records':>8} {'MB':>6} {'JSONL cpu s':>12} {'array cpu s':>12} {'array/JSONL':>12}")
    for label, n, mb, tj, ta in rows:
        print(f"{label:8} {n:>8} {mb:>6.1f} {tj:>12.2f} {ta:>12.2f} {ta / tj:>12.2f}")


if __name__ == "__main__":
    main()
