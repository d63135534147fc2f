"""Encoding and decoding of one sample's hidden states (codecs of the `.dfhs` format, see layout.py).

* ``raw``: the hidden states as stored dtype bytes (bf16 or fp32), uncompressed, 64-byte aligned; a
  local file is memory-mapped and a sample's tensor is a view of the map (no read of other samples).
* ``zstd`` (lossless, bit-exact): each value's bits are rotated left by one so the sign bit leaves the
  top byte, then split into byte planes. The top plane holds the 8 exponent bits (a few bits of entropy)
  and is compressed with zstandard at the configured level; the mantissa planes are close to random and
  are stored raw (unless `compress_mantissa`), which keeps writing fast.
* ``fp8`` (lossy): float8 e4m3 values with one fp32 scale per row (per token and layer: amax / 448),
  the fp8 bytes zstd-compressed at the level (0 = stored raw). Read back as bf16.
"""

from __future__ import annotations

import threading
import zlib
from dataclasses import dataclass

import numpy as np
import zstandard

from dflash_pipeline import settings
from dflash_pipeline.errors import PipelineError
from dflash_pipeline.hidden_states.layout import CODECS, STORED_DTYPES, ShardFormatError, itemsize, uint_dtype

FP8_MAX = 448.0
DEFAULT_LEVEL = settings.default("extract.level")


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


def merge_planes(planes, uint_dt) -> np.ndarray:
    """Inverse of `split_planes`: byte planes (a sequence of itemsize uint8 arrays) -> uint values [N]."""
    t = np.dtype(uint_dt).type
    item = np.dtype(uint_dt).itemsize
    rot = np.asarray(planes[item - 1]).astype(uint_dt)
    for k in range(item - 2, -1, -1):
        rot <<= t(8)
        rot |= np.asarray(planes[k])
    out = rot >> t(1)
    rot <<= t(item * 8 - 1)
    out |= rot
    return out


def hidden_bits(hidden, dtype: str) -> np.ndarray:
    """A tensor/array [T, L, H] -> its raw bits in the stored dtype as a uint numpy array (no copy if possible)."""
    import torch

    if isinstance(hidden, np.ndarray):
        if hidden.dtype == uint_dtype(dtype):
            return hidden
        if dtype == "float32":
            return np.ascontiguousarray(hidden, dtype=np.float32).view(np.uint32)
        hidden = torch.from_numpy(np.ascontiguousarray(hidden))
    want = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    t = hidden.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.to(want).contiguous()
    return t.view(torch.int16 if dtype == "bfloat16" else torch.int32).numpy().view(uint_dtype(dtype))


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


def crc_chain(parts) -> int:
    crc = 0
    for p in parts:
        crc = zlib.crc32(p, crc)
    return crc & 0xFFFFFFFF


def bounded_decompress(dctx: zstandard.ZstdDecompressor, data, limit: int) -> bytes:
    """Decompress one zstd frame of at most `limit` bytes. A frame header that states a larger size is refused
    before anything is allocated (with a stated size, zstandard allocates it and ignores max_output_size)."""
    try:
        stated = zstandard.frame_content_size(data)
    except zstandard.ZstdError as exc:
        raise ShardFormatError(f"not a zstd frame ({exc})") from exc
    if stated > limit:
        raise ShardFormatError(f"a zstd frame states {stated} decompressed bytes, more than the {limit} allowed")
    try:
        return dctx.decompress(data, max_output_size=limit)
    except zstandard.ZstdError as exc:
        raise ShardFormatError(f"undecodable zstd data, or more than {limit} bytes ({exc})") from exc


@dataclass
class EncodedSample:
    """A sample ready to write: its stored sections (bytes-like) and their raw lengths."""

    sample_id: str
    num_tokens: int
    sections: list  # list of (payload bytes-like, raw_length)
    crc32: int = -1  # of the stored bytes; computed by encode() so that worker threads share the work


class Codec:
    """Encodes samples for one shard. Thread-safe: a zstd compressor per thread."""

    def __init__(self, codec: str = "zstd", level: int = DEFAULT_LEVEL, dtype: str = "bfloat16",
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
        if len(mask) != len(ids):
            raise PipelineError(f"sample {sample_id}: input_ids has {len(ids)} tokens but loss_mask {len(mask)}")
        if self.codec == "raw":
            bits = hidden_bits(hidden, self.dtype)
            sections = [(bits, bits.nbytes)]
        elif self.codec == "zstd":
            sections = self._plane_sections(hidden, planes)
        else:
            sections = self._fp8_sections(hidden, fp8)
        sections += [(ids, ids.nbytes), (mask, mask.nbytes)]
        crc = crc_chain(memoryview(p).cast("B") for p, _ in sections)
        return EncodedSample(str(sample_id), len(ids), sections, crc)

    def _plane_sections(self, hidden, planes) -> list:
        if planes is None:
            planes = split_planes(hidden_bits(hidden, self.dtype))
        n = planes.shape[0]
        return [self._maybe_compress(planes[k], force=(k == n - 1 or self.compress_mantissa)) for k in range(n)]

    def _fp8_sections(self, hidden, fp8) -> list:
        if fp8 is None:
            import torch

            q, s = quantize_fp8(hidden if not isinstance(hidden, np.ndarray) else torch.from_numpy(hidden))
            fp8 = (q.cpu().numpy(), s.cpu().numpy())
        q, s = fp8
        s = np.ascontiguousarray(s, dtype=np.float32)
        return [(s, s.nbytes), self._maybe_compress(np.ascontiguousarray(q))]


def decode_hidden(codec: str, dtype: str, sections: list, shape: tuple, decompress, mapped: bool = False):
    """The hidden tensor [T, L, H] of one record from its section bytes (already checked against the index).
    `decompress(data, raw_length)` inflates a section that is stored compressed."""
    import torch

    t, n_layers, hidden = shape
    if codec == "raw":
        tdt = torch.bfloat16 if dtype == "bfloat16" else torch.float32
        buf = sections[0][0] if mapped else bytearray(sections[0][0])
        return torch.frombuffer(buf, dtype=tdt).view(t, n_layers, hidden)
    if codec == "zstd":
        item = itemsize(dtype)
        planes = [np.frombuffer(decompress(*sections[k]), dtype=np.uint8) for k in range(item)]
        bits = merge_planes(planes, uint_dtype(dtype))
        tdt = torch.bfloat16 if dtype == "bfloat16" else torch.float32
        return torch.from_numpy(bits.view(np.int16 if item == 2 else np.int32)).view(tdt).view(t, n_layers, hidden)
    scales = np.frombuffer(sections[0][0], dtype=np.float32).reshape(t, n_layers)
    q = np.frombuffer(decompress(*sections[1]), dtype=np.uint8).reshape(t, n_layers, hidden)
    return dequantize_fp8(q, scales)
