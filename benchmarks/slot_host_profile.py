"""Host-side profile of the slot scheduler on the benchmark's workload (cProfile, top functions by cumulative
time): where a round's wall time goes besides the captured step. GPU only.

    PYTHONPATH=scripts python benchmarks/slot_host_profile.py --requests 1024 --rows 256
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time

import torch

sys.path.insert(0, "benchmarks")


def main() -> None:
    from generation_engines import make_model, workload

    from dflash_pipeline.generation.slot_decode import Request
    from dflash_pipeline.generation.slot_engine import slot_width
    from dflash_pipeline.generation.slot_pool import SlotScheduler

    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=1024)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--out")
    args = ap.parse_args()
    tiny = not torch.cuda.is_available()
    model = make_model(tiny, "cpu" if tiny else "cuda")
    reqs = workload(args.requests, model.config.vocab_size, 24 if tiny else 384)
    sched = SlotScheduler(model, set(), rows=args.rows, width=slot_width(2048, 384), context=2048, refill=True,
                          capture=not tiny)
    with torch.inference_mode():
        sched.run([Request(prompt=p, budget=min(b, 16), seed=10 ** 6 + i, temperature=0.7)
                   for i, (p, b) in enumerate(reqs[:args.rows])])
        t0 = time.perf_counter()
        prof = cProfile.Profile()
        prof.enable()
        sched.run([Request(prompt=p, budget=b, seed=i, temperature=0.7) for i, (p, b) in enumerate(reqs)])
        if not tiny:
            torch.cuda.synchronize()
        prof.disable()
    wall = time.perf_counter() - t0
    print(f"wall {wall:.1f} s, steps {sched.main.step_count}, shifts {sched.main.shifts}, "
          f"tok/s {sum(b for _, b in reqs) / wall:,.0f}")
    stats = pstats.Stats(prof).sort_stats("cumulative")
    stats.print_stats(30)
    if args.out:
        stats.dump_stats(args.out)


if __name__ == "__main__":
    main()
