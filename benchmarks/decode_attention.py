"""The slot engine's decode attention: live columns only (Triton, generation/live_attention) vs SDPA with the mask,
at the SmolLM2-135M shape (random weights, bf16, CUDA). One table; --json writes its rows.

- accuracy: attention alone on the step's shapes (rows x 9 query heads x 64; keys [rows, 3, width, 64], each
  row's live columns [start, t], ~57% of the columns on average, one row with a single column, one full row):
  max |triton - masked SDPA| and both against fp32; greedy tokens of the slot scheduler (temperature 0, refills
  and compactions, a few hundred steps) with triton vs sdpa, and sdpa's efficient backend vs its default as the
  noise floor of merely reordering bf16 attention.
- speed at each --shapes (rows x width, every slot busy, t near the end, the same live fraction): attention alone
  x 30 layers (masked SDPA, the kernel at several chunk / block / warp sizes) and the captured decode step with
  each attention.

Any row that fails (a kernel that does not compile) is an error in the table; the others still run.

    PYTHONPATH=scripts python benchmarks/decode_attention.py --json attn.json      # GPU, ~1-2 min
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback

import torch

sys.path.insert(0, "benchmarks")
from slot_step_profile import timed  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
HEADS, KV, DIM, LAYERS = 9, 3, 64, 30


def live_lengths(rows: int, t: int, frac: float, gen) -> torch.Tensor:
    """Live columns per row (the write column included), uniform with mean frac x t; row 0 one, row 1 all."""
    lo = max(1, int((2 * frac - 1) * t))
    n = torch.randint(lo, t + 2, (rows,), generator=gen)
    n[0], n[1 % rows] = 1, t + 1
    return n


def attention_inputs(rows, width, frac, seed=0):
    gen = torch.Generator().manual_seed(seed)
    t = width - 64
    start = (t + 1 - live_lengths(rows, t, frac, gen)).to(torch.int32)
    q = torch.randn(rows, HEADS, 1, DIM, generator=gen)
    k = torch.randn(rows, KV, width, DIM, generator=gen)
    v = torch.randn(rows, KV, width, DIM, generator=gen)
    cols = torch.arange(width)
    live = (cols >= start.unsqueeze(1).long()) & (cols <= t)
    return [x.to(DEV) for x in (q, k, v, start, torch.tensor([t]), live)]


def masked_sdpa(q, k, v, live, scale=0.125):
    from dflash_pipeline.generation.slot_decode import slot_attention

    mask = torch.where(live, 0.0, torch.finfo(q.dtype).min).to(q.dtype)[:, None, None, :]
    return slot_attention(None, q, k, v, mask, scale)[0].transpose(1, 2)


def accuracy(rows, width, frac) -> dict:
    from dflash_pipeline.generation.live_attention import attend_live

    q, k, v, start, pos, live = attention_inputs(rows, width, frac)
    exact = masked_sdpa(q, k, v, live)  # the inputs are fp32
    bq, bk, bv = q.bfloat16(), k.bfloat16(), v.bfloat16()
    sdpa = masked_sdpa(bq, bk, bv, live).float()
    tri = attend_live(bq, bk, bv, start, pos, 0.125).float()
    return {"triton_vs_sdpa": (tri - sdpa).abs().max().item(), "triton_vs_fp32": (tri - exact).abs().max().item(),
            "sdpa_vs_fp32": (sdpa - exact).abs().max().item(), "live_frac": live.float().mean().item()}


def greedy(model, mode: str, backend=None, rows=128, width=512, n=320, plen=(8, 300), budget=(150, 300)) -> dict:
    """Every request's tokens, temperature 0: prompts of 8-300 tokens, budgets of 150-300 (refills, compactions,
    the wide pool for those longer than `width`)."""
    from contextlib import nullcontext

    from torch.nn.attention import sdpa_kernel

    from dflash_pipeline.generation.slot_decode import Request
    from dflash_pipeline.generation.slot_pool import SlotScheduler

    gen = torch.Generator().manual_seed(1)
    def draw(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    vocab = model.config.vocab_size
    reqs = [Request(prompt=torch.randint(3, vocab, (draw(*plen),), generator=gen).tolist(), budget=draw(*budget), seed=i)
            for i in range(n)]
    sched = SlotScheduler(model, set(), rows=rows, width=width, context=2 * width, capture=DEV == "cuda",
                          decode_attention=mode)
    with torch.inference_mode(), (sdpa_kernel([backend]) if backend else nullcontext()):
        done = sched.run(reqs)
    return {tuple(r.prompt): r.tokens for r in done}, sched.main.step_count


def agreement(a: dict, b: dict) -> str:
    """Requests with identical tokens, and the share of tokens before each request's first difference."""
    same = sum(a[p] == b[p] for p in a)
    prefix = sum(next((i for i, (x, y) in enumerate(zip(a[p], b[p])) if x != y), len(a[p])) for p in a)
    return f"{same}/{len(a)} requests identical, {prefix / sum(len(t) for t in a.values()):.1%} of tokens before a difference"


def step_pool(model, rows, width, frac, mode):
    """A pool with every slot busy, t 64 columns before the end and each row's live range as attention_inputs'."""
    from dflash_pipeline.generation.slot_decode import Request
    from dflash_pipeline.generation.slot_pool import SlotPool

    pool = SlotPool(model, set(), rows=rows, width=width, capture=DEV == "cuda", decode_attention=mode)
    with torch.inference_mode():
        pool.admit([Request(prompt=[5] * 16, budget=width, seed=i, temperature=0.7) for i in range(rows)])
        *_, start, pos, live = attention_inputs(rows, width, frac)
        pool.t = int(pos)
        pool.cache.start.copy_(start)
        pool.mask.copy_(torch.where(live & (torch.arange(width, device=DEV) < int(pos)), 0.0, pool.min)
                        .to(pool.dtype)[:, None, None, :])
        for r in pool.slots:
            r.start = int(start[r.slot])
    return pool


def speed(model, rows, width, frac, variants) -> list[tuple]:
    from dflash_pipeline.generation.live_attention import attend_live

    out = []
    q, k, v, start, pos, live = [x.bfloat16() if x.is_floating_point() else x
                                 for x in attention_inputs(rows, width, frac)]
    cases = [("attention x30, sdpa masked", lambda: masked_sdpa(q, k, v, live))]
    for var in variants:  # chunk/block_n/num_warps
        c, b, w = map(int, var.split("/"))
        cases.append((f"attention x30, triton {var}",
                      lambda c=c, b=b, w=w: attend_live(q, k, v, start, pos, 0.125, chunk=c, block_n=b, num_warps=w)))
    for name, fn in cases:
        out.append(row(name, f"{rows}x{width}", lambda fn=fn: round(LAYERS * timed(fn, 20), 2)))
    del q, k, v
    for mode in ("sdpa", "triton"):
        def step(mode=mode):
            pool = step_pool(model, rows, width, frac, mode)
            with torch.inference_mode():
                ms = timed(pool.step, 20)
            name = pool.live_attention.name
            del pool
            return f"{ms:.2f} ({name})"
        out.append(row(f"captured step ms, {mode}", f"{rows}x{width}", step))
        if DEV == "cuda":
            torch.cuda.empty_cache()
    return out


def row(what, shape, fn) -> tuple:
    t0 = time.perf_counter()
    try:
        value = fn()
    except Exception as exc:  # a failing row (kernel compile error, OOM) must not stop the others
        traceback.print_exc()
        value = f"ERROR {type(exc).__name__}: {str(exc).splitlines()[0][:150] if str(exc) else ''}"
    res = (what, shape, value, round(time.perf_counter() - t0, 1))
    print(f"{what:42} {shape:>10}  {value}", flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json")
    ap.add_argument("--shapes", default="1024x1024,256x1024")
    ap.add_argument("--live", type=float, default=0.57, help="mean share of live columns per row")
    ap.add_argument("--variants", default="256/64/4,128/64/4,512/64/4,256/32/4,256/64/8,512/64/8",
                    help="the kernel's chunk/block_n/num_warps timed alone (the pool runs 256/64/4)")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test (the kernel needs TRITON_INTERPRET=1)")
    args = ap.parse_args()
    from generation_engines import make_model

    from dflash_pipeline.generation.slot_decode import use_slot_attention

    model = make_model(args.tiny, DEV)
    use_slot_attention(model)
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
    rows = [row("accuracy: max abs diff (live share)", f"{r}x{w}", lambda r=r, w=w: accuracy(r, w, args.live))
            for r, w in (shapes[:1] if not args.tiny else [(6, 256)])]
    runs = {}
    greedy_kw = dict(rows=4, width=48, n=6, plen=(4, 20), budget=(5, 30)) if args.tiny else {}

    def tokens(key, *a):
        runs[key], steps = greedy(model, *a, **greedy_kw)
        return f"{steps} steps"

    from torch.nn.attention import SDPBackend

    rows.append(row("greedy run: sdpa", "", lambda: tokens("sdpa", "sdpa")))
    rows.append(row("greedy run: sdpa (efficient backend)", "",
                    lambda: tokens("efficient", "sdpa", SDPBackend.EFFICIENT_ATTENTION)))
    rows.append(row("greedy run: triton", "", lambda: tokens("triton", "triton")))
    rows.append(row("greedy: triton vs sdpa", "", lambda: agreement(runs["sdpa"], runs["triton"])))
    rows.append(row("greedy: sdpa efficient vs default (floor)", "", lambda: agreement(runs["sdpa"], runs["efficient"])))
    for r, w in shapes:
        rows += speed(model, r, w, args.live, args.variants.split(","))
    print(f"\ndecode attention, SmolLM2-135M shape, {torch.cuda.get_device_name() if DEV == 'cuda' else 'cpu'}, "
          f"torch {torch.__version__}, live share {args.live}")
    for what, shape, value, secs in rows:
        print(f"{what:42} {shape:>10}  {value}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu", "torch": torch.__version__,
                       "live": args.live, "rows": [dict(zip(("what", "shape", "value", "seconds"), r)) for r in rows]},
                      f, indent=1)


if __name__ == "__main__":
    main()
