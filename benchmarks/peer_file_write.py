"""How fast a machine's disk takes SpecForge's offline files, and whether writing them from several threads helps:
recipe_at_scale.py peer-data writes ~36K pickles of ~3.2 MB (113.7 GB in 234 s on the H100 machine, 2026-12-07)
from one thread, between the target's forwards. Side by side in one run: raw sequential writes (one 64 MiB buffer
at a time, fsync at the end), then N files of SpecForge's sample shape saved with torch.save from 1, 2, 4 and 8
threads (each set synced before its clock stops). Prints a table; run it where the files would go.

    python benchmarks/peer_file_write.py [--dir /root/pw] [--files 600] [--tokens 560] [--raw-gb 4]
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def sample(tokens: int, width: int):
    import torch

    return {"input_ids": torch.arange(tokens), "loss_mask": torch.ones(tokens, dtype=torch.long),
            "hidden_states": torch.randn(tokens, width).to(torch.bfloat16)}


def raw_write(d: Path, gigabytes: float) -> float:
    buf = os.urandom(64 << 20)
    n = max(1, int(gigabytes * (1 << 30) / len(buf)))
    t = time.perf_counter()
    with open(d / "raw.bin", "wb") as f:
        for _ in range(n):
            f.write(buf)
        f.flush()
        os.fsync(f.fileno())
    dt = time.perf_counter() - t
    (d / "raw.bin").unlink()
    return n * len(buf) / dt


def saved(d: Path, obj, files: int, threads: int) -> tuple[float, int]:
    import torch

    out = d / f"t{threads}"
    out.mkdir()

    def one(i: int) -> None:
        tmp = out / f"sample_{i:08d}.ckpt.partial"  # written aside and renamed, as PeerFiles does
        torch.save(obj, tmp)
        os.replace(tmp, out / f"sample_{i:08d}.ckpt")

    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(files)))
    os.sync()
    dt = time.perf_counter() - t
    size = sum(p.stat().st_size for p in out.iterdir())
    shutil.rmtree(out)
    return size / dt, size


def main(argv=None) -> list[tuple[str, str, float]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/root/peer-write-bench")
    ap.add_argument("--files", type=int, default=600)
    ap.add_argument("--tokens", type=int, default=560, help="a sample's tokens (35,835 samples, 20.4M tokens)")
    ap.add_argument("--width", type=int, default=5 * 576, help="features a token: 5 layers x SmolLM2's 576")
    ap.add_argument("--raw-gb", type=float, default=4.0)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4, 8])
    a = ap.parse_args(argv)
    d = Path(a.dir)
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    obj = sample(a.tokens, a.width)
    rows = [("raw sequential write + fsync", f"{a.raw_gb:.1f} GB", raw_write(d, a.raw_gb))]
    for n in a.threads:
        rate, size = saved(d, obj, a.files, n)
        rows.append((f"torch.save, {n} thread(s)", f"{a.files} x {size / a.files / 1e6:.2f} MB", rate))
    shutil.rmtree(d, ignore_errors=True)
    base = rows[1][2]
    print(f"{'what':<30} | {'size':<18} | {'MB/s':>7} | vs 1 thread")
    print(f"{'-' * 30}-+-{'-' * 18}-+-{'-' * 7}-+------------")
    for what, size, rate in rows:
        print(f"{what:<30} | {size:<18} | {rate / 1e6:7.0f} | {rate / base:.2f}x")
    return rows


if __name__ == "__main__":
    main()
