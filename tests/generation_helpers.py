"""Helpers for the generation tests: ingested shards written directly, and test servers on real ports."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from dflash_pipeline.data.conversations import SAMPLE_SCHEMA, sample_id
from dflash_pipeline.demo.data import make_conversation

SERVER = Path(__file__).with_name("sglang_test_server.py")


def write_shard(path: Path, n: int, seed: int = 0, placeholder_rate: float = 0.3, extra: list | None = None) -> list[dict]:
    """An ingested shard (SAMPLE_SCHEMA) of `n` demo conversations plus `extra` message lists."""
    rng = random.Random(seed)
    rows, seen = [], set()
    convs = [make_conversation(rng, placeholder_rate) for _ in range(n * 2)]
    convs = [[{"role": r, "content": t, "reasoning_content": None} for r, t in c] for c in convs]
    for messages in convs + (extra or []):
        sid = sample_id(messages)
        if sid in seen:
            continue
        seen.add(sid)
        rows.append({"sample_id": sid, "source": "test", "source_id": None, "messages": messages})
        if len(rows) == n and not extra:
            break
    rows = rows[:n] + ([r for r in rows[n:]] if extra else [])
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=SAMPLE_SCHEMA), path)
    return rows


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_health(url: str, timeout: float = 60.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the test server exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise TimeoutError(url)


def knob_env(**knobs) -> dict:
    """The stand-in server's test knobs (engine="instant", fault_rate=0.2, ...) as its environment variables."""
    return {f"DFLASH_TEST_SERVER_{k.upper()}": str(v) for k, v in knobs.items()}


class SGLangTestServer:
    """The SGLang 0.5.23 stand-in in a subprocess on a free 127.0.0.1 port: `args` are SGLang flags (parsed
    strictly), `knobs` the test-only settings (engine, faults, delays; see the server's docstring)."""

    def __init__(self, model: Path, *args: str, log: Path | None = None, **knobs):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, str(SERVER), "--model-path", str(model), "--port", str(self.port), *map(str, args)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, env={**os.environ, **knob_env(**knobs)},
                                     stderr=open(log, "ab") if log else subprocess.DEVNULL)

    def __enter__(self):
        wait_health(self.url, proc=self.proc)
        return self

    def __exit__(self, *exc):
        self.stop()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def read_completions(path: Path) -> list[dict]:
    return pq.read_table(path).to_pylist()


def read_summary(out: Path) -> dict:
    return json.loads(Path(str(out).removesuffix(".parquet") + ".summary.json").read_text())
