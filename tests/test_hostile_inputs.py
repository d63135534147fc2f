"""Hostile inputs, round 2 (issue 21): each case ends in one line naming the file, the record or sample and the
reason, or in the right result with nothing lost."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from conftest import BIN, run_cli
from dflash_pipeline.data.ingest import ReadResult, iter_raw_records
from dflash_pipeline.errors import PipelineError


def _conversations(n: int, answer_prefix: str = "", pad: int = 600) -> str:
    return "".join(json.dumps({"conversations": [{"from": "human", "value": f"q{i} " + "w" * pad},
                                                 {"from": "gpt", "value": f"{answer_prefix}a{i}"}]}) + "\n"
                   for i in range(n))


def _one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    """The stage failed with exit code 2 and one `error:` line (no traceback) containing every needle."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


# ------------------------------------------------------------------------------ 1: a file changing under ingest
def test_raw_file_rewritten_between_reads_is_an_error_not_a_mix(tmp_path):
    """The reader has handed out records of version 1 when the file is rewritten in place (as `cp` does): the
    end of the read names the file instead of handing out version 2's records as the rest of the same file."""
    path = tmp_path / "d.jsonl"
    path.write_text(_conversations(6000))  # ~3.7 MB: read in 1 MiB chunks
    records = iter_raw_records(str(path), ReadResult(), 1 << 20)
    first = next(records)
    assert first.value["conversations"][1]["value"] == "a0"
    shutil.copyfile(tmp_path / "d.jsonl", tmp_path / "v1.jsonl")
    (tmp_path / "v2.jsonl").write_text(_conversations(6000, "V2 "))
    shutil.copyfile(tmp_path / "v2.jsonl", path)  # same inode, truncated and rewritten
    with pytest.raises(PipelineError, match=r"d\.jsonl: the file was rewritten .* while it was being read"):
        for _ in records:
            pass
    # replaced by another file (a rename over the path) while being read: the same
    records = iter_raw_records(str(path), ReadResult(), 1 << 20)
    next(records)
    os.replace(tmp_path / "v1.jsonl", path)
    with pytest.raises(PipelineError, match="replaced by another file"):
        list(records)


def _read_position(pid: int, path: Path) -> int | None:
    """Where process `pid` reads `path` now (its descriptor's offset), or None while it has not opened it."""
    fd_dir = Path(f"/proc/{pid}/fd")
    try:
        for fd in fd_dir.iterdir():
            if os.path.realpath(fd) == str(path):
                for line in (Path(f"/proc/{pid}/fdinfo") / fd.name).read_text().splitlines():
                    if line.startswith("pos:"):
                        return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return None


def test_ingest_cli_fails_when_the_input_is_rewritten_mid_read(tmp_path):
    """The issue's case through the real CLI: `cp v2 d.jsonl` while `ingest` is reading d.jsonl."""
    v1, v2, d = tmp_path / "v1.jsonl", tmp_path / "v2.jsonl", tmp_path / "d.jsonl"
    v1.write_text(_conversations(8000))  # ~5 MB, read in 1 MiB chunks
    v2.write_text(_conversations(8000, "V2 "))
    shutil.copyfile(v1, d)
    out = tmp_path / "out"
    proc = subprocess.Popen([str(BIN / "dflash-pipeline"), "ingest", "--input", str(d), "--out", str(out / "d.parquet"),
                             "--stats", str(out / "d.json"), "--quarantine", str(out / "q.jsonl")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while (pos := _read_position(proc.pid, d)) is None or pos == 0:
        assert proc.poll() is None and time.monotonic() < deadline, "ingest ended before it was seen reading"
        time.sleep(0.005)
    assert pos < d.stat().st_size, "ingest read the whole file before the rewrite: make the file larger"
    shutil.copyfile(v2, d)
    stdout, stderr = proc.communicate(timeout=120)
    _one_line_error(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr),
                    str(d), "rewritten", "nothing was written")
    assert not out.exists() or not any(p.name.endswith((".parquet", ".json", ".jsonl")) for p in out.iterdir())


# ------------------------------------------------------------------------------ 10: settings typed and bounded
def cli_main(capsys, *args) -> subprocess.CompletedProcess:
    """`dflash-pipeline ARGS` in this process (the CLI's own main; no interpreter start-up per case)."""
    from dflash_pipeline import cli

    rc = cli.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, rc, out, err)


def test_settings_and_options_are_typed_and_bounded_by_the_schema(tmp_path, capsys):
    raw = tmp_path / "a.jsonl"
    raw.write_text(_conversations(3, pad=5))
    io = ["--input", raw, "--out", tmp_path / "a.parquet", "--stats", tmp_path / "a.json",
          "--quarantine", tmp_path / "q.jsonl"]
    _one_line_error(cli_main(capsys, "ingest", *io, "--settings", '{"max_record_bytes": "abc"}'),
                    "max_record_bytes='abc'", "not of type 'integer'")
    _one_line_error(cli_main(capsys, "ingest", *io, "--max-record-bytes", "-1"),
                    "--max-record-bytes -1", "minimum of 1024", "ingest.max_record_bytes")
    _one_line_error(cli_main(capsys, "ingest", *io, "--settings", '{"max_record_bytes": 12.5}'),
                    "max_record_bytes=12.5")
    _one_line_error(cli_main(capsys, "tokenize", "--input", "x.parquet", "--model", "m", "--out", "t", "--audit",
                             "a", "--settings", '{"batch_size": 0}'), "batch_size=0", "minimum of 1")
    assert not (tmp_path / "a.json").exists()  # nothing ran, nothing counted
    proc = cli_main(capsys, "ingest", *io, "--max-record-bytes", "1024")
    stats = json.loads(proc.stdout)
    assert (stats["records_read"], stats["kept"], stats["quarantined"]) == (3, 3, 0)  # no phantom record
