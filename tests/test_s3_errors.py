"""S3 failures reach the user as one line naming the URI and the cause, never as a botocore traceback, and
never with a secret in it: a missing bucket, a missing key, a dead endpoint, no credentials at all."""

from __future__ import annotations

import os

import pytest

from conftest import S3_BUCKET, S3_KEY, S3_SECRET, _free_port, run_cli

SECRET_LOOKING = "verysecretvalue123"


def _env(url: str | None, keys: bool = True) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "SNAKEMAKE_STORAGE_S3_"))}
    env.update(AWS_MAX_ATTEMPTS="1", AWS_DEFAULT_REGION="us-east-1", AWS_CONFIG_FILE=os.devnull,
               AWS_SHARED_CREDENTIALS_FILE=os.devnull, AWS_EC2_METADATA_DISABLED="true")
    if url:
        env["AWS_ENDPOINT_URL"] = url
    if keys:
        env.update(AWS_ACCESS_KEY_ID=S3_KEY, AWS_SECRET_ACCESS_KEY=S3_SECRET + SECRET_LOOKING)
    return env


def _ingest(tmp_path, uri: str, env: dict):
    return run_cli("ingest", "--input", uri, "--name", "x", "--out", tmp_path / "x.parquet", "--stats",
                   tmp_path / "x.stats.json", "--quarantine", tmp_path / "x.q.jsonl", check=False, env=env,
                   timeout=120)


def _one_line_error(proc, *expected: str) -> str:
    err = proc.stderr.strip()
    assert proc.returncode == 2, (proc.returncode, err[-3000:])
    assert "Traceback" not in err, err[-3000:]
    last = err.splitlines()[-1]
    assert last.startswith("error: "), err[-2000:]
    for word in expected:
        assert word in last, last
    assert SECRET_LOOKING not in err and S3_SECRET not in err
    return last


@pytest.mark.parametrize("what", ["bucket", "key"])
def test_missing_bucket_or_key(tmp_path, s3_server, what):
    url, _ = s3_server
    uri = f"s3://no-such-bucket/a.jsonl" if what == "bucket" else f"s3://{S3_BUCKET}/missing/a.jsonl"
    line = _one_line_error(_ingest(tmp_path, uri, _env(url)), uri)
    assert ("bucket does not exist" if what == "bucket" else "no such object") in line


def test_dead_endpoint(tmp_path):
    url = f"http://127.0.0.1:{_free_port()}"  # nothing listens there
    _one_line_error(_ingest(tmp_path, f"s3://{S3_BUCKET}/a.jsonl", _env(url)), f"s3://{S3_BUCKET}/a.jsonl",
                    "127.0.0.1")


def test_no_credentials(tmp_path, s3_server):
    url, _ = s3_server
    line = _one_line_error(_ingest(tmp_path, f"s3://{S3_BUCKET}/a.jsonl", _env(url, keys=False)),
                           f"s3://{S3_BUCKET}/a.jsonl")
    assert "credentials" in line.lower()
