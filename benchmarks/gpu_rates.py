"""The bf16 matmul rate of the GPU the benchmarks run on (the measured ceiling their MFU is set against)."""

from __future__ import annotations

import time

import torch


def matmul_rate(dev):
    """bf16 FLOP/s of an 8192^3 matmul on `dev`."""
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn_like(a)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20):
        a @ b
    torch.cuda.synchronize()
    return 20 * 2 * 8192 ** 3 / (time.perf_counter() - t)
