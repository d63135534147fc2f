"""Training checkpoints mirrored to S3, so a train job that restarts on another machine resumes.

The checkpoint directory is not a declared output (a failed job must keep it), so under S3 default storage
or on Kubernetes it would stay on the node that wrote it. Each new checkpoint is uploaded in the background
(one at a time: training does not wait for a multi-GB upload); a run that finds no local checkpoint
fetches the newest one from the mirror (an older one if the newest does not load, see checkpoints.py).
"""

from __future__ import annotations

import logging
import re
import threading
from pathlib import Path

from dflash_pipeline.storage import atomic_path, s3_client, split_s3

log = logging.getLogger(__name__)
STEP_RE = re.compile(r"step-(\d{8})\.pt$")


class CheckpointMirror:
    def __init__(self, uri: str, keep: int = 2):
        self.bucket, prefix = split_s3(uri.rstrip("/"))
        self.prefix = prefix + "/"
        self.keep = max(1, keep)
        self.client = s3_client()
        self._upload: threading.Thread | None = None
        self._error: BaseException | None = None

    def keys(self) -> list[str]:
        """Keys of the mirrored checkpoints, oldest first."""
        keys, token = [], None
        while True:
            kw = {"Bucket": self.bucket, "Prefix": self.prefix}
            if token:
                kw["ContinuationToken"] = token
            page = self.client.list_objects_v2(**kw)
            keys += [o["Key"] for o in page.get("Contents", []) if STEP_RE.search(o["Key"])]
            if not page.get("IsTruncated"):
                return sorted(keys)
            token = page["NextContinuationToken"]

    def fetch(self, key: str, ckpt_dir: Path) -> Path:
        """Download one mirrored checkpoint into `ckpt_dir` (atomically) unless it is there already."""
        dest = ckpt_dir / key.rsplit("/", 1)[-1]
        if not dest.exists():
            with atomic_path(dest) as tmp:
                self.client.download_file(self.bucket, key, str(tmp))
            log.info("checkpoint %s restored from s3://%s/%s", dest, self.bucket, key)
        return dest

    def upload(self, path: Path) -> None:
        """Upload in the background; waits for the previous upload first (and re-raises its error)."""
        self.wait()

        def work():
            try:
                self.client.upload_file(str(path), self.bucket, self.prefix + path.name)
                for old in self.keys()[:-self.keep]:
                    self.client.delete_object(Bucket=self.bucket, Key=old)
            except BaseException as exc:  # reported on the next wait()
                self._error = exc

        self._upload = threading.Thread(target=work, name="checkpoint-mirror", daemon=True)
        self._upload.start()

    def wait(self) -> None:
        if self._upload is not None:
            self._upload.join()
            self._upload = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"checkpoint upload to s3://{self.bucket}/{self.prefix} failed: {error}") from error
