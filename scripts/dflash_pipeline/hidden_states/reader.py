"""Reading hidden-state shards (layout.py): random access to one shard, local (pread / mmap) or on S3 (ranged GETs).

Nothing a file claims is trusted before it is checked against the file: the index's decompressed size, the
index's columns and metadata, and each record's sections (inside the record, of the sizes its token count and
the metadata's shape imply, compressed at most MAX_EXPANSION-fold) are checked before any buffer is allocated.
"""

from __future__ import annotations

import collections
import contextlib
import json
import mmap as mmap_module
import os
import threading
import zlib
from typing import Iterator

import numpy as np
import zstandard

from dflash_pipeline import storage
from dflash_pipeline.hidden_states.codec import bounded_decompress, decode_hidden
from dflash_pipeline.hidden_states.layout import (
    CODECS,
    EXPANSION_FLOOR,
    FILE_EXTENSION,
    FOOTER,
    FOOTER_MAGIC,
    HEADER,
    HEADER_SIZE,
    INDEX_COLUMNS,
    MAGIC,
    MAX_EXPANSION,
    MAX_FEATURE_LAYERS,
    MAX_HIDDEN_SIZE,
    STORED_DTYPES,
    VERSION,
    ShardFormatError,
    always_stored_raw,
    expected_raw_lengths,
    index_limit,
)


def shard_files(paths) -> list[str]:
    """The hidden-state shards that `paths` name: a file as itself, a local directory (an extraction group's, the
    workflow's train input) as its shards in name order, which is their shard order. A directory without one is
    an error naming it: a training run never goes on with part of its data missing."""
    files: list[str] = []
    for path in map(str, paths):
        if "://" not in path and os.path.isdir(path):
            found = sorted(e.path for e in os.scandir(path) if e.name.endswith(FILE_EXTENSION) and e.is_file())
            if not found:
                raise ShardFormatError(f"{path}: a directory without hidden-state shards (*{FILE_EXTENSION})")
            files += found
        else:
            files.append(path)
    return files


def file_key(path: str) -> tuple:
    """What names one version of a file: its path and (device, inode, mtime, size). A shard replaced or
    rewritten under the same path gets another key, so nothing cached for the old one is used for it."""
    st = os.stat(path)
    return path, st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size


def _open_version(key: tuple) -> int:
    """A descriptor of exactly the file version `key` names (ShardFormatError when the path now holds another)."""
    fd = os.open(key[0], os.O_RDONLY | os.O_CLOEXEC)
    st = os.fstat(fd)
    if (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size) != key[1:]:
        os.close(fd)
        raise ShardFormatError(f"{key[0]}: the file was replaced or rewritten since this reader opened it; "
                               "open it again")
    return fd


class _OpenFiles:
    """A process-wide LRU of open shard files, so that a training job holding readers on thousands of
    shards keeps at most `MAX_OPEN_FILES` descriptors (and maps) open. Reads use pread: no seek, no lock.
    Entries are keyed by `file_key` (path and file version), not by path alone."""

    def __init__(self, limit: int):
        self.limit = limit
        self._fds: collections.OrderedDict = collections.OrderedDict()
        self._maps: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def reading(self, path: tuple):
        """An open descriptor of the file version `path` (a `file_key`), not closed by eviction while in use."""
        with self._lock:
            entry = self._fds.pop(path, None)
            if entry is None:
                entry = [_open_version(path), 0]
            entry[1] += 1
            self._fds[path] = entry
            self._evict()
        try:
            yield entry[0]
        finally:
            with self._lock:
                entry[1] -= 1
                if path not in self._fds and entry[1] == 0:  # evicted while in use: close it now
                    os.close(entry[0])
                self._evict()

    def _evict(self, keep: int | None = None) -> None:
        excess = len(self._fds) - (self.limit if keep is None else keep)
        for p in list(self._fds):
            if excess <= 0:
                break
            fd, users = self._fds.pop(p)
            excess -= 1
            if users == 0:
                os.close(fd)

    def map(self, path: tuple):
        with self._lock:
            m = self._maps.pop(path, None)
            if m is None:
                fd = _open_version(path)
                try:
                    # copy-on-write map: tensors built on it are writable views that never touch the file
                    m = mmap_module.mmap(fd, 0, access=mmap_module.ACCESS_COPY)
                finally:
                    os.close(fd)
            self._maps[path] = m
            while len(self._maps) > self.limit:
                self._maps.popitem(last=False)  # unmapped once no tensor views it any more
            return m

    def release(self, path: tuple) -> None:
        """Forget `path`: its descriptor is closed (now, or by its last user) and its map dropped (tensors that
        view it keep it alive)."""
        with self._lock:
            entry = self._fds.pop(path, None)
            if entry is not None and entry[1] == 0:
                os.close(entry[0])
            self._maps.pop(path, None)

    def open_count(self) -> int:
        with self._lock:
            return len(self._fds)


MAX_OPEN_FILES = int(os.environ.get("DFLASH_HIDDEN_MAX_OPEN_FILES", "64"))
_OPEN = _OpenFiles(MAX_OPEN_FILES)


class _LocalSource:
    def __init__(self, path: str):
        self.path = os.path.abspath(path)
        self.key = file_key(self.path)
        self.size = self.key[-1]

    def read(self, offset: int, length: int) -> bytes:
        with _OPEN.reading(self.key) as fd:
            parts, got = [], 0
            while got < length:  # pread may return less than asked for (large reads): read on
                chunk = os.pread(fd, length - got, offset + got)
                if not chunk:
                    break
                parts.append(chunk)
                got += len(chunk)
            return parts[0] if len(parts) == 1 else b"".join(parts)

    def view(self, offset: int, length: int) -> memoryview:
        return memoryview(_OPEN.map(self.key))[offset: offset + length]

    def close(self):
        _OPEN.release(self.key)


_S3_CLIENTS: dict = {}
_S3_LOCK = threading.Lock()


def _shared_s3_client():
    """One boto3 client per endpoint and process (clients are thread-safe; readers on thousands of
    shards share it instead of building one each)."""
    key = (os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("SNAKEMAKE_STORAGE_S3_ENDPOINT_URL"), os.getpid())
    with _S3_LOCK:
        if key not in _S3_CLIENTS:
            _S3_CLIENTS[key] = storage.s3_client()
        return _S3_CLIENTS[key]


class _S3Source:
    def __init__(self, uri: str):
        self.uri = uri
        self.bucket, self.key = storage.split_s3(uri)
        self.client = _shared_s3_client()
        self.size = self._call(self.client.head_object, Bucket=self.bucket, Key=self.key)["ContentLength"]

    def _call(self, method, **kwargs):
        try:
            return method(**kwargs)
        except Exception as exc:  # noqa: BLE001 - botocore's errors become one line naming the object
            if storage.is_botocore_error(exc):
                raise storage.s3_error(self.uri, exc) from exc
            raise

    def read(self, offset: int, length: int) -> bytes:
        if length <= 0:
            return b""
        r = self._call(self.client.get_object, Bucket=self.bucket, Key=self.key,
                       Range=f"bytes={offset}-{offset + length - 1}")
        return r["Body"].read()

    view = None

    def close(self):
        pass


def _is_count(x, limit: int) -> bool:
    return type(x) is int and 0 < x <= limit


class HiddenStateShardReader:
    """Random access to one shard (a local path or an s3:// URI, read with ranged GETs).

    `read(i)` returns dict(sample_id, input_ids np.int32[T], loss_mask np.uint8[T],
    hidden torch.Tensor[T, n_layers, H]) in the stored dtype (bf16 or fp32; fp8 shards decode to bf16).
    `verify` checks each record's CRC-32 before decoding (a corrupted sample raises ShardFormatError).
    """

    def __init__(self, path: str | os.PathLike, verify: bool = True, mmap: bool = True):
        self.path = str(path)
        self.verify = verify
        self._src = _S3Source(self.path) if storage.is_s3(self.path) else _LocalSource(self.path)
        try:
            self._load_index()
        except BaseException:
            self._src.close()
            raise
        # memory-map uncompressed local shards (a sample's tensor is a view); others are read with pread
        self._mmap = mmap and self._src.view is not None and self.codec["codec"] == "raw"
        self._dctx = threading.local()

    def _fail(self, why: str):
        raise ShardFormatError(f"{self.path}: {why}; the file is damaged: delete it and rerun the extract stage")

    # -- the index
    def _load_index(self) -> None:
        index_offset, index_length, index_crc, raw_claim = self._read_footer()
        blob = self._src.read(index_offset, index_length)
        if zlib.crc32(blob) & 0xFFFFFFFF != index_crc:
            self._fail("index checksum mismatch")
        limit = raw_claim or index_limit(self._src.size)
        try:
            text = bounded_decompress(zstandard.ZstdDecompressor(), blob, limit)
            index = json.loads(text)
        except ShardFormatError as exc:
            self._fail(f"index: {exc}")
        except (ValueError, RecursionError) as exc:
            self._fail(f"index is not JSON ({type(exc).__name__}: {exc})")
        if raw_claim and len(text) != raw_claim:
            self._fail(f"index decompresses to {len(text)} bytes, the header says {raw_claim}")
        self._take_index(index, index_offset)

    def _read_footer(self) -> tuple[int, int, int, int]:
        """(index offset, index length, index CRC-32, the index's decompressed length or 0), all checked."""
        size = self._src.size
        if size < HEADER_SIZE + FOOTER.size:
            self._fail(f"only {size} bytes, too short to be a hidden-state shard (truncated?)")
        magic, _, _, raw_claim = HEADER.unpack(self._src.read(0, HEADER.size))
        if magic != MAGIC:
            self._fail("not a hidden-state shard (bad magic)")
        index_offset, index_length, index_crc, version, magic = FOOTER.unpack(
            self._src.read(size - FOOTER.size, FOOTER.size))
        if magic != FOOTER_MAGIC:
            self._fail("no footer (truncated or still being written)")
        if version != VERSION:
            self._fail(f"format version {version}, this reader knows {VERSION}")
        if index_offset < HEADER_SIZE or index_offset + index_length + FOOTER.size != size:
            self._fail(f"index at {index_offset}+{index_length} does not end at the footer (size {size})")
        if raw_claim > index_limit(size):
            self._fail(f"the header says the index decompresses to {raw_claim} bytes, more than the "
                       f"{index_limit(size)} a {size}-byte shard may have")
        return index_offset, index_length, index_crc, raw_claim

    def _take_index(self, index, data_end: int) -> None:
        try:
            self.metadata: dict = index["metadata"]
            self.codec: dict = index["codec"]
            cols = index["samples"]
            columns = [cols[c] for c in INDEX_COLUMNS]
            dtype, codec = self.metadata["dtype"], self.codec["codec"]
            layers, hidden = self.metadata["num_feature_layers"], self.metadata["hidden_size"]
        except (KeyError, TypeError) as exc:
            self._fail(f"index lacks {exc}")
        if dtype not in STORED_DTYPES or codec not in CODECS:
            self._fail(f"index names dtype {dtype!r} and codec {codec!r}")
        if not (_is_count(layers, MAX_FEATURE_LAYERS) and _is_count(hidden, MAX_HIDDEN_SIZE)):
            self._fail(f"index states {layers!r} layers of hidden size {hidden!r}")
        if not all(isinstance(c, list) for c in columns) or len({len(c) for c in columns}) != 1:
            self._fail("index columns are not lists of one length")
        self.sample_ids, self._offsets, self._lengths, self._tokens, self._crc, self._sections = columns
        for o, n in zip(self._offsets, self._lengths):
            if type(o) is not int or type(n) is not int or o < HEADER_SIZE or n < 0 or o + n > data_end:
                self._fail("a record lies outside the shard's data")
        self._pos = {s: i for i, s in enumerate(self.sample_ids)}
        if len(self._pos) != len(self.sample_ids):
            self._fail("index repeats a sample id")
        self.num_layers_stored, self.hidden_size = layers, hidden

    def _check_record(self, i: int) -> list[tuple[int, int, int]]:
        """Record i's sections, checked against the record and the shape the index states (before any read)."""
        name = f"sample {i} ({self.sample_ids[i]})"
        t, sections, length = self._tokens[i], self._sections[i], self._lengths[i]
        if type(t) is not int or t < 0 or 5 * t > length:
            self._fail(f"{name}: {t!r} tokens do not fit its {length}-byte record")
        codec, dtype = self.codec["codec"], self.metadata["dtype"]
        want = expected_raw_lengths(codec, dtype, t, self.num_layers_stored, self.hidden_size)
        try:
            secs = [(int(o), int(n), int(r)) for o, n, r in sections]
        except (TypeError, ValueError):
            self._fail(f"{name}: malformed section table")
        if [r for _, _, r in secs] != want:
            self._fail(f"{name}: sections claim {[r for _, _, r in secs]} bytes, its shape needs {want}")
        for (o, n, r), raw_only in zip(secs, always_stored_raw(codec, len(secs))):
            if o < 0 or n < 0 or o + n > length or n > r or (raw_only and n != r):
                self._fail(f"{name}: a section ({o}+{n} of {r} bytes) lies outside its record")
            if n < r and r > max(EXPANSION_FLOOR, MAX_EXPANSION * n):
                self._fail(f"{name}: a {n}-byte section claims to decompress to {r} bytes "
                           f"(more than {MAX_EXPANSION}x)")
        return secs

    # -- samples
    def __len__(self) -> int:
        return len(self.sample_ids)

    @property
    def num_tokens(self) -> list[int]:
        return list(self._tokens)

    def index_of(self, sample_id: str) -> int:
        return self._pos[sample_id]

    def _decompress(self, data, raw_len: int) -> bytes:
        if len(data) == raw_len:
            return data
        d = getattr(self._dctx, "d", None)
        if d is None:
            d = self._dctx.d = zstandard.ZstdDecompressor()
        try:
            out = bounded_decompress(d, data, raw_len)
        except ShardFormatError as exc:
            self._fail(f"undecodable section: {exc}")
        if len(out) != raw_len:
            self._fail(f"section decodes to {len(out)} bytes, expected {raw_len}")
        return out

    def read_raw(self, i: int) -> memoryview:
        """The stored bytes of record i (sections checked; checksum verified when `verify`)."""
        self._check_record(i)
        off, n = self._offsets[i], self._lengths[i]
        if self._mmap:
            data = self._src.view(off, n)
        else:
            data = memoryview(self._src.read(off, n))
        if len(data) != n:
            self._fail(f"sample {i} ({self.sample_ids[i]}): record cut short ({len(data)} of {n} bytes)")
        if self.verify and zlib.crc32(data) & 0xFFFFFFFF != self._crc[i]:
            self._fail(f"sample {i} ({self.sample_ids[i]}): checksum mismatch")
        return data

    def read(self, i: int) -> dict:
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample {i} out of range for a shard of {len(self)}")
        i %= len(self)
        data = self.read_raw(i)
        secs = [(data[o: o + n], r) for o, n, r in self._sections[i]]
        t = self._tokens[i]
        hidden = decode_hidden(self.codec["codec"], self.metadata["dtype"], secs,
                               (t, self.num_layers_stored, self.hidden_size), self._decompress, mapped=self._mmap)
        ids = np.frombuffer(secs[-2][0], dtype=np.int32)
        mask = np.frombuffer(secs[-1][0], dtype=np.uint8)
        return {"sample_id": self.sample_ids[i], "input_ids": ids.copy(), "loss_mask": mask.copy(), "hidden": hidden}

    def __getitem__(self, i: int) -> dict:
        return self.read(i)

    def __iter__(self) -> Iterator[dict]:
        for i in range(len(self)):
            yield self.read(i)

    def verify_all(self) -> int:
        """Check every record's sections and checksum; returns the number of samples."""
        for i in range(len(self)):
            self.read_raw(i)
        return len(self)

    def close(self) -> None:
        """Give back the file's descriptor and map (the reader reopens them if read again)."""
        self._src.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
