"""The whole demo pipeline with S3 as the default storage, against a real S3-compatible server (moto's server
mode) on 127.0.0.1: every input and output is an object, the rerun does nothing, and a lost shard object is
made again alone."""

from __future__ import annotations

import datetime
import time

import pytest

from conftest import S3_BUCKET as BUCKET
from conftest import S3_KEY as KEY
from conftest import S3_SECRET as SECRET
from rerun_scenarios import ran
from workflow_runs import make_workdir, planned, snakemake, workflow_env

pytestmark = pytest.mark.slow

PREFIX = "run1"


def _objects(client) -> dict[str, object]:
    found = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=PREFIX + "/"):
        for obj in page.get("Contents", []):
            found[obj["Key"].removeprefix(PREFIX + "/")] = obj["LastModified"]
    return found


@pytest.mark.timeout(1200)  # ~250-330 s on an idle 2-core machine; the suite's 600 s ran out on a busy one
def test_pipeline_on_s3(s3_server, tmp_path, tiny_target):
    url, client = s3_server
    workdir = make_workdir(tmp_path / "run")
    # the demo's tiny target already in place, as an object under the run's prefix as the tiny_target rule would
    # write it (the session's: what that rule builds at target_pretrain_steps 0): the run does not build it
    target = sorted(p.name for p in tiny_target.iterdir() if p.is_file())
    for name in target:
        client.upload_file(str(tiny_target / name), BUCKET, f"{PREFIX}/resources/demo-target/{name}")
    env = workflow_env(
        SNAKEMAKE_STORAGE_S3_ACCESS_KEY=KEY, SNAKEMAKE_STORAGE_S3_SECRET_KEY=SECRET,
        AWS_ACCESS_KEY_ID=KEY, AWS_SECRET_ACCESS_KEY=SECRET, AWS_DEFAULT_REGION="us-east-1", AWS_ENDPOINT_URL=url,
    )
    s3 = ["--default-storage-provider", "s3", "--default-storage-prefix", f"s3://{BUCKET}/{PREFIX}",
          "--storage-s3-endpoint-url", url]

    def run(*args, **kw):
        # targets first: --storage-s3-endpoint-url takes several values and would swallow them
        since = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(seconds=2)
        proc = snakemake(workdir, *args, *s3, env=env, check=False, **kw)
        if proc.returncode != 0:  # the jobs' logs are objects: show those this run wrote
            logs = {k: client.get_object(Bucket=BUCKET, Key=f"{PREFIX}/{k}")["Body"].read().decode(errors="replace")
                    for k, stamp in _objects(client).items() if k.startswith("results/logs/") and stamp >= since}
            pytest.fail(f"snakemake {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n"
                        f"{proc.stderr[-8000:]}\n" + "\n".join(f"--- {k}\n{v[-3000:]}" for k, v in sorted(logs.items())))
        return proc

    t0 = time.monotonic()
    first = run("--cores", "2")
    full = time.monotonic() - t0
    assert "tiny_target" not in ran(first) and ran(first).get("train") == 1, ran(first)
    objects = _objects(client)
    assert {f"resources/demo-target/{name}" for name in target} <= set(objects)
    # every stage's outputs are objects; nothing was written to a local results/ directory
    for key in ("data/demo/sharegpt_part2.jsonl.gz", "results/ingest/manifest.json", "results/audit/source/gate.ok",
                "results/audit/regenerated/gate.ok", "results/evaluate/report.json"):
        assert key in objects, sorted(objects)
    shards = sorted(k.split("/")[-1].removesuffix(".parquet") for k in objects
                    if k.startswith("results/ingest/shards/") and k.endswith(".parquet"))
    assert len(shards) >= 2
    for shard in shards:
        for key in (f"results/tokens/source/{shard}.parquet", f"results/completions/{shard}.parquet",
                    f"results/tokens/regenerated/{shard}.parquet"):
            assert key in objects, key
    assert any(k.startswith("results/train/drafter/") for k in objects)
    # the hidden states are stored once, in the extraction groups the training job read: none copied out of them
    # (a copy would also have gone down to this machine and up again)
    hidden = [k for k in objects if k.startswith("results/hidden/")]
    assert any(k.endswith(".dfhs") for k in hidden), hidden
    assert all(k.startswith("results/hidden/groups/") for k in hidden), hidden
    # locally only the resume state that is not a declared output (generation journals, training
    # checkpoints); the journals are mirrored to S3 beside the completions
    local = {p.relative_to(workdir).as_posix() for p in (workdir / "results").rglob("*") if p.is_file()}
    assert all(p.startswith(("results/completions/journal/", "results/train/checkpoints/")) for p in local), local
    assert any(k.startswith("results/completions/journal/") for k in objects), sorted(objects)

    # a rerun does nothing
    t0 = time.monotonic()
    again = run("--cores", "2")
    assert "Nothing to be done" in again.stdout + again.stderr
    noop = time.monotonic() - t0
    assert _objects(client) == objects

    # one shard's object is lost: only that shard is made again
    lost = f"results/ingest/shards/{shards[1]}.parquet"
    client.delete_object(Bucket=BUCKET, Key=f"{PREFIX}/{lost}")
    # ... not by the default target, whose outputs are all up to date (Snakemake makes what is needed) ...
    assert planned(run("-n")) == {}
    # ... but when it is asked for (or by a later stage whose output is missing), and then only that job
    # (its group's directory is whole: the shard's file is linked out of it again)
    assert planned(run(lost, "-n")) == {"shard_from_group": 1}
    t0 = time.monotonic()
    run(lost, "--cores", "2")
    one = time.monotonic() - t0
    after = _objects(client)
    assert lost in after
    assert {k for k in after if after[k] != objects.get(k)} <= {lost, f"results/logs/shard/{shards[1]}.link.log"}
    # its new upload time makes that shard's consumers out of date (objects carry no checksum), and only
    # that shard's: the run that follows rewrites no object of another shard. Up to the source audit, the
    # first aggregate: the stages after it are per shard the same way, shown on local files by
    # tests/test_incremental.py (change_one_record), and running them all again here would double the test.
    before = _objects(client)
    run("results/audit/source/report.json", "--cores", "2")
    changed = {k for k, stamp in _objects(client).items() if before.get(k) != stamp}
    assert f"results/tokens/source/{shards[1]}.parquet" in changed, sorted(changed)
    other = sorted(k for k in changed if any(s in k for s in shards if s != shards[1]))
    assert not other, other
    print(f"S3 pipeline: full run {full:.1f} s, no-op rerun {noop:.1f} s, one-shard rerun {one:.1f} s")
