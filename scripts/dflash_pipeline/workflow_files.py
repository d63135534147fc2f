"""Reading a checkpoint's output from the workflow's input functions (rules/common.smk), where the file may live
in Snakemake storage (--default-storage-provider). Duck-typed on Snakemake's file objects, so that it is tested
without a workflow (tests/test_workflow_files.py)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile


@contextlib.contextmanager
def storage_copy(f):
    """A local path to read a file that may live in storage, or None when it does not exist. Snakemake
    retrieves a job's inputs, not what an input function or a param reads: a storage object is downloaded here
    to a private temporary file, never to its local copy's path, which belongs to the job that writes it (the
    DAG is re-evaluated while jobs run) and would go stale if left behind."""
    obj = getattr(f, "storage_object", None)
    if obj is None:
        yield str(f) if os.path.exists(f) else None
        return
    local = str(obj.local_path())
    if os.path.exists(local):  # a job of this run wrote or retrieved it: the current version
        yield local
        return
    if not obj.exists():
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="dflash-storage-") as tmp:
        copy = os.path.join(tmp, os.path.basename(local))
        download = getattr(obj, "s3obj", None)  # the S3 plugin's object: download anywhere
        if download is not None:
            download().download_file(copy)
        else:  # other plugins only retrieve to the local path: move it out at once
            os.makedirs(os.path.dirname(local), exist_ok=True)
            obj.retrieve_object()
            shutil.move(local, copy)
        yield copy


class JsonFileCache:
    """A checkpoint's JSON output, parsed once per version of the file: input functions and params ask for it per
    job, and re-parsing it for each of thousands of shards would dominate the planning time. The version is the
    local copy's (mtime, size); Snakemake retrieves a storage checkpoint's output before its dependants are
    planned (an input function's InputOpenException makes it), but not for a param: `download` reads the stored
    version then (storage_copy). `digest` turns the parsed file into what the workflow reads."""

    def __init__(self, digest=lambda data: data, download: bool = False):
        self._digest, self._download = digest, download
        self._key, self._data = None, None

    def get(self, out) -> dict:
        """`out`: the checkpoint's output (a path, or a storage file with `storage_object`)."""
        obj = getattr(out, "storage_object", None)
        local = str(obj.local_path()) if obj is not None else str(out)
        try:
            st = os.stat(local)
            key = (str(out), st.st_mtime_ns, st.st_size)
        except OSError:
            key = None
        if key is None and self._download and obj is not None:
            # for a param, where Snakemake retrieves nothing: the stored version, fetched once per invocation (a
            # job of this invocation that rewrites it leaves the local copy, versioned by its stat as above)
            key = (str(out), "stored")
        if key is not None and key == self._key:
            return self._data
        if self._download:
            with storage_copy(out) as path:  # the local copy where there is one
                if path is None:
                    raise FileNotFoundError(f"{out}: neither written nor stored")
                with open(path) as fh:
                    data = self._digest(json.load(fh))
        else:
            with out.open() as fh:
                data = self._digest(json.load(fh))
        if key is not None:
            self._key, self._data = key, data
        return data


def index_shards(data: dict) -> dict:
    """The shard manifest, its shards indexed by id."""
    data["_by_shard"] = {s["shard"]: s for s in data["shards"]}
    return data
