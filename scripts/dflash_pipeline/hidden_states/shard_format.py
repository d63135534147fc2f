"""The hidden-state shard format: one file per shard, random access per sample, checksummed, no pickle.

A shard file holds, for each sample, the target's hidden states at the drafter's `target_layer_ids`
(`hidden[T, n_layers, H]`), the sample's `input_ids` and its `loss_mask`, so a shard is self-contained.

Layout (all integers little-endian)::

    header   64 bytes: b"DFLASHHS" | u32 version | u32 header_size (64) | zero padding
    records  one per sample, each starting at a 64-byte aligned offset (see "record sections")
    index    zstd-compressed JSON: {"metadata": {...}, "codec": {...}, "samples": {column: [...]}}
    footer   32 bytes: u64 index_offset | u64 index_length | u32 crc32(index) | u32 version | b"HSEND001"

A reader fetches the footer (one ranged GET on S3), then the index, then any sample by its offset and
length. Every record carries a CRC-32 of its stored bytes and the index one of its own, so a truncated file
(no valid footer) or a flipped byte raises `ShardFormatError` naming the file and sample instead of
feeding garbage to training.

Codecs (`codec` in the metadata; chosen per shard):

* ``raw``: the hidden states as stored dtype bytes (bf16 or fp32), uncompressed, 64-byte aligned; a
  local file is memory-mapped and a sample's tensor is a view of the map (no read of other samples).
* ``zstd`` (lossless, bit-exact): each value's bits are rotated left by one so the sign bit leaves the
  top byte, then split into byte planes. The top plane holds the 8 exponent bits (a few bits of entropy)
  and is compressed with zstandard at the configured level; the mantissa planes are close to random and
  are stored raw (unless `compress_mantissa`), which keeps writing fast.
* ``fp8`` (lossy): float8 e4m3 values with one fp32 scale per row (per token and layer: amax / 448),
  the fp8 bytes zstd-compressed at the level (0 = stored raw). Read back as bf16.

Record sections, in order, each at an offset relative to the record start given by the index column
`sections` (a list of [offset, stored_length, raw_length] per section; stored_length == raw_length means
stored uncompressed):

* raw:  hidden, input_ids (int32[T]), loss_mask (uint8[T])
* zstd: plane 0 .. plane itemsize-1 (plane itemsize-1 = exponent), input_ids, loss_mask
* fp8:  scales (float32[T, n_layers]), values (fp8 bytes), input_ids, loss_mask

Writing is resumable: `HiddenStateShardWriter(path, ..., resume=True)` appends records to
`path + ".partial"` and, on each `flush()`, fsyncs it and appends the new index entries to
`path + ".journal"` (one JSON line per flush, with its own CRC). After a kill a new writer truncates the
partial file to the last journaled record and reports `completed_ids`; `close()` writes index and footer
and renames the partial file into place, so the final name only ever holds a complete file.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import queue
import random
import struct
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np
import zstandard

from dflash_pipeline import storage
from dflash_pipeline.errors import PipelineError

MAGIC = b"DFLASHHS"
FOOTER_MAGIC = b"HSEND001"
VERSION = 1
HEADER_SIZE = 64
FOOTER = struct.Struct("<QQII8s")  # index_offset, index_length, index_crc32, version, magic
ALIGN = 64
CODECS = ("raw", "zstd", "fp8")
STORED_DTYPES = ("bfloat16", "float32")
FP8_MAX = 448.0
FILE_EXTENSION = ".dfhs"  # "DFlash hidden states"

_INDEX_COLUMNS = ("sample_ids", "offsets", "lengths", "num_tokens", "crc32", "sections")


class ShardFormatError(PipelineError):
    """A hidden-state shard is truncated, corrupted, or not a shard at all."""


def _itemsize(dtype: str) -> int:
    return {"bfloat16": 2, "float32": 4}[dtype]


def _uint_dtype(dtype: str):
    return {"bfloat16": np.uint16, "float32": np.uint32}[dtype]


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


# ---------------------------------------------------------------------------------------------- encoding


def split_planes(bits: np.ndarray) -> np.ndarray:
    """uint16/uint32 values -> byte planes [itemsize, N] after rotating the sign bit to the bottom.

    Plane itemsize-1 then holds the exponent bits only (for bf16 and fp32 alike).
    """
    bits = np.ascontiguousarray(bits).reshape(-1)
    t = bits.dtype.type
    item = bits.dtype.itemsize
    rot = bits << t(1)
    rot |= bits >> t(item * 8 - 1)
    planes = np.empty((item, bits.size), dtype=np.uint8)
    for k in range(item):  # whole-array shifts and truncating copies: no strided transpose
        planes[k] = rot
        if k < item - 1:
            rot >>= t(8)
    return planes


def merge_planes(planes, uint_dtype) -> np.ndarray:
    """Inverse of `split_planes`: byte planes (a sequence of itemsize uint8 arrays) -> uint values [N]."""
    t = np.dtype(uint_dtype).type
    item = np.dtype(uint_dtype).itemsize
    rot = np.asarray(planes[item - 1]).astype(uint_dtype)
    for k in range(item - 2, -1, -1):
        rot <<= t(8)
        rot |= np.asarray(planes[k])
    out = rot >> t(1)
    rot <<= t(item * 8 - 1)
    out |= rot
    return out


def _hidden_bits(hidden, dtype: str) -> np.ndarray:
    """A tensor/array [T, L, H] -> its raw bits in the stored dtype as a uint numpy array (no copy if possible)."""
    import torch

    if isinstance(hidden, np.ndarray):
        if hidden.dtype == _uint_dtype(dtype):
            return hidden
        if dtype == "float32":
            return np.ascontiguousarray(hidden, dtype=np.float32).view(np.uint32)
        hidden = torch.from_numpy(np.ascontiguousarray(hidden))
    want = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    t = hidden.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.to(want).contiguous()
    return t.view(torch.int16 if dtype == "bfloat16" else torch.int32).numpy().view(_uint_dtype(dtype))


def quantize_fp8(hidden):
    """[T, L, H] float tensor -> (fp8 e4m3 bytes as uint8 numpy [T, L, H], fp32 scales [T, L]). Works on GPU too."""
    import torch

    x = hidden.float() if hidden.dtype != torch.float32 else hidden
    amax = x.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (x / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(torch.uint8), scale.squeeze(-1)


def dequantize_fp8(q: np.ndarray, scales: np.ndarray, out_dtype=None):
    import torch

    out_dtype = out_dtype or torch.bfloat16
    q = q if q.flags.writeable else q.copy()
    scales = scales if scales.flags.writeable else scales.copy()
    qt = torch.from_numpy(q).view(torch.float8_e4m3fn).float()
    return (qt * torch.from_numpy(scales).unsqueeze(-1)).to(out_dtype)


@dataclass
class EncodedSample:
    """A sample ready to write: its stored sections (bytes-like) and their raw lengths."""

    sample_id: str
    num_tokens: int
    sections: list  # list of (payload bytes-like, raw_length)
    crc32: int = -1  # of the stored bytes; computed by encode() so that worker threads share the work


class Codec:
    """Encodes samples for one shard. Thread-safe: a zstd compressor per thread."""

    def __init__(self, codec: str = "zstd", level: int = 3, dtype: str = "bfloat16",
                 compress_mantissa: bool = False):
        if codec not in CODECS:
            raise PipelineError(f"unknown hidden-state codec {codec!r}; choose one of {', '.join(CODECS)}")
        if dtype not in STORED_DTYPES:
            raise PipelineError(f"unknown stored dtype {dtype!r}; choose one of {', '.join(STORED_DTYPES)}")
        self.codec, self.level, self.dtype, self.compress_mantissa = codec, int(level), dtype, compress_mantissa
        self._local = threading.local()

    def describe(self) -> dict:
        return {"codec": self.codec, "level": self.level, "dtype": self.dtype,
                "compress_mantissa": self.compress_mantissa}

    def _zstd(self, data) -> bytes:
        c = getattr(self._local, "c", None)
        if c is None:
            c = self._local.c = zstandard.ZstdCompressor(level=self.level)
        return c.compress(data)

    def _maybe_compress(self, data, force: bool = True):
        raw = memoryview(data).cast("B")
        if not force or self.level <= 0:
            return raw, len(raw)
        z = self._zstd(raw)
        return (z, len(raw)) if len(z) < len(raw) else (raw, len(raw))

    def encode(self, sample_id: str, input_ids, loss_mask, hidden=None, *, planes: np.ndarray | None = None,
               fp8: tuple | None = None) -> EncodedSample:
        """Encode one sample. `hidden` is [T, L, H] (torch or numpy); extraction may instead pass
        precomputed byte `planes` ([itemsize, T*L*H] uint8, from `split_planes` or its GPU twin) for the
        zstd codec, or `fp8=(q uint8 [T, L, H], scales float32 [T, L])` for the fp8 codec."""
        ids = np.ascontiguousarray(np.asarray(input_ids, dtype=np.int32).reshape(-1))
        mask = np.ascontiguousarray(np.asarray(loss_mask, dtype=np.uint8).reshape(-1))
        t = len(ids)
        if len(mask) != t:
            raise PipelineError(f"sample {sample_id}: input_ids has {t} tokens but loss_mask {len(mask)}")
        tail = [(ids, ids.nbytes), (mask, mask.nbytes)]
        if self.codec == "raw":
            bits = _hidden_bits(hidden, self.dtype)
            sections = [(bits, bits.nbytes)]
        elif self.codec == "zstd":
            if planes is None:
                planes = split_planes(_hidden_bits(hidden, self.dtype))
            n = planes.shape[0]
            sections = [self._maybe_compress(planes[k], force=(k == n - 1 or self.compress_mantissa))
                        for k in range(n)]
        else:
            if fp8 is None:
                import torch

                h = hidden if not isinstance(hidden, np.ndarray) else torch.from_numpy(hidden)
                q, s = quantize_fp8(h)
                fp8 = (q.cpu().numpy(), s.cpu().numpy())
            q, s = fp8
            s = np.ascontiguousarray(s, dtype=np.float32)
            sections = [(s, s.nbytes), self._maybe_compress(np.ascontiguousarray(q))]
        sections = sections + tail
        return EncodedSample(str(sample_id), t, sections, _crc_chain(memoryview(p).cast("B") for p, _ in sections))


# ---------------------------------------------------------------------------------------------- writer


def _crc_chain(parts) -> int:
    crc = 0
    for p in parts:
        crc = zlib.crc32(p, crc)
    return crc & 0xFFFFFFFF


class HiddenStateShardWriter:
    """Writes one shard file; `add()` samples (or `add_encoded()` from a worker pool), then `close()`.

    metadata: a JSON-able dict; must contain target_layer_ids, hidden_size, num_layers (of the target) and
    model_path (stored as given). `dtype` and the codec settings are added.
    """

    def __init__(self, path: str | os.PathLike, metadata: dict, codec: str = "zstd", level: int = 3,
                 dtype: str = "bfloat16", compress_mantissa: bool = False, resume: bool = False):
        self.path = Path(path)
        self.codec = Codec(codec, level, dtype, compress_mantissa)
        self.metadata = dict(metadata)
        for key in ("target_layer_ids", "hidden_size"):
            if key not in self.metadata:
                raise PipelineError(f"hidden-state shard metadata needs {key!r}")
        self.metadata["dtype"] = dtype
        self.metadata["num_feature_layers"] = len(self.metadata["target_layer_ids"])
        self.partial = Path(str(self.path) + ".partial")
        self.journal = Path(str(self.path) + ".journal")
        self._cols: dict[str, list] = {c: [] for c in _INDEX_COLUMNS}
        self._journaled = 0
        self._queued = 0  # entries handed to a flush (journaled once it completes)
        self._syncer = None
        self._pending: list = []
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._header_line = json.dumps({"metadata": self.metadata, "codec": self.codec.describe()},
                                       sort_keys=True)
        if not (resume and self._resume()):
            self._start()
        self._closed = False

    # -- resume
    def _start(self) -> None:
        self._fh = open(self.partial, "wb")
        self._fh.write(MAGIC + struct.pack("<II", VERSION, HEADER_SIZE) + bytes(HEADER_SIZE - 16))
        self._pos = HEADER_SIZE
        self._journal_fh = open(self.journal, "w", encoding="utf-8")
        self._write_journal_line(self._header_line)

    def _write_journal_line(self, text: str) -> None:
        crc = zlib.crc32(text.encode()) & 0xFFFFFFFF
        self._journal_fh.write(f"{crc:08x} {text}\n")
        self._journal_fh.flush()
        os.fsync(self._journal_fh.fileno())

    def _resume(self) -> bool:
        if not (self.partial.exists() and self.journal.exists()):
            return False
        lines = []
        with open(self.journal, encoding="utf-8") as fh:
            for line in fh:
                if not line.endswith("\n"):
                    break  # torn last line
                crc, _, text = line.rstrip("\n").partition(" ")
                try:
                    ok = int(crc, 16) == zlib.crc32(text.encode()) & 0xFFFFFFFF
                except ValueError:
                    ok = False
                if not ok:
                    break
                lines.append(text)
        if not lines or lines[0] != self._header_line:
            return False  # different settings or nothing usable: start over
        end = HEADER_SIZE
        for text in lines[1:]:
            entries = json.loads(text)
            for c in _INDEX_COLUMNS:
                self._cols[c].extend(entries[c])
        if self._cols["offsets"]:
            end = _align(self._cols["offsets"][-1] + self._cols["lengths"][-1])
        if self.partial.stat().st_size < end:
            self._cols = {c: [] for c in _INDEX_COLUMNS}
            return False
        self._fh = open(self.partial, "r+b")
        self._fh.truncate(end)
        self._fh.seek(end)
        self._pos = end
        self._journaled = self._queued = len(self._cols["offsets"])
        # rewrite the journal without any torn tail
        self._journal_fh = open(self.journal, "a", encoding="utf-8")
        self._journal_fh.seek(0)
        self._journal_fh.truncate(0)
        self._write_journal_line(self._header_line)
        if self._journaled:
            self._write_journal_line(json.dumps({c: self._cols[c] for c in _INDEX_COLUMNS}))
        return True

    @property
    def completed_ids(self) -> set[str]:
        """Samples durably written (journaled); after a resume these are the ones to skip."""
        return set(self._cols["sample_ids"][: self._journaled])

    def __len__(self) -> int:
        return len(self._cols["sample_ids"])

    # -- writing
    def encode(self, *args, **kwargs) -> EncodedSample:
        return self.codec.encode(*args, **kwargs)

    def add(self, sample_id: str, input_ids, loss_mask, hidden=None, **kwargs) -> None:
        self.add_encoded(self.codec.encode(sample_id, input_ids, loss_mask, hidden, **kwargs))

    def add_encoded(self, enc: EncodedSample) -> None:
        if self._closed:
            raise PipelineError("writer is closed")
        offset = self._pos
        rel = 0
        sections = []
        parts = []
        for payload, raw_len in enc.sections:
            mv = memoryview(payload).cast("B")
            sections.append([rel, len(mv), raw_len])
            parts.append(mv)
            rel += len(mv)
        crc = enc.crc32 if enc.crc32 >= 0 else _crc_chain(parts)
        for mv in parts:
            self._fh.write(mv)
        pad = _align(offset + rel) - (offset + rel)
        if pad:
            self._fh.write(bytes(pad))
        self._pos = offset + rel + pad
        for c, v in zip(_INDEX_COLUMNS, (enc.sample_id, offset, rel, enc.num_tokens, crc, sections)):
            self._cols[c].append(v)

    def flush(self, background: bool = False) -> None:
        """Make everything added so far durable and resumable. With `background`, the fsync and the
        journal line happen in a helper thread while the caller keeps appending (an fsync covers at least
        the bytes written before it started); `close()` waits for it."""
        self._fh.flush()
        n = len(self)
        if n <= self._queued:
            return
        new = {c: list(self._cols[c][self._queued:n]) for c in _INDEX_COLUMNS}
        self._queued = n
        if not background:
            while self._pending:  # journal lines stay in order: earlier background syncs first
                self._pending.pop(0).result()
            self._sync(new, n)
            return
        if self._syncer is None:
            import concurrent.futures as cf

            self._syncer = cf.ThreadPoolExecutor(1, thread_name_prefix="fsync")
        self._pending.append(self._syncer.submit(self._sync, new, n))
        while self._pending and self._pending[0].done():
            self._pending.pop(0).result()

    def _sync(self, new: dict, n: int) -> None:
        os.fsync(self._fh.fileno())
        self._write_journal_line(json.dumps(new))
        self._journaled = n

    def _wait_syncs(self) -> None:
        while self._pending:
            self._pending.pop(0).result()
        if self._syncer is not None:
            self._syncer.shutdown(wait=True)
            self._syncer = None

    def close(self) -> None:
        if self._closed:
            return
        self._fh.flush()
        self._wait_syncs()
        ids = self._cols["sample_ids"]
        if len(set(ids)) != len(ids):
            raise PipelineError(f"{self.path}: duplicate sample ids in shard")
        index = {"metadata": self.metadata, "codec": self.codec.describe(),
                 "samples": {c: self._cols[c] for c in _INDEX_COLUMNS}}
        blob = zstandard.ZstdCompressor(level=3).compress(json.dumps(index).encode())
        self._fh.write(blob)
        self._fh.write(FOOTER.pack(self._pos, len(blob), zlib.crc32(blob) & 0xFFFFFFFF, VERSION, FOOTER_MAGIC))
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        self._journal_fh.close()
        os.replace(self.partial, self.path)
        self.journal.unlink(missing_ok=True)
        self._closed = True

    def abort(self) -> None:
        """Close the files without finishing (the partial file and journal stay for a resume)."""
        if not self._closed:
            try:
                self._fh.flush()
                self._wait_syncs()
            finally:
                self._fh.close()
                self._journal_fh.close()
            self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        if exc_type is None:
            self.close()
        else:
            self.abort()


def write_shard(path, samples: Iterable[dict], metadata: dict, codec: str = "zstd", level: int = 3,
                dtype: str = "bfloat16") -> None:
    """Write dicts (sample_id, input_ids, loss_mask, hidden) to a new shard file."""
    with HiddenStateShardWriter(path, metadata, codec=codec, level=level, dtype=dtype) as w:
        for s in samples:
            w.add(s["sample_id"], s["input_ids"], s["loss_mask"], s["hidden"])


# ---------------------------------------------------------------------------------------------- reader


class _OpenFiles:
    """A process-wide LRU of open shard files, so that a training job holding readers on thousands of
    shards keeps at most `MAX_OPEN_FILES` descriptors (and maps) open. Reads use pread: no seek, no lock."""

    def __init__(self, limit: int):
        import collections

        self.limit = limit
        self._fds: collections.OrderedDict = collections.OrderedDict()
        self._maps: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def reading(self, path: str):
        """An open descriptor of `path`, not closed by eviction while in use."""
        with self._lock:
            entry = self._fds.pop(path, None)
            if entry is None:
                entry = [os.open(path, os.O_RDONLY), 0]
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

    def _evict(self) -> None:
        excess = len(self._fds) - self.limit
        for p in list(self._fds):
            if excess <= 0:
                break
            fd, users = self._fds[p]
            del self._fds[p]
            excess -= 1
            if users == 0:
                os.close(fd)

    def map(self, path: str):
        import mmap

        with self._lock:
            m = self._maps.pop(path, None)
            if m is None:
                with open(path, "rb") as fh:
                    # copy-on-write map: tensors built on it are writable views that never touch the file
                    m = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
            self._maps[path] = m
            while len(self._maps) > self.limit:
                self._maps.popitem(last=False)  # unmapped once no tensor views it any more
            return m

    def open_count(self) -> int:
        with self._lock:
            return len(self._fds)


MAX_OPEN_FILES = int(os.environ.get("DFLASH_HIDDEN_MAX_OPEN_FILES", "64"))
_OPEN = _OpenFiles(MAX_OPEN_FILES)


class _LocalSource:
    def __init__(self, path: str):
        self.path = os.path.abspath(path)
        self.size = os.path.getsize(self.path)

    def read(self, offset: int, length: int) -> bytes:
        with _OPEN.reading(self.path) as fd:
            data = os.pread(fd, length, offset)
            if len(data) >= length or not data:
                return data
            parts = [data]  # pread may return less than asked for (large reads): read on
            got = len(data)
            while got < length:
                chunk = os.pread(fd, length - got, offset + got)
                if not chunk:
                    break
                parts.append(chunk)
                got += len(chunk)
            return b"".join(parts)

    def view(self, offset: int, length: int) -> memoryview:
        return memoryview(_OPEN.map(self.path))[offset: offset + length]

    def close(self):
        pass


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
        self.size = self.client.head_object(Bucket=self.bucket, Key=self.key)["ContentLength"]

    def read(self, offset: int, length: int) -> bytes:
        if length <= 0:
            return b""
        r = self.client.get_object(Bucket=self.bucket, Key=self.key, Range=f"bytes={offset}-{offset + length - 1}")
        return r["Body"].read()

    view = None

    def close(self):
        pass


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
        self._load_index()
        # memory-map uncompressed local shards (a sample's tensor is a view); others are read with pread
        self._mmap = mmap and self._src.view is not None and self.codec["codec"] == "raw"

    def _fail(self, why: str):
        raise ShardFormatError(f"{self.path}: {why}; the file is damaged: delete it and rerun the extract stage")

    def _load_index(self):
        size = self._src.size
        if size < HEADER_SIZE + FOOTER.size:
            self._fail(f"only {size} bytes, too short to be a hidden-state shard (truncated?)")
        head = self._src.read(0, 16)
        if head[:8] != MAGIC:
            self._fail("not a hidden-state shard (bad magic)")
        index_offset, index_length, index_crc, version, magic = FOOTER.unpack(
            self._src.read(size - FOOTER.size, FOOTER.size))
        if magic != FOOTER_MAGIC:
            self._fail("no footer (truncated or still being written)")
        if version != VERSION:
            self._fail(f"format version {version}, this reader knows {VERSION}")
        if index_offset + index_length + FOOTER.size != size:
            self._fail(f"index at {index_offset}+{index_length} does not end at the footer (size {size})")
        blob = self._src.read(index_offset, index_length)
        if zlib.crc32(blob) & 0xFFFFFFFF != index_crc:
            self._fail("index checksum mismatch")
        index = json.loads(zstandard.ZstdDecompressor().decompress(blob))
        self.metadata: dict = index["metadata"]
        self.codec: dict = index["codec"]
        cols = index["samples"]
        self.sample_ids: list[str] = cols["sample_ids"]
        self._offsets, self._lengths = cols["offsets"], cols["lengths"]
        self._tokens, self._crc, self._sections = cols["num_tokens"], cols["crc32"], cols["sections"]
        for o, n in zip(self._offsets, self._lengths):
            if o + n > index_offset:
                self._fail("a record extends past the index")
        self._pos = {s: i for i, s in enumerate(self.sample_ids)}
        self.num_layers_stored = int(self.metadata["num_feature_layers"])
        self.hidden_size = int(self.metadata["hidden_size"])
        self._dctx = threading.local()

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
            out = d.decompress(data, max_output_size=raw_len)
        except zstandard.ZstdError as exc:
            self._fail(f"undecodable section: {exc}")
        if len(out) != raw_len:
            self._fail(f"section decodes to {len(out)} bytes, expected {raw_len}")
        return out

    def read_raw(self, i: int) -> memoryview:
        """The stored bytes of record i (checksum verified when `verify`)."""
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
        import torch

        if not -len(self) <= i < len(self):
            raise IndexError(f"sample {i} out of range for a shard of {len(self)}")
        i %= len(self)
        data = self.read_raw(i)
        t, L, H = self._tokens[i], self.num_layers_stored, self.hidden_size
        secs = [data[o: o + n] for o, n, _ in self._sections[i]]
        raws = [r for _, _, r in self._sections[i]]
        ids = np.frombuffer(secs[-2], dtype=np.int32)
        mask = np.frombuffer(secs[-1], dtype=np.uint8)
        dtype = self.metadata["dtype"]
        codec = self.codec["codec"]
        if codec == "raw":
            tdt = torch.bfloat16 if dtype == "bfloat16" else torch.float32
            buf = secs[0] if self._mmap else bytearray(secs[0])
            hidden = torch.frombuffer(buf, dtype=tdt).view(t, L, H)
        elif codec == "zstd":
            item = _itemsize(dtype)
            planes = [np.frombuffer(self._decompress(secs[k], raws[k]), dtype=np.uint8) for k in range(item)]
            bits = merge_planes(planes, _uint_dtype(dtype))
            tdt, idt = (torch.bfloat16, torch.int16) if dtype == "bfloat16" else (torch.float32, torch.int32)
            hidden = torch.from_numpy(bits.view(np.int16 if item == 2 else np.int32)).view(tdt).view(t, L, H)
        else:
            scales = np.frombuffer(secs[0], dtype=np.float32).reshape(t, L)
            q = np.frombuffer(self._decompress(secs[1], raws[1]), dtype=np.uint8).reshape(t, L, H)
            hidden = dequantize_fp8(q, scales)
        if len(ids) != t or hidden.shape != (t, L, H):
            self._fail(f"sample {i}: sections do not match the index")
        return {"sample_id": self.sample_ids[i], "input_ids": ids.copy(), "loss_mask": mask.copy(), "hidden": hidden}

    def __getitem__(self, i: int) -> dict:
        return self.read(i)

    def __iter__(self) -> Iterator[dict]:
        for i in range(len(self)):
            yield self.read(i)

    def verify_all(self) -> int:
        """Check every record's checksum; returns the number of samples."""
        for i in range(len(self)):
            self.read_raw(i)
        return len(self)

    def close(self) -> None:
        self._src.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def iter_shard_samples(paths: Sequence[str], seed: int | None = None, prefetch: int = 4,
                       verify: bool = True, workers: int = 4) -> Iterator[dict]:
    """Stream samples of several shards (local or s3://), decoded by background threads `prefetch` ahead.

    seed=None: shards in the given order, samples in file order. With a seed, the shard order and the
    order inside each shard are shuffled (deterministically for that seed). Errors in a background thread
    are raised in the caller.
    """
    rng = random.Random(seed)
    paths = [str(p) for p in paths]
    order = list(paths)
    if seed is not None:
        rng.shuffle(order)
    prefetch = max(1, int(prefetch))

    def plan():
        for path in order:
            reader = HiddenStateShardReader(path, verify=verify)
            idx = list(range(len(reader)))
            if seed is not None:
                rng.shuffle(idx)
            for i in idx:
                yield reader, i

    jobs = plan()
    lock = threading.Lock()
    out: queue.Queue = queue.Queue(maxsize=prefetch)
    # tickets keep the output in plan order even with several decoding threads
    tickets: dict[int, object] = {}
    cond = threading.Condition()
    state = {"next_job": 0, "stop": False}
    _DONE, _ERR = object(), object()

    def worker():
        while True:
            with lock:
                if state["stop"]:
                    return
                try:
                    reader, i = next(jobs)
                    n = state["next_job"]
                    state["next_job"] += 1
                except StopIteration:
                    state["stop"] = True
                    n = state["next_job"]
                    with cond:
                        tickets[n] = (_DONE, None)
                        cond.notify_all()
                    return
                except BaseException as exc:  # opening a shard failed
                    state["stop"] = True
                    n = state["next_job"]
                    with cond:
                        tickets[n] = (_ERR, exc)
                        cond.notify_all()
                    return
            try:
                item = (None, reader.read(i))
            except BaseException as exc:
                item = (_ERR, exc)
            with cond:
                while n - consumed[0] >= prefetch and not closed[0]:
                    cond.wait()
                if closed[0]:
                    return
                tickets[n] = item
                cond.notify_all()

    consumed = [0]
    closed = [False]
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(max(1, workers))]
    for th in threads:
        th.start()
    try:
        while True:
            with cond:
                while consumed[0] not in tickets:
                    cond.wait()
                kind, value = tickets.pop(consumed[0])
                consumed[0] += 1
                cond.notify_all()
            if kind is _DONE:
                return
            if kind is _ERR:
                raise value
            yield value
    finally:
        with cond:
            closed[0] = True
            state["stop"] = True
            cond.notify_all()


def shard_summary(path: str) -> dict:
    """Samples, tokens and bytes of one shard (for plans and logs)."""
    with HiddenStateShardReader(path, verify=False) as r:
        tokens = sum(r._tokens)
        stored = sum(r._lengths)
        raw = tokens * r.num_layers_stored * r.hidden_size * _itemsize(
            r.metadata["dtype"] if r.codec["codec"] != "fp8" else "bfloat16")
        return {"samples": len(r), "tokens": tokens, "stored_bytes": stored, "raw_bf16_bytes": raw,
                "codec": r.codec, "metadata": r.metadata}


# ---------------------------------------------------------------------------------------------- command


def verify_shard(path: str) -> str | None:
    """None if the shard is complete and every record's checksum matches, else the reason."""
    try:
        with HiddenStateShardReader(path, verify=True) as r:
            r.verify_all()
    except (ShardFormatError, OSError) as exc:
        return str(exc)
    return None


def add_arguments(p) -> None:
    p.add_argument("paths", nargs="+", help="hidden-state shards (.dfhs), local or s3://")
    p.add_argument("--delete-damaged", action="store_true",
                   help="delete damaged local shards (and their .stats.json) so that `snakemake` redoes exactly those")


def run(args) -> int:
    damaged = 0
    for path in args.paths:
        why = verify_shard(path)
        if why is None:
            print(f"ok       {path}")
            continue
        damaged += 1
        print(f"DAMAGED  {path}: {why}")
        if args.delete_damaged and not storage.is_s3(path):
            for p in (path, os.path.splitext(path)[0] + ".stats.json"):
                if os.path.exists(p):
                    os.remove(p)
            print(f"deleted  {path}")
    print(f"{len(args.paths) - damaged} ok, {damaged} damaged")
    return 1 if damaged else 0
