"""The hidden-state shard file layout (`.dfhs`): one file per shard, random access per sample, checksummed,
no pickle. `codec.py` encodes samples, `writer.py` writes shards, `reader.py` reads them.

A shard file holds, for each sample, the target's hidden states at the drafter's `target_layer_ids`
(`hidden[T, n_layers, H]`), the sample's `input_ids` and its `loss_mask`, so a shard is self-contained.

Layout (all integers little-endian)::

    header   64 bytes: b"DFLASHHS" | u32 version | u32 header_size (64) | u64 index_raw_length | zero padding
    records  one per sample, each starting at a 64-byte aligned offset (see "record sections")
    index    zstd-compressed JSON: {"metadata": {...}, "codec": {...}, "samples": {column: [...]}}
    footer   32 bytes: u64 index_offset | u64 index_length | u32 crc32(index) | u32 version | b"HSEND001"

A reader fetches the footer (one ranged GET on S3), then the index, then any sample by its offset and
length. Every record carries a CRC-32 of its stored bytes and the index one of its own, so a truncated file
(no valid footer) or a flipped byte raises `ShardFormatError` naming the file and sample instead of
feeding garbage to training. Sizes a file claims are checked against the file before anything is
allocated: the index's decompressed size (`index_raw_length`, 0 in files of older writers, and a limit
proportional to the file size), and every section's decoded size (the shape the index states, and at most
`MAX_EXPANSION` times its stored size).

Record sections, in order, each at an offset relative to the record start given by the index column
`sections` (a list of [offset, stored_length, raw_length] per section; stored_length == raw_length means
stored uncompressed):

* raw:  hidden, input_ids (int32[T]), loss_mask (uint8[T])
* zstd: plane 0 .. plane itemsize-1 (plane itemsize-1 = exponent), input_ids, loss_mask
* fp8:  scales (float32[T, n_layers]), values (fp8 bytes), input_ids, loss_mask
"""

from __future__ import annotations

import struct

import numpy as np

from dflash_pipeline.errors import PipelineError

MAGIC = b"DFLASHHS"
FOOTER_MAGIC = b"HSEND001"
VERSION = 1
HEADER_SIZE = 64
HEADER = struct.Struct("<8sIIQ")  # magic, version, header_size, index_raw_length (0: not recorded)
FOOTER = struct.Struct("<QQII8s")  # index_offset, index_length, index_crc32, version, magic
INDEX_RAW_LENGTH_OFFSET = 16  # where the writer fills in index_raw_length when it closes the shard
ALIGN = 64
CODECS = ("raw", "zstd", "fp8")
STORED_DTYPES = ("bfloat16", "float32")
FILE_EXTENSION = ".dfhs"  # "DFlash hidden states"
INDEX_COLUMNS = ("sample_ids", "offsets", "lengths", "num_tokens", "crc32", "sections")

# Bounds on what a file may claim. An index entry is ~200 bytes of JSON for a record of at least 64 bytes, so
# a real index is far below 16x the file; the hard cap is ~1M samples per shard.
MAX_INDEX_BYTES = 256 << 20
INDEX_BYTES_PER_FILE_BYTE = 16
INDEX_BYTES_BASE = 1 << 20
# A compressed section decodes to at most this many times its stored size (hidden states: the exponent plane
# compresses ~3x); sections below the floor are never refused for their ratio.
MAX_EXPANSION = 1024
EXPANSION_FLOOR = 1 << 20
MAX_HIDDEN_SIZE = 1 << 20
MAX_FEATURE_LAYERS = 1024


class ShardFormatError(PipelineError):
    """A hidden-state shard is truncated, corrupted, or not a shard at all."""


def itemsize(dtype: str) -> int:
    return {"bfloat16": 2, "float32": 4}[dtype]


def uint_dtype(dtype: str):
    return {"bfloat16": np.uint16, "float32": np.uint32}[dtype]


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def pack_header(index_raw_length: int = 0) -> bytes:
    return HEADER.pack(MAGIC, VERSION, HEADER_SIZE, index_raw_length).ljust(HEADER_SIZE, b"\0")


def index_limit(file_size: int) -> int:
    """The most bytes the decompressed index of a file of `file_size` bytes may have."""
    return min(MAX_INDEX_BYTES, INDEX_BYTES_BASE + INDEX_BYTES_PER_FILE_BYTE * file_size)


def expected_raw_lengths(codec: str, dtype: str, t: int, n_layers: int, hidden: int) -> list[int]:
    """The decoded byte length of each section of a T-token record, in section order."""
    values = t * n_layers * hidden
    tail = [4 * t, t]
    if codec == "raw":
        return [values * itemsize(dtype), *tail]
    if codec == "zstd":
        return [values] * itemsize(dtype) + tail
    return [4 * t * n_layers, values, *tail]


def always_stored_raw(codec: str, n_sections: int) -> list[bool]:
    """Which sections the codec never compresses (the reader uses those bytes as they are)."""
    if codec == "raw":
        return [True] * n_sections
    if codec == "zstd":
        return [False] * (n_sections - 2) + [True, True]
    return [True, False, True, True]
