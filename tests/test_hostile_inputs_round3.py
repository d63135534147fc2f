"""Hostile inputs, round 3 (issue 27, data side): a broken record costs that record, decompression bombs and
special files are refused at bounded memory and time, truncated S3 bodies are retried, a results directory
belongs to one configuration and a retrained target reruns what depends on it."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import zstandard

from dflash_pipeline.data.ingest import ingest_file
from dflash_pipeline.errors import CorruptInputError


def conv(i: int) -> dict:
    return {"id": f"r{i}", "conversations": [{"from": "human", "value": f"Question {i}? [a] {{b}}"},
                                            {"from": "gpt", "value": f"Answer {i}, {{\"x\": [1]}}"}]}


def ingest(path: Path, tmp: Path, **kw) -> tuple[dict, list[dict], list[dict]]:
    out = tmp / (path.name + ".out")
    out.mkdir(exist_ok=True)
    stats = ingest_file(str(path), str(out / "r.parquet"), str(out / "s.json"), str(out / "q.jsonl"), **kw)
    rows = pq.read_table(out / "r.parquet").to_pylist()
    quarantine = [json.loads(line) for line in (out / "q.jsonl").read_text().splitlines()]
    return stats, rows, quarantine


def _pack(data: bytes, compression: str) -> bytes:
    if compression == "gz":
        return gzip.compress(data)
    if compression == "zst":
        return zstandard.ZstdCompressor().compress(data)
    return data


def _suffix(compression: str) -> str:
    return ".json" + ("" if compression == "none" else "." + compression)


# ------------------------------------------------------------------------------ 1: resync after damage mid-array
# (name, how record 62's text is damaged): each breaks the scanner's view of strings or brackets
DAMAGES = [
    ("missing quote", lambda t: t.replace('"from": "human"', '"from": "human', 1)),
    ("missing opening quote", lambda t: t.replace('"value": "Answer', '"value": Answer', 1)),
    ("extra closing bracket", lambda t: t.replace('"Question 62?', '"Question 62?"]', 1)),
    ("missing closing brace", lambda t: t[:t.rindex("}")]),
]


def _damaged_array(n: int, at: int, damage, indent) -> tuple[bytes, int, int]:
    """A JSON array of n records whose record `at` is damaged: (bytes, start, end) of the damaged record."""
    texts = [json.dumps(conv(i), indent=indent) for i in range(n)]
    texts[at] = damage(texts[at])
    sep = ",\n" if indent else ", "
    head = "[\n" if indent else "["
    start = len(head) + sum(len(t) + len(sep) for t in texts[:at])
    data = (head + sep.join(texts) + ("\n]\n" if indent else "]")).encode()
    return data, start, start + len(texts[at].rstrip().encode())  # the span ends at its last non-space byte


@pytest.mark.parametrize("compression", ["none", "gz", "zst"])
@pytest.mark.parametrize("name,damage", DAMAGES, ids=[d[0] for d in DAMAGES])
def test_one_damaged_record_mid_array_costs_that_record_only(tmp_path, compression, name, damage):
    """The issue's case: 125 records, record 62 damaged. Salvage resyncs at record 63 (a boundary at array
    depth 1), quarantines exactly record 62's bytes with their range, and keeps the 124 others in order."""
    data, start, end = _damaged_array(125, 62, damage, indent=2 if compression != "gz" else None)
    path = tmp_path / ("d" + _suffix(compression))
    path.write_bytes(_pack(data, compression))
    stats, rows, quarantine = ingest(path, tmp_path, on_corrupt="salvage")
    assert [r["source_id"] for r in rows] == [f"r{i}" for i in range(125) if i != 62]
    assert (stats["records_read"], stats["kept"], stats["quarantined"]) == (125, 124, 1)
    assert stats["damage"] is None  # nothing was lost: the file did not end at the damage
    [q] = quarantine
    assert q["byte_offset"] == start and q["byte_range"] == [start, end], (q, start, end)
    assert q["record"] == data[start:end].decode()
    assert "damaged" in q["reason"] and "ends" not in q["reason"] and "truncated" not in q["reason"]
    assert ("decompressed" in q["reason"]) == (compression != "none"), q["reason"]
    assert [s["byte_range"] for s in stats["damaged_spans"]] == [[start, end]]

    with pytest.raises(CorruptInputError) as err:  # without salvage: an error that counts what follows
        ingest(path, tmp_path)
    msg = str(err.value)
    assert "62 complete records before" in msg and "62 records after" in msg, msg
    assert ("decompressed" in msg) == (compression != "none") and "truncated" not in msg, msg


def test_damage_in_the_first_and_the_last_record_and_two_damages(tmp_path):
    texts = [json.dumps(conv(i)) for i in range(30)]
    texts[0] = texts[0].replace('"from": "human"', '"from": "human', 1)
    texts[17] = texts[17].replace('"id"', '"id', 1)
    texts[29] = texts[29].replace('"gpt"', 'gpt"', 1)
    data = ("[" + ", ".join(texts) + "]\n").encode()
    path = tmp_path / "three.json"
    path.write_bytes(data)
    stats, rows, quarantine = ingest(path, tmp_path, on_corrupt="salvage")
    assert [r["source_id"] for r in rows] == [f"r{i}" for i in range(30) if i not in (0, 17, 29)]
    assert stats["damage"] is None and (stats["records_read"], stats["quarantined"]) == (30, 3)
    assert [q["record"] for q in quarantine] == [texts[0], texts[17], texts[29]]


def test_truncation_is_worded_as_truncation_and_damage_as_damage(tmp_path):
    data = json.dumps([conv(i) for i in range(40)]).encode()
    cut = data.index(b'{"id": "r30"') + 20
    path = tmp_path / "cut.json"
    path.write_bytes(data[:cut])
    with pytest.raises(CorruptInputError) as err:
        ingest(path, tmp_path)
    msg = str(err.value)
    assert "ends inside record 30" in msg and "truncated" in msg and "decompressed" not in msg, msg
    assert "no records follow" in msg
    stats, rows, _ = ingest(path, tmp_path, on_corrupt="salvage")
    assert stats["kept"] == 30 and stats["damage"]["kind"] == "truncated"
    assert "cut short" in stats["damage"]["note"]


def test_damage_mid_file_of_a_large_array_with_small_record_limit(tmp_path):
    """Text without brackets: after a lost quote the scanner sees no bracket at all and runs to the end of the
    file, far past max_record_bytes (the damaged record's bytes are no longer held). The reader goes back to
    the record's start (reopening the file) and resyncs at the next record, holding one record at a time."""
    n = 3000
    texts = [json.dumps({"id": f"r{i}", "conversations": [{"from": "human", "value": f"Question {i} " + "w" * 200},
                                                        {"from": "gpt", "value": f"Answer {i}"}]}) for i in range(n)]
    texts[1500] = texts[1500].replace('"gpt"', 'gpt"', 1)
    data = ("[" + ", ".join(texts) + "]").encode()
    start = data.index(texts[1500].encode())
    for compression in ("none", "zst"):
        path = tmp_path / ("big" + _suffix(compression))
        path.write_bytes(_pack(data, compression))
        stats, rows, quarantine = ingest(path, tmp_path, on_corrupt="salvage", max_record_bytes=2000)
        assert len(rows) == n - 1 and [q["byte_range"] for q in quarantine] == [[start, start + len(texts[1500])]]
        assert quarantine[0]["record"] == texts[1500]
        assert "do not balance" in quarantine[0]["reason"] and "resumed at the next record" in quarantine[0]["reason"]


# ------------------------------------------------------------------------------ 13: decompression bombs
BOMB_BYTES = 200 << 20  # 200 MiB expanded; a few hundred KiB (gzip) or KiB (zstd) on disk


def _bomb(path: Path, kind: str, fill: bytes) -> Path:
    """`fill` repeated to BOMB_BYTES, compressed in a stream (never held expanded here either)."""
    block = fill * ((1 << 20) // len(fill))
    if kind == "gz":
        with gzip.open(path, "wb", compresslevel=1) as fh:
            for _ in range(BOMB_BYTES // len(block)):
                fh.write(block)
    else:
        with zstandard.ZstdCompressor(level=3).stream_writer(open(path, "wb")) as fh:
            for _ in range(BOMB_BYTES // len(block)):
                fh.write(block)
    return path


def _peak_ingest(path: Path, tmp: Path, **kw) -> tuple[dict, list[dict], int]:
    import tracemalloc

    tracemalloc.start()
    try:
        stats, _, quarantine = ingest(path, tmp, **kw)
        return stats, quarantine, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("kind", ["gz", "zst"])
@pytest.mark.parametrize("fill", [b"\0", b"\n"], ids=["NULs", "empty lines"])
def test_decompression_bomb_streams_at_bounded_memory(tmp_path, kind, fill):
    """The issue's bombs (10 GiB of NULs from 320 KiB of zstd, a 9 MiB gzip of NULs and of empty lines) peaked
    at 7 and 2 GB: each read decompressed without an output bound. Now every read makes at most ~1 MiB and a
    record is bounded by max_record_bytes while it streams: NULs (one 200 MiB "line") are one quarantined
    record with the reason, empty lines are nothing, and the peak stays a few MiB."""
    path = _bomb(tmp_path / f"bomb.jsonl.{kind}", kind, fill)
    assert path.stat().st_size < 1 << 20
    stats, quarantine, peak = _peak_ingest(path, tmp_path, max_record_bytes=1 << 20)
    assert peak < 64 << 20, f"peak {peak / 2**20:.0f} MiB"
    if fill == b"\0":
        assert (stats["records_read"], stats["quarantined"]) == (1, 1)
        assert f"record of {BOMB_BYTES} bytes is over max_record_bytes" in quarantine[0]["reason"]
    else:
        assert stats["records_read"] == 0 and stats["damage"] is None


def test_decompression_bomb_inside_a_json_array_record(tmp_path):
    """A JSON array whose one record holds 200 MiB of text (zstd): skipped while it streams, the others kept."""
    path = tmp_path / "bomb.json.zst"
    head = b'[{"id": "r0", "conversations": [{"from": "human", "value": "' + b"a" * 100
    tail = b'"}]}, ' + json.dumps(conv(1)).encode() + b"]"
    with zstandard.ZstdCompressor(level=3).stream_writer(open(path, "wb")) as fh:
        fh.write(head)
        for _ in range(BOMB_BYTES >> 20):
            fh.write(b"a" * (1 << 20))
        fh.write(tail)
    stats, quarantine, peak = _peak_ingest(path, tmp_path, max_record_bytes=1 << 20)
    assert peak < 64 << 20, f"peak {peak / 2**20:.0f} MiB"
    assert (stats["records_read"], stats["kept"], stats["quarantined"]) == (2, 1, 1)
    assert "over max_record_bytes" in quarantine[0]["reason"]


# ------------------------------------------------------------------------------ 14: special files
def _special_inputs(tmp_path: Path) -> dict[str, Path]:
    import os

    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)  # no writer: opening it for reading would block forever
    zero = tmp_path / "zero.jsonl"
    zero.symlink_to("/dev/zero")  # endless NULs
    return {"FIFO": fifo, "character device": zero}


def test_fifo_and_device_inputs_are_refused_by_ingest_without_hanging(tmp_path):
    from conftest import run_cli

    for kind, path in _special_inputs(tmp_path).items():
        proc = run_cli("ingest", "--input", path, "--out", tmp_path / "r.parquet", "--stats", tmp_path / "s.json",
                       "--quarantine", tmp_path / "q.jsonl", check=False, timeout=60)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        line = proc.stderr.strip().splitlines()[-1]
        assert str(path) in line and "not a regular file" in line and kind in line, line


def test_fifo_and_device_inputs_are_refused_at_preflight(tmp_path):
    from dflash_pipeline.planning.preflight import input_problems

    special = _special_inputs(tmp_path)
    good = tmp_path / "ok.jsonl"
    good.write_text(json.dumps(conv(0)) + "\n")
    inputs = {"a": str(special["FIFO"]), "b": str(special["character device"]), "c": str(good)}
    problems = input_problems(inputs, set(), None)
    assert len(problems) == 2, problems
    for (kind, path), line in zip(special.items(), problems):
        assert str(path) in line and "not a regular file" in line and kind in line, line


# ------------------------------------------------------------------------------ 10: inputs under the results
def test_inputs_under_the_results_directory_are_refused_at_preflight(tmp_path):
    """`results: data/results` with `inputs: data/*/*/*/*.jsonl`: the second run matched its own generation
    journals. Any input under the results directory (also through a symlink) is refused, with the fix."""
    from dflash_pipeline.planning.preflight import input_problems

    results = tmp_path / "data" / "results"
    journal = results / "completions" / "journal" / "s-00000.jsonl"
    journal.parent.mkdir(parents=True)
    journal.write_text(json.dumps(conv(0)) + "\n")
    raw = tmp_path / "data" / "raw" / "a" / "b.jsonl"
    raw.parent.mkdir(parents=True)
    raw.write_text(json.dumps(conv(1)) + "\n")
    (tmp_path / "alias").symlink_to(results)
    aliased = tmp_path / "alias" / "completions" / "journal" / "s-00000.jsonl"
    inputs = {"a": str(journal), "b": str(raw), "c": str(aliased)}
    problems = input_problems(inputs, set(), None, results=str(results))
    assert len(problems) == 2, problems
    assert str(journal) in problems[0] and "under the results directory" in problems[0]
    assert str(aliased) in problems[1] and "own outputs" in problems[1]


def test_snakemake_dry_run_refuses_a_glob_that_matches_the_results(tmp_path, tiny_target):
    """The issue's layout through the real Snakefile: `results: data/results`, `inputs: data/*/*/*/*.jsonl`."""
    import yaml
    from workflow_runs import make_workdir, snakemake

    work = make_workdir(tmp_path / "w")
    journal = work / "data" / "results" / "completions" / "journal" / "s-00000.jsonl"
    raw = work / "data" / "raw" / "x" / "y" / "a.jsonl"
    for path in (journal, raw):
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps(conv(0)) + "\n")
    user = {"demo": {"enabled": False}, "inputs": ["data/*/*/*/*.jsonl"], "results": "data/results",
            "target": {"model_path": str(tiny_target)}}
    (work / "user.yaml").write_text(yaml.safe_dump(user))
    proc = snakemake(work, "-n", configfiles=("user.yaml",), check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    lines = [ln.strip() for ln in out.splitlines() if "under the results directory" in ln]
    assert lines and "data/results/completions/journal/s-00000.jsonl" in lines[0], out[-3000:]


# ------------------------------------------------------------------------------ 17: S3 bodies cut short
class _CuttingProxy:
    """An HTTP proxy on 127.0.0.1 in front of the S3 server that cuts every `every`-th object GET body in half
    (its Content-Length promises the whole body, then the connection closes), as a flaky network does."""

    def __init__(self, upstream: str, every: int = 3, keep: float = 0.5):
        import http.server
        import threading
        import urllib.request

        proxy = self
        self.gets = 0

        class Handler(http.server.BaseHTTPRequestHandler):
            def _forward(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                req = urllib.request.Request(upstream + self.path, data=body, method=self.command,
                                             headers={k: v for k, v in self.headers.items() if k.lower() != "host"})
                try:
                    resp = urllib.request.urlopen(req)
                except urllib.error.HTTPError as err:
                    resp = err
                data = resp.read()
                cut = False
                if self.command == "GET" and "?" not in self.path and resp.status in (200, 206):
                    proxy.gets += 1
                    cut = proxy.gets % every == 0 and len(data) > 1
                self.send_response(resp.status)
                for k, v in resp.headers.items():
                    if k.lower() not in ("content-length", "transfer-encoding", "connection"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data[: int(len(data) * keep)] if cut else data)
                if cut:
                    self.close_connection = True

            do_GET = do_PUT = do_HEAD = do_POST = do_DELETE = _forward

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()


def test_s3_bodies_cut_short_are_retried_and_the_object_named(tmp_path, s3_server):
    """Every third GET body cut in half: ingest from s3:// reads every record (a cut read resumes with a ranged
    GET from where it stopped); a body that stays cut names the object and the byte."""
    import os

    from conftest import S3_BUCKET, S3_KEY, S3_SECRET, run_cli

    url, client = s3_server
    data = "".join(json.dumps(conv(i)) + "\n" for i in range(3000)).encode()
    for name in ("a.jsonl", "b.jsonl", "c.jsonl"):
        client.put_object(Bucket=S3_BUCKET, Key=f"cut/{name}", Body=data)
    proxy = _CuttingProxy(url)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "SNAKEMAKE_STORAGE_S3_"))}
    env.update(AWS_ENDPOINT_URL=proxy.url, AWS_ACCESS_KEY_ID=S3_KEY, AWS_SECRET_ACCESS_KEY=S3_SECRET,
               AWS_DEFAULT_REGION="us-east-1", AWS_CONFIG_FILE=os.devnull, AWS_SHARED_CREDENTIALS_FILE=os.devnull,
               AWS_EC2_METADATA_DISABLED="true", AWS_MAX_ATTEMPTS="1")
    try:
        for name in ("a.jsonl", "b.jsonl", "c.jsonl"):
            out = tmp_path / name
            proc = run_cli("ingest", "--input", f"s3://{S3_BUCKET}/cut/{name}", "--out", out.with_suffix(".parquet"),
                           "--stats", out.with_suffix(".json"), "--quarantine", out.with_suffix(".q"), check=False,
                           env=env, timeout=120)
            assert proc.returncode == 0, proc.stderr[-2000:]
            assert json.loads(out.with_suffix(".json").read_text())["kept"] == 3000
        assert proxy.gets >= 4  # some bodies were cut, and read again
    finally:
        proxy.close()


def test_s3_body_that_stays_cut_names_the_object(tmp_path, s3_server):
    import os

    from conftest import S3_BUCKET, S3_KEY, S3_SECRET, run_cli

    url, client = s3_server
    client.put_object(Bucket=S3_BUCKET, Key="cut/always.jsonl",
                      Body="".join(json.dumps(conv(i)) + "\n" for i in range(300)).encode())
    proxy = _CuttingProxy(url, every=1, keep=0)  # nothing of any body arrives: no progress, no end
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "SNAKEMAKE_STORAGE_S3_"))}
    env.update(AWS_ENDPOINT_URL=proxy.url, AWS_ACCESS_KEY_ID=S3_KEY, AWS_SECRET_ACCESS_KEY=S3_SECRET,
               AWS_DEFAULT_REGION="us-east-1", AWS_CONFIG_FILE=os.devnull, AWS_SHARED_CREDENTIALS_FILE=os.devnull,
               AWS_EC2_METADATA_DISABLED="true", AWS_MAX_ATTEMPTS="1")
    try:
        proc = run_cli("ingest", "--input", f"s3://{S3_BUCKET}/cut/always.jsonl", "--out", tmp_path / "r.parquet",
                       "--stats", tmp_path / "s.json", "--quarantine", tmp_path / "q.jsonl", check=False, env=env,
                       timeout=120)
    finally:
        proxy.close()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert f"s3://{S3_BUCKET}/cut/always.jsonl" in line and "cut short" in line and "6 times" in line, line


# ------------------------------------------------------------------------------ 11: one results dir, two workdirs
def test_a_results_directory_shared_by_two_working_directories_is_refused(tmp_path, tiny_target):
    """Two working directories, one absolute `results:` (max_length 256 and 64): each had its own Snakemake
    records, so both said "Nothing to be done" over shards mixed from both. The first real run claims the
    results; a run (even a dry run) from another working directory is refused with how to proceed."""
    import yaml
    from workflow_runs import make_workdir, snakemake

    from dflash_pipeline.planning.preflight import results_owner_problem

    results = tmp_path / "shared-results"
    first, second = make_workdir(tmp_path / "w1"), make_workdir(tmp_path / "w2")
    assert results_owner_problem(str(results), str(first), claim=True) is None  # what w1's first run does
    assert results_owner_problem(str(results), str(first), claim=True) is None  # and again: its own
    user = {"results": str(results), "tokenize": {"max_length": 64}}
    (second / "user.yaml").write_text(yaml.safe_dump(user))
    proc = snakemake(second, "-n", configfiles=("user.yaml",), check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    [line] = [ln.strip() for ln in out.splitlines() if "belongs to the runs from" in ln]
    assert str(results) in line and str(first.resolve()) in line and "another `results:`" in line, line


# ------------------------------------------------------------------------------ 12: the target's identity
def test_target_fingerprint_covers_weights_chat_template_and_tokenizer(tmp_path, tiny_target):
    """A retrained target (weights rewritten) or an edited chat template or tokenizer is another target; what
    tokenization reads (weights=False) moves with the template and tokenizer only."""
    import os
    import shutil

    from dflash_pipeline.target import fingerprint

    model = tmp_path / "target"
    shutil.copytree(tiny_target, model)
    full, tok = fingerprint(model), fingerprint(model, weights=False)
    assert (fingerprint(model), fingerprint(model, weights=False)) == (full, tok)  # stable
    weights = model / "model.safetensors"
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # rewritten in place
    assert fingerprint(model) != full and fingerprint(model, weights=False) == tok
    full = fingerprint(model)
    template = model / "chat_template.jinja"
    template.write_text(template.read_text() + "{# edited #}")
    assert fingerprint(model) != full and fingerprint(model, weights=False) != tok


@pytest.mark.slow
def test_a_target_changed_in_place_reruns_the_jobs_that_read_it(tmp_path, tiny_target, demo_raw):
    """Through the real Snakefile, a user's model directory: after the tokens and their audit exist, rewriting
    the weights in place reruns nothing that only tokenizes (and the dry run says so), an edited chat template
    reruns tokenization; the jobs that read the weights carry the weights' identity as a param."""
    import os
    import shutil

    import yaml
    from workflow_runs import make_workdir, snakemake

    work = make_workdir(tmp_path / "w")
    model = tmp_path / "user-target"
    shutil.copytree(tiny_target, model)
    # one raw file (one shard): what is tested is which jobs read the target, not how many shards there are
    user = {"target": {"model_path": str(model)}, "inputs": [str(demo_raw / "sharegpt_part2.jsonl.gz")]}
    (work / "user.yaml").write_text(yaml.safe_dump(user))
    configs = ("tiny.yaml", "user.yaml")
    report, calibration = "results/audit/source/report.json", "results/calibration/generation.json"
    snakemake(work, report, calibration, "--cores", "2", configfiles=configs)  # calibration: the target answers
    dry = snakemake(work, "-n", report, calibration, configfiles=configs)
    assert "Nothing to be done" in dry.stdout + dry.stderr

    weights = model / "model.safetensors"
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # retrained in place
    dry = snakemake(work, "-n", report, configfiles=configs)
    assert "Nothing to be done" in dry.stdout + dry.stderr  # tokenization does not read the weights
    dry = snakemake(work, "-n", report, calibration, configfiles=configs)
    out = dry.stdout + dry.stderr  # the one job so far that ran the target's weights, and only it
    assert planned(out) == {"calibrate": 1, "total": 1}, out[-3000:]
    assert re.search(r"reason: .*[Pp]arams have changed", out), out[-3000:]

    template = model / "chat_template.jinja"
    template.write_text(template.read_text() + "{# edited #}")
    dry = snakemake(work, "-n", report, configfiles=configs)
    out = dry.stdout + dry.stderr
    assert "Nothing to be done" not in out and planned(out).get("tokenize"), out[-3000:]
    assert re.search(r"reason: .*[Pp]arams have changed", out), out[-3000:]


def planned(out: str) -> dict:
    """The job counts of a dry run's table."""
    table = out.split("Job stats:", 1)[1] if "Job stats:" in out else ""
    return {m[0]: int(m[1]) for m in re.findall(r"^(\w+)\s+(\d+)$", table, flags=re.M)}
