"""The rules' readers of checkpoint outputs (dflash_pipeline/workflow_files.py), with stand-ins for Snakemake's
file and storage objects."""

from __future__ import annotations

import json
import os
from pathlib import Path

from dflash_pipeline.settings.rule_params import planned_values
from dflash_pipeline.workflow_files import JsonFileCache, index_shards, storage_copy


class FakeStorageObject:
    """A storage object whose remote copy is `remote`, retrieved (only) to its local path, like a plugin's."""

    def __init__(self, local: Path, remote: Path | None):
        self.local, self.remote, self.retrieved = local, remote, 0

    def local_path(self):
        return self.local

    def exists(self):
        return self.remote is not None and self.remote.exists()

    def retrieve_object(self):
        self.retrieved += 1
        self.local.write_bytes(self.remote.read_bytes())


class StorageFile(str):
    def __new__(cls, path, obj):
        f = super().__new__(cls, path)
        f.storage_object = obj
        return f


def test_storage_copy_of_a_plain_path(tmp_path):
    with storage_copy(str(tmp_path / "missing")) as path:
        assert path is None
    (tmp_path / "f").write_text("x")
    with storage_copy(str(tmp_path / "f")) as path:
        assert path == str(tmp_path / "f")


def test_storage_copy_downloads_to_a_private_file_and_leaves_the_local_path_alone(tmp_path):
    remote = tmp_path / "remote.json"
    remote.write_text("v1")
    local = tmp_path / "local" / "sample.json"
    obj = FakeStorageObject(local, remote)
    with storage_copy(StorageFile("s3://b/sample.json", obj)) as path:
        assert Path(path).read_text() == "v1" and Path(path) != local
        kept = path
    assert obj.retrieved == 1 and not local.exists() and not os.path.exists(kept)  # moved out, then removed
    local.write_text("written by a job of this run")  # the local copy, once it exists, is the current version
    with storage_copy(StorageFile("s3://b/sample.json", obj)) as path:
        assert path == str(local)
    with storage_copy(StorageFile("s3://b/none.json", FakeStorageObject(tmp_path / "n", None))) as path:
        assert path is None


def test_manifest_is_parsed_once_per_version(tmp_path, monkeypatch):
    out = tmp_path / "manifest.json"
    out.write_text(json.dumps({"shards": [{"shard": "a-00000", "src": "a"}]}))
    cache, loads = JsonFileCache(index_shards), []
    real_load = json.load
    monkeypatch.setattr(json, "load", lambda fh: loads.append(1) or real_load(fh))
    first = cache.get(out)
    assert first["_by_shard"]["a-00000"]["src"] == "a"
    assert cache.get(out) is first and len(loads) == 1
    out.write_text(json.dumps({"shards": [{"shard": "b-00000", "src": "b"}, {"shard": "b-00001", "src": "b"}]}))
    assert set(cache.get(out)["_by_shard"]) == {"b-00000", "b-00001"} and len(loads) == 2


def test_planned_values_are_the_plans_resolved_layer_ids_and_mask_token(tmp_path):
    plan = {"target_layer_ids": [1, 8, 14], "mask_token": {"id": 16, "token": "<empty_output>", "description": "."}}
    assert planned_values(plan) == {"target_layer_ids": [1, 8, 14], "mask_token_id": 16}
    # undecided (no spare row, no special token): training decides and says why, so nothing is passed for it
    assert planned_values({**plan, "mask_token": {"id": None, "description": "not decided"}}) == {
        "target_layer_ids": [1, 8, 14]}
    out = tmp_path / "plan.json"
    out.write_text(json.dumps(plan))
    assert JsonFileCache(planned_values).get(out)["mask_token_id"] == 16


def test_a_param_reads_the_stored_plan_once_then_the_local_copy_a_job_wrote(tmp_path):
    plan = {"target_layer_ids": [1, 2], "mask_token": {"id": 5}}
    remote = tmp_path / "remote.json"
    remote.write_text(json.dumps(plan))
    local = tmp_path / "local" / "plan.json"
    obj = FakeStorageObject(local, remote)
    out = StorageFile("s3://b/plan.json", obj)
    cache = JsonFileCache(planned_values, download=True)
    assert cache.get(out) == {"target_layer_ids": [1, 2], "mask_token_id": 5}
    assert cache.get(out) == {"target_layer_ids": [1, 2], "mask_token_id": 5} and obj.retrieved == 1  # once
    assert not local.exists()  # the job that writes the plan owns the local path
    local.write_text(json.dumps({**plan, "target_layer_ids": [3, 4]}))  # the plan reran in this invocation
    assert cache.get(out)["target_layer_ids"] == [3, 4] and obj.retrieved == 1
