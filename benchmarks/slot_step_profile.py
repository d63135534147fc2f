"""Where a slot-engine decode step spends its time at the SmolLM2-135M shape (random weights, bf16, CUDA).

For each (rows, width): every slot filled with a ~100-token prompt, then: the captured step (graph replay),
the eager step, the attention call alone (each SDPA backend), the sampling alone, and the top kernels of a few
eager steps under the torch profiler. Prints a table; --json writes it.

    PYTHONPATH=scripts python benchmarks/slot_step_profile.py --json out.json      # GPU
"""

from __future__ import annotations

import argparse
import json
import time

import torch

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def timed(fn, n: int) -> float:
    fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    sync()
    return 1000 * (time.perf_counter() - t0) / n


def filled_pool(model, rows: int, width: int, capture: bool):
    from dflash_pipeline.generation.slot_decode import Request
    from dflash_pipeline.generation.slot_pool import SlotPool

    pool = SlotPool(model, set(), rows=rows, width=width, capture=capture)
    gen = torch.Generator().manual_seed(0)
    reqs = [Request(prompt=torch.randint(3, model.config.vocab_size, (100,), generator=gen).tolist(), budget=width - 100, seed=i,
                    temperature=0.7) for i in range(rows)]
    with torch.inference_mode():
        pool.admit(reqs)
    return pool


def attention_alone(rows: int, width: int) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from dflash_pipeline.generation.slot_decode import slot_attention

    dev, dt = DEV, torch.bfloat16 if DEV == "cuda" else torch.float32
    q = torch.randn(rows, 9, 1, 64, device=dev, dtype=dt)
    k = torch.randn(rows, 3, width, 64, device=dev, dtype=dt)
    v = torch.randn_like(k)
    mask = torch.zeros(rows, 1, 1, width, device=dev, dtype=dt)
    mask[:, ..., width // 2:] = torch.finfo(dt).min
    out = {}
    for name, backend in (("default", None), ("math", SDPBackend.MATH), ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                          ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            if backend is None:
                ms = timed(lambda: slot_attention(None, q, k, v, mask, 0.125), 20)
            else:
                with sdpa_kernel([backend]):
                    ms = timed(lambda: slot_attention(None, q, k, v, mask, 0.125), 20)
            out[f"attn_{name}_ms"] = round(ms * 30, 2)  # 30 layers
        except Exception as exc:  # a backend that refuses the shapes
            out[f"attn_{name}_ms"] = repr(exc)[:80]
    # enable_gqa with the 9 query heads as they come (no mask: the lower bound of reading the cache once)
    qq = torch.randn(rows, 9, 1, 64, device=dev, dtype=dt)
    ms = timed(lambda: torch.nn.functional.scaled_dot_product_attention(qq, k, v, enable_gqa=True), 20)
    out["attn_nomask_gqa_ms"] = round(ms * 30, 2)
    gb = 2 * k.numel() * 2 * 30 / 1e9
    out["kv_gb_per_step"] = round(gb, 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--shapes", default="256x1024,1024x1024,1024x512")
    args = ap.parse_args()
    import sys

    sys.path.insert(0, "benchmarks")
    from generation_engines import make_model

    from dflash_pipeline.generation.slot_decode import sample_rows, use_slot_attention

    model = make_model(DEV == "cpu", DEV)
    use_slot_attention(model)
    rows_out = []
    for shape in args.shapes.split(","):
        rows, width = map(int, shape.split("x"))
        res = {"rows": rows, "width": width}
        pool = filled_pool(model, rows, width, capture=DEV == "cuda")
        with torch.inference_mode():
            res["graph_step_ms"] = round(timed(pool.step, 20), 2)
            pool.capture = False
            res["eager_step_ms"] = round(timed(pool.step, 5), 2)
            logits = torch.randn(rows, model.config.vocab_size, device=DEV)
            res["sample_ms"] = round(timed(lambda: sample_rows(logits, pool.seeds, pool.steps, pool.temperature,
                                                               pool.top_k, pool.top_p, False), 20), 2)
            res["shift_ms"] = round(timed(lambda: pool._shift(0), 2), 1)
            res.update(attention_alone(rows, width))
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA if DEV == "cuda" else ProfilerActivity.CPU]) as prof:
                for _ in range(3):
                    pool.step()
                sync()
            evs = sorted(prof.key_averages(), key=lambda e: -(e.device_time_total or e.cpu_time_total))[:8]
            res["top_kernels"] = [(e.key[:70], round((e.device_time_total or e.cpu_time_total) / 3000, 2)) for e in evs]
        rows_out.append(res)
        print(json.dumps(res), flush=True)
        del pool
        if DEV == "cuda":
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows_out, f, indent=1)


if __name__ == "__main__":
    main()
