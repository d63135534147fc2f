"""Decode attention (one query position) over each slot row's live columns only: [start, t] of the cache.

The slot cache is [rows, kv_heads, width, head_dim] and a row's tokens sit right-aligned against the write
column t, so its live columns are one range; SDPA with the 4D additive mask reads every column of every row
(at 1,024 x 1,024 on an H200: 11.6 of a 16.3 ms step), this reads only the live ones.

`attend_live` runs a Triton flash-decoding kernel (live_kernels): the columns are cut into fixed chunks, one program per (row,
KV head, chunk) reads its chunk's live part once for all the query heads of that KV head (GQA: padded to 16
rows for `tl.dot`) and writes a partial output and its log-sum-exp; programs whose chunk holds no live column
write nothing; a second kernel merges a row's partials. fp32 accumulation, output in the query's dtype. Shapes
are static and `start` / `pos` are device tensors, so a CUDA graph captures it. `reference` is the same math
in plain torch (a slice per row), for the tests.

`LiveAttention` is what a pool hands its cache: it says when the kernel applies and, in "auto" mode, falls back
to SDPA for good when the kernel fails (compile error) instead of failing the decoder.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os

import torch

LOG = logging.getLogger(__name__)
MODES = ("auto", "sdpa", "triton")
ENV_MODE = "DFLASH_DECODE_ATTENTION"
CHUNK = 256    # columns per program: 4 chunks at width 1,024, enough programs (rows x kv_heads x 4) for the SMs
BLOCK_N = 64   # columns per inner iteration


def triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def reference(query, key, value, start, pos, scale):
    """query [rows, heads, 1, dim], key/value [rows, kv_heads, width, dim], start [rows], pos [1]: each row
    attends to its columns [min(start, t), t] (t = pos), in fp32; [rows, heads, 1, dim] in the query's dtype."""
    rows, heads, _, dim = query.shape
    group = heads // key.shape[1]
    t = int(pos.reshape(-1)[0])
    out = torch.empty_like(query)
    for r in range(rows):
        lo = min(int(start[r]), t)
        k = key[r, :, lo:t + 1].float().repeat_interleave(group, 0)
        v = value[r, :, lo:t + 1].float().repeat_interleave(group, 0)
        w = torch.softmax(query[r].float() @ k.transpose(1, 2) * scale, -1)
        out[r] = (w @ v).to(query.dtype)
    return out


def attend_live(query, key, value, start, pos, scale, chunk: int = CHUNK, block_n: int = BLOCK_N,
                num_warps: int = 4):
    """The kernel: same arguments and result as `reference` (query [rows, heads, 1, dim], the last dim
    contiguous; key/value [rows, kv_heads, width, dim] with contiguous rows of dim; start int [rows]; pos [1];
    chunk a multiple of block_n)."""
    import triton

    from dflash_pipeline.generation.live_kernels import merge, partials

    rows, heads, _, dim = query.shape
    kv_heads, width = key.shape[1], key.shape[2]
    group = heads // kv_heads
    splits = triton.cdiv(width, chunk)
    block_d = triton.next_power_of_2(dim)
    o_part = torch.empty(rows, heads, splits, block_d, dtype=torch.float32, device=query.device)
    lse_part = torch.empty(rows, heads, splits, dtype=torch.float32, device=query.device)
    out = torch.empty(rows, heads, 1, dim, dtype=query.dtype, device=query.device)
    interpret = os.environ.get("TRITON_INTERPRET") == "1"  # CPU tests
    precision = "ieee" if query.dtype == torch.float32 or interpret else "tf32"  # fp32 models: no tf32 rounding
    partials[(rows, kv_heads, splits)](
        query, key, value, start, pos, o_part, lse_part, query.stride(0), query.stride(1), key.stride(0),
        key.stride(1), key.stride(2), value.stride(0), value.stride(1), value.stride(2),
        float(scale) * math.log2(math.e), heads, splits, GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)),
        DIM=dim, BLOCK_D=block_d, CHUNK=chunk, BLOCK_N=block_n, PRECISION=precision, INTERPRET=interpret,
        num_warps=num_warps)
    merge[(rows, heads)](o_part, lse_part, start, pos, out, out.stride(0), out.stride(1), heads, splits, DIM=dim,
                         BLOCK_D=block_d, BLOCK_S=triton.next_power_of_2(splits), CHUNK=chunk)
    return out


class LiveAttention:
    """The live-range decode attention of one pool: `start` (int32 [rows], each row's first live column) and
    `pos` (the write column) are the pool's device tensors; `__call__` returns None where SDPA must run."""

    def __init__(self, mode: str, device: torch.device, start: torch.Tensor, pos: torch.Tensor):
        # an operator's override of "auto" (e.g. sdpa while a GPU or driver misbehaves): no job param, no rerun
        mode = os.environ.get(ENV_MODE, mode) if mode == "auto" else mode
        if mode not in MODES:
            raise ValueError(f"decode_attention must be one of {MODES}, not {mode!r}")
        if mode == "triton" and not triton_importable():
            raise RuntimeError("decode_attention='triton' needs the triton package")
        self.strict = mode == "triton"
        self.enabled = self.strict or (mode == "auto" and device.type == "cuda" and triton_importable())
        self.start, self.pos = start, pos

    @property
    def name(self) -> str:
        return "triton live columns" if self.enabled else "sdpa masked"

    @staticmethod
    def handles(query, key) -> bool:
        return (query.shape[2] == 1 and query.shape[1] % key.shape[1] == 0 and query.shape[-1] <= 256
                and query.dtype in (torch.float16, torch.bfloat16, torch.float32) and key.dtype == query.dtype
                and query.stride(-1) == 1 and key.stride(-1) == 1)

    def __call__(self, query, key, value, scale):
        if not self.enabled or not self.handles(query, key):
            return None
        if value.stride(-1) != 1 or value.shape != key.shape:
            return None
        try:
            return attend_live(query, key, value, self.start, self.pos, scale)
        except Exception:
            if self.strict or (query.is_cuda and torch.cuda.is_current_stream_capturing()):
                raise
            LOG.warning("the Triton decode attention failed; the slot engine goes on with SDPA", exc_info=True)
            self.enabled = False
            return None
