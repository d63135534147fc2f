"""Ingest: every record read is kept or quarantined with a reason; damage is named by file and offset."""

from __future__ import annotations

import gzip
import json
import tracemalloc
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import zstandard

from conftest import run_cli
from dflash_pipeline.errors import CorruptInputError
from dflash_pipeline.data.ingest import ReadResult, ingest_file, iter_raw_records
from dflash_pipeline.data.manifest import build_manifest, write_shard


def conv(i: int, answer: str = "Fine.") -> dict:
    return {"id": f"r{i}", "conversations": [{"from": "human", "value": f"Question {i}?"}, {"from": "gpt", "value": answer}]}


def ingest(path: Path, tmp: Path, **kw) -> tuple[dict, list[dict], list[dict]]:
    out = tmp / (path.name + ".out")
    out.mkdir(exist_ok=True)
    stats = ingest_file(str(path), str(out / "r.parquet"), str(out / "s.json"), str(out / "q.jsonl"), **kw)
    rows = pq.read_table(out / "r.parquet").to_pylist()
    quarantine = [json.loads(line) for line in (out / "q.jsonl").read_text().splitlines()]
    return stats, rows, quarantine


def write_jsonl(path: Path, records, opener=open) -> Path:
    with opener(path, "wt", encoding="utf-8") as fh:
        for r in records:
            fh.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return path


def test_json_array_roles_and_quarantine(tmp_path):
    records = [
        conv(0),
        {"id": "sys", "conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},
                                        {"from": "chatgpt", "value": "Hello"}, {"from": "user", "value": "More"},
                                        {"from": "bing", "value": "Sure"}, {"from": "human", "value": "x"},
                                        {"from": "bard", "value": "y"}]},
        {"id": "oa", "messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]},
        {"id": "bad-role", "conversations": [{"from": "human", "value": "Q"}, {"from": "robot", "value": "A"}]},
        {"id": "no-text", "conversations": [{"from": "human", "value": 3}]},
        {"id": "empty", "conversations": []},
        {"id": "late-system", "conversations": [{"from": "human", "value": "Q"}, {"from": "system", "value": "S"}]},
        ["not", "an", "object"],
    ]
    path = tmp_path / "a_cleaned_split.json"
    path.write_text(json.dumps(records, indent=2))
    stats, rows, quarantine = ingest(path, tmp_path)
    assert stats["container"] == "json-array"
    assert (stats["records_read"], stats["kept"], stats["quarantined"]) == (8, 3, 5)
    roles = [m["role"] for m in rows[1]["messages"]]
    assert roles == ["system", "user", "assistant", "user", "assistant", "user", "assistant"]
    assert rows[2]["messages"][1] == {"role": "assistant", "content": "A", "reasoning_content": None}
    assert rows[0]["source"].endswith("#0") and rows[0]["source_id"] == "r0"
    by_id = {q["record_index"]: q["reason"] for q in quarantine}
    assert "unknown role 'robot'" in by_id[3]
    assert "no text" in by_id[4]
    assert by_id[5] == "empty conversation"
    assert "system turn at position 1" in by_id[6]
    assert "not an object" in by_id[7]
    assert all(q["file"] == str(path) and q["byte_offset"] > 0 for q in quarantine)


@pytest.mark.parametrize("compression", ["none", "gz", "zst"])
def test_jsonl_compressed_and_invalid_lines(tmp_path, compression):
    records = [conv(i) for i in range(50)]
    lines = [json.dumps(r) for r in records]
    lines.insert(7, '{"id": "cut", "conversations": [')
    text = "\n".join(lines) + "\n\n"
    path = tmp_path / f"part.jsonl{'' if compression == 'none' else '.' + compression}"
    if compression == "gz":
        path.write_bytes(gzip.compress(text.encode()))
    elif compression == "zst":
        path.write_bytes(zstandard.ZstdCompressor().compress(text.encode()))
    else:
        path.write_text(text)
    stats, rows, quarantine = ingest(path, tmp_path)
    assert stats["compression"] == {"none": "none", "gz": "gzip", "zst": "zstd"}[compression]
    assert (stats["records_read"], stats["kept"], stats["quarantined"]) == (51, 50, 1)
    assert quarantine[0]["record_index"] == 7 and quarantine[0]["reason"].startswith("invalid JSON")
    assert [r["source_id"] for r in rows] == [f"r{i}" for i in range(50)]


def _array_bytes(n: int) -> bytes:
    return json.dumps([conv(i, "A longer answer " * 5) for i in range(n)]).encode()


@pytest.mark.parametrize("kind", ["json", "gz", "zst", "jsonl"])
def test_truncated_file_error_and_salvage(tmp_path, kind):
    # zstd decodes whole blocks (up to 128 KiB): make the data span several, so some survive the cut
    n = 40 if kind in ("json", "jsonl") else 3000
    if kind == "jsonl":
        data = ("\n".join(json.dumps(conv(i)) for i in range(n)) + "\n").encode()
    else:
        data = _array_bytes(n)
    cut = int(len(data) * 0.6)
    if kind == "gz":
        payload = gzip.compress(data)
        payload = payload[: int(len(payload) * 0.6)]
    elif kind == "zst":
        payload = zstandard.ZstdCompressor().compress(data)
        payload = payload[: int(len(payload) * 0.6)]
    else:
        payload = data[:cut]
    path = tmp_path / {"json": "t.json", "gz": "t.json.gz", "zst": "t.json.zst", "jsonl": "t.jsonl"}[kind]
    path.write_bytes(payload)
    with pytest.raises(CorruptInputError) as err:
        ingest(path, tmp_path)
    e = err.value
    assert e.path == str(path) and 0 < e.records_read < n and e.offset > 0
    assert "byte offset" in str(e) and str(path) in str(e) and "salvage" in str(e)

    stats, rows, _ = ingest(path, tmp_path, on_corrupt="salvage")
    assert stats["damage"] is not None and stats["damage"]["salvaged_records"] == e.records_read
    assert stats["kept"] == e.records_read == len(rows)
    assert [r["source_id"] for r in rows] == [f"r{i}" for i in range(len(rows))]  # complete, in order


def test_cli_names_file_offset_and_count(tmp_path):
    path = tmp_path / "broken.json"
    path.write_bytes(_array_bytes(10)[:-50])
    proc = run_cli("ingest", "--input", path, "--out", tmp_path / "r.parquet", "--stats", tmp_path / "s.json",
                   "--quarantine", tmp_path / "q.jsonl", check=False)
    assert proc.returncode == 2
    assert str(path) in proc.stderr and "byte offset" in proc.stderr and "complete records" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "r.parquet").exists()  # nothing half-written left behind


def test_corrupt_middle_of_array_is_detected(tmp_path):
    data = _array_bytes(20).decode()
    at = data.index('"r12"')
    path = tmp_path / "c.json"
    path.write_text(data[:at] + "@@garbage@@" + data[at:])
    with pytest.raises(CorruptInputError) as err:
        ingest(path, tmp_path)
    assert err.value.records_read == 12 and "invalid JSON" in err.value.reason


def _peak_parse_memory(path: Path) -> tuple[int, int]:
    tracemalloc.start()
    n = sum(1 for _ in iter_raw_records(str(path), ReadResult(), 1 << 26))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return n, peak


def test_streaming_memory_is_bounded(tmp_path):
    """A JSON array is parsed in chunks: peak memory does not grow with the file (nor come near its size)."""
    record = json.dumps(conv(0, "x" * 2000))
    peaks = {}
    for count in (4000, 16000):
        path = tmp_path / f"big{count}.json"
        with open(path, "w") as fh:
            fh.write("[" + ",".join([record] * count) + "]")
        n, peaks[count] = _peak_parse_memory(path)
        assert n == count
    size = (tmp_path / "big16000.json").stat().st_size  # ~34 MB
    assert peaks[16000] < 1.3 * peaks[4000], peaks
    assert peaks[16000] < size / 3, (peaks, size)


def test_manifest_dedup_accounting_and_shards(tmp_path):
    a = tmp_path / "a.jsonl"
    b = tmp_path / "b.jsonl"
    write_jsonl(a, [conv(i) for i in range(10)] + [conv(3), "not json"])
    write_jsonl(b, [conv(5), conv(20), conv(21), conv(20)])  # one cross-file and one in-file duplicate
    outs = []
    for p in (a, b):
        src = p.stem
        ingest_file(str(p), str(tmp_path / f"{src}.parquet"), str(tmp_path / f"{src}.stats.json"),
                    str(tmp_path / f"{src}.quarantine.jsonl"))
        outs.append(src)
    m = build_manifest([str(tmp_path / f"{s}.parquet") for s in outs],
                       [str(tmp_path / f"{s}.stats.json") for s in outs], shard_size=4)
    files = {f["src"]: f for f in m["files"]}
    assert (files["a"]["records_read"], files["a"]["kept"], files["a"]["quarantined"], files["a"]["duplicates"]) == (12, 10, 1, 1)
    assert (files["b"]["records_read"], files["b"]["kept"], files["b"]["quarantined"], files["b"]["duplicates"]) == (4, 2, 0, 2)
    for f in m["files"]:
        assert f["records_read"] == f["kept"] + f["quarantined"] + f["duplicates"]
    assert [s["shard"] for s in m["shards"]] == ["a-00000", "a-00001", "a-00002", "b-00000"]
    assert [s["samples"] for s in m["shards"]] == [4, 4, 2, 2]
    seen = []
    for s in m["shards"]:
        out = tmp_path / f"{s['shard']}.parquet"
        assert write_shard(str(tmp_path / f"{s['src']}.parquet"), s, str(out)) == s["samples"]
        seen += pq.read_table(out).column("sample_id").to_pylist()
    assert len(seen) == len(set(seen)) == 12
    assert any(e["first_file"] == str(a) and e["file"] == str(b) for e in m["duplicate_examples"])
