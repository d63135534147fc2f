"""Local paths and s3:// URIs behind one small interface, and atomic writes.

Outputs are always written to a temporary name in the destination directory and renamed into place
after fsync, so a killed job never leaves a file that a rerun mistakes for complete.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import tempfile
from pathlib import Path
from typing import IO, Iterator

from dflash_pipeline.errors import PipelineError

_URL_CREDENTIALS = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)[^/@\s:]+(:[^/@\s]*)?@")


def redact_credentials(text: str) -> str:
    """Every `scheme://user:secret@host` in `text` becomes `scheme://***@host` (for logs and stored reasons)."""
    return _URL_CREDENTIALS.sub(r"\g<scheme>***@", str(text))


def s3_error(uri: str, exc: BaseException) -> PipelineError:
    """One line naming the URI and the cause instead of a botocore traceback. botocore's messages carry no
    secret keys; endpoint URLs in them are redacted anyway."""
    code = getattr(exc, "response", {}).get("Error", {}).get("Code") if hasattr(exc, "response") else None
    cause = {"NoSuchBucket": "the bucket does not exist", "NoSuchKey": "no such object",
             "404": "no such object", "403": "access denied (check the credentials and the bucket policy)",
             "AccessDenied": "access denied (check the credentials and the bucket policy)",
             "InvalidAccessKeyId": "the access key is not known to the server",
             "SignatureDoesNotMatch": "the secret key does not match the access key"}.get(str(code))
    detail = redact_credentials(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    return PipelineError(f"{uri}: S3 request failed: {cause + ' (' + detail + ')' if cause else detail}")


def is_botocore_error(exc: BaseException) -> bool:
    mod = type(exc).__module__ or ""
    return mod.startswith(("botocore", "boto3", "s3transfer"))


def is_s3(uri: str) -> bool:
    return str(uri).startswith("s3://")


def split_s3(uri: str) -> tuple[str, str]:
    bucket, _, key = str(uri)[len("s3://"):].partition("/")
    return bucket, key


def s3_client():
    """A boto3 client; credentials come from the environment or the AWS config, never from our config.

    `AWS_ENDPOINT_URL` (or `SNAKEMAKE_STORAGE_S3_ENDPOINT_URL`) points it at an S3-compatible server.
    """
    import boto3

    endpoint = os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("SNAKEMAKE_STORAGE_S3_ENDPOINT_URL")
    kwargs = {"endpoint_url": endpoint} if endpoint else {}
    key = os.environ.get("SNAKEMAKE_STORAGE_S3_ACCESS_KEY")
    secret = os.environ.get("SNAKEMAKE_STORAGE_S3_SECRET_KEY")
    if key and secret and not os.environ.get("AWS_ACCESS_KEY_ID"):
        kwargs.update(aws_access_key_id=key, aws_secret_access_key=secret)
    return boto3.client("s3", **kwargs)


def open_binary(uri: str) -> IO[bytes]:
    """A readable binary stream over a local file or an S3 object (streamed, not downloaded first)."""
    if is_s3(uri):
        bucket, key = split_s3(uri)
        client = s3_client()
        try:
            resp = client.get_object(Bucket=bucket, Key=key)
        except Exception as exc:  # noqa: BLE001 - botocore's errors become one line naming the object
            if is_botocore_error(exc):
                raise s3_error(uri, exc) from exc
            raise
        return io.BufferedReader(_RawStream(resp["Body"], _Resume(client, uri, resp.get("ETag"))), buffer_size=1 << 20)
    problem = not_regular_file(uri)
    if problem:  # checked before open(): opening a FIFO without a writer blocks forever
        raise PipelineError(f"{uri}: {problem}")
    return open(uri, "rb")


def not_regular_file(path: str) -> str | None:
    """Why a local path that exists is not a regular file (after symlinks), or None: a FIFO hangs its reader
    and a device (a symlink to /dev/zero) never ends."""
    import stat

    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None  # missing or unreadable: open() names it
    if stat.S_ISREG(mode):
        return None
    kind = ("FIFO" if stat.S_ISFIFO(mode) else "character device" if stat.S_ISCHR(mode) else
            "block device" if stat.S_ISBLK(mode) else "socket" if stat.S_ISSOCK(mode) else
            "directory" if stat.S_ISDIR(mode) else "special file")
    link = f" (a symlink to {os.path.realpath(path)})" if os.path.islink(path) else ""
    return (f"not a regular file: a {kind}{link}; inputs must be regular files (a FIFO or a device would hang "
            "or never end)")


BODY_RETRIES = 5  # a body cut short (IncompleteRead) is read on from where it stopped, this many times in a row


def _is_cut_short(exc: BaseException) -> bool:
    """A response body that ended early: botocore's IncompleteReadError / ResponseStreamingError, or urllib3's
    and http.client's own errors under them."""
    mod = type(exc).__module__ or ""
    return mod.startswith(("botocore", "urllib3", "http.client")) or isinstance(exc, (ConnectionError, TimeoutError))


class _Resume:
    """Re-opens an S3 object at a byte offset (a ranged GET of the same ETag) after its body was cut short."""

    def __init__(self, client, uri: str, etag: str | None):
        self.client, self.uri, self.etag = client, uri, etag

    def body_from(self, offset: int):
        bucket, key = split_s3(self.uri)
        kwargs = {"IfMatch": self.etag} if self.etag else {}
        try:
            return self.client.get_object(Bucket=bucket, Key=key, Range=f"bytes={offset}-", **kwargs)["Body"]
        except Exception as exc:  # noqa: BLE001 - one line naming the object
            if is_botocore_error(exc):
                raise s3_error(self.uri, exc) from exc
            raise


class _RawStream(io.RawIOBase):
    def __init__(self, body, resume: _Resume | None = None):
        self._body, self._resume, self._pos = body, resume, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        for attempt in range(BODY_RETRIES + 1):
            try:
                data = self._body.read(len(buffer))
                break
            except Exception as exc:  # noqa: BLE001 - a cut body is transient: read on with a ranged GET
                if self._resume is None or not _is_cut_short(exc):
                    raise
                if attempt == BODY_RETRIES:
                    raise PipelineError(f"{self._resume.uri}: S3 response body cut short at byte {self._pos} "
                                        f"{BODY_RETRIES + 1} times in a row ({redact_credentials(exc)}); "
                                        "check the network or the S3 endpoint and rerun") from exc
                with contextlib.suppress(Exception):
                    self._body.close()
                self._body = self._resume.body_from(self._pos)
        buffer[: len(data)] = data
        self._pos += len(data)
        return len(data)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._body.close()
        super().close()


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path beside `path`; on success fsync it and rename it over `path`."""
    final = Path(path)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=f".tmp{suffix}", dir=final.parent)
    except OSError as exc:  # name the output, not a temporary name the user never asked for
        raise type(exc)(exc.errno, exc.strerror, str(final)) from None
    os.close(fd)
    tmp_path = Path(tmp)
    os.chmod(tmp_path, 0o666 & ~_umask())
    try:
        yield tmp_path
        with open(tmp_path, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp_path, final)
        _fsync_dir(final.parent)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w", **kwargs) -> Iterator[IO]:
    with atomic_path(path) as tmp, open(tmp, mode, **kwargs) as fh:
        yield fh


def write_json(path: str | os.PathLike, obj, indent: int | None = 2) -> None:
    with atomic_open(path, "w", encoding="utf-8") as fh:
        json.dump(obj, fh, indent=indent, sort_keys=False, default=_json_default)
        fh.write("\n")


def read_json(path: str | os.PathLike):
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def _json_default(obj):
    try:
        import numpy as np

        if isinstance(obj, np.integer):
            return int(obj)
        if isinstance(obj, np.floating):
            return float(obj)
        if isinstance(obj, np.ndarray):
            return obj.tolist()
    except ImportError:  # pragma: no cover
        pass
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary directory beside `path`; on success replace `path` with it in one rename."""
    import shutil

    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    try:
        yield tmp
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(final.parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
