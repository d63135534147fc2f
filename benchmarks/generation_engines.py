"""Generation engines side by side at the SmolLM2-135M shape (random weights, bf16, CUDA), temperature 0.7.

Plain transformers `generate` (dynamic cache; static cache, compiled by generate), the hf backend's old engine
(`HFEngine`: generate with its per-row Gumbel sampling processor) and the slot engine (slot_pool: static KV
cache, CUDA-graph step, rows refilled as they finish; and the same pools run as length-sorted fixed-width
batches, refill=False), at batch widths 256 and 1,024 (2,048 if time is left).

A random model does not stop when a real answer would: each request gets a budget drawn from a ShareGPT-like
answer length (lognormal, median 200, capped at 384, fixed seed) and only tokens up to each row's budget count as
real answer tokens. `generate` runs a batch to its longest budget (max_new_tokens); the slot engine stops each row
at its own. Prompts: lognormal lengths, median 80 tokens, 8-1,024. Slower variants run on fewer requests (the
table says how many); everything runs in one process, one after the other, until --deadline-s.

    PYTHONPATH=scripts python benchmarks/generation_engines.py --json out.json          # GPU
    PYTHONPATH=scripts python benchmarks/generation_engines.py --tiny                    # CPU smoke test
    PYTHONPATH=scripts python benchmarks/generation_engines.py --only "slots refill" --attention sdpa,triton
"""

from __future__ import annotations

import argparse
import json
import math
import time
import traceback

import numpy as np
import torch


def make_model(tiny: bool, device: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    if tiny:
        cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=512, max_position_embeddings=2048)
    else:
        cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                          num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000,
                          tie_word_embeddings=True, rms_norm_eps=1e-5)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    dtype = torch.float32 if tiny else torch.bfloat16
    model = LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()
    model.generation_config.eos_token_id = None  # rows run to their budgets
    model.generation_config.pad_token_id = 0
    return model


def workload(n: int, vocab: int, cap: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    plen = np.clip(np.round(rng.lognormal(math.log(80), 0.9, n)), 8, 1024).astype(int)
    budget = np.clip(np.round(rng.lognormal(math.log(200), 0.6, n)), 8, cap).astype(int)
    return [(rng.integers(3, vocab, p).tolist(), int(b)) for p, b in zip(plen, budget)]


def run_generate(model, reqs, width, static: bool, temperature: float, rounds: int = 1):
    """Plain generate on batches of `width` rows in arrival order, each to its longest budget; the last round."""
    result = {}
    for _ in range(rounds):
        steps, t0 = 0, time.perf_counter()
        for i in range(0, len(reqs), width):
            part = reqs[i:i + width]
            w = max(len(p) for p, _ in part)
            ids = torch.zeros(len(part), w, dtype=torch.long)
            mask = torch.zeros(len(part), w, dtype=torch.long)
            for j, (p, _) in enumerate(part):
                ids[j, w - len(p):] = torch.tensor(p)
                mask[j, w - len(p):] = 1
            new = max(b for _, b in part)
            kw = dict(cache_implementation="static") if static else {}
            with torch.inference_mode():
                model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device), max_new_tokens=new,
                               min_new_tokens=new, do_sample=True, temperature=temperature, top_k=0, top_p=1.0, **kw)
            steps += new
        sync(model)
        result = {"wall_s": time.perf_counter() - t0, "steps": steps}
    return result


def run_hf_engine(model, reqs, width, temperature: float):
    """The old engine's batch call (`HFEngine._generate`: its sampling processor, dynamic cache)."""
    from dflash_pipeline.generation.client import SamplingParams
    from dflash_pipeline.generation.engines import HFEngine

    class NoText:  # the benchmark has no tokenizer: completions are counted, not read
        def decode(self, tokens, skip_special_tokens=False):
            return ""

    eng = HFEngine("random-weights", batch_size=width, device=str(model.device))
    eng.model, eng.tokenizer, eng.eos_ids, eng.pad_id = model, NoText(), {-1}, 0
    steps, t0 = 0, time.perf_counter()
    for i in range(0, len(reqs), width):
        part = reqs[i:i + width]
        params = [SamplingParams(temperature=temperature, top_p=1.0, top_k=0, seed=i + j) for j in range(len(part))]
        eng._generate([p for p, _ in part], [b for _, b in part], params)
        steps += max(b for _, b in part)
    sync(model)
    return {"wall_s": time.perf_counter() - t0, "steps": steps}


def run_slots(model, reqs, width, temperature: float, refill: bool, capture: bool, context: int, columns: int = 0,
              attention: str = "auto"):
    from dflash_pipeline.generation.slot_decode import Request, use_slot_attention
    from dflash_pipeline.generation.slot_engine import slot_width
    from dflash_pipeline.generation.slot_pool import SlotScheduler

    use_slot_attention(model)  # as SlotEngine loads it; the generate variants get sdpa back (measure())
    cap = max(b for _, b in reqs)
    sched = SlotScheduler(model, set(), rows=width, width=columns or slot_width(context, cap), context=context, refill=refill,
                          capture=capture, decode_attention=attention)
    warm = [Request(prompt=p, budget=min(b, 16), seed=10 ** 6 + i, temperature=temperature)
            for i, (p, b) in enumerate(reqs[:width])]
    with torch.inference_mode():
        sched.run(warm)  # graph capture and first kernels, not measured
        steps0 = sched.main.step_count + (sched.wide.step_count if sched.wide else 0)
        warm_pools = [sched.main] + ([sched.wide] if sched.wide else [])
        row_steps0 = sum(p.row_steps for p in warm_pools)
        slot_steps0 = sum(p.step_count * p.rows for p in warm_pools)
        sync(model)
        t0 = time.perf_counter()
        todo = [Request(prompt=p, budget=b, seed=i, temperature=temperature) for i, (p, b) in enumerate(reqs)]
        done = sched.run(todo)
        sync(model)
    wall = time.perf_counter() - t0
    assert sorted(len(r.tokens) for r in done) == sorted(b for _, b in reqs)
    steps = sched.main.step_count + (sched.wide.step_count if sched.wide else 0) - steps0
    pools = [sched.main] + ([sched.wide] if sched.wide else [])
    occupancy = (sum(p.row_steps for p in pools) - row_steps0) / max(1, sum(p.step_count * p.rows for p in pools)
                                                                     - slot_steps0)
    return {"wall_s": wall, "steps": steps, "occupancy": round(occupancy, 3), "slot_width": sched.main.width,
            "shifts": sched.main.shifts, "attention": sched.main.live_attention.name,
            "wide_requests": sum(1 for p, b in reqs if len(p) + b > sched.main.width)}


def sync(model):
    if model.device.type == "cuda":
        torch.cuda.synchronize()


def variants(tiny: bool, n: int):
    widths = (8, 32) if tiny else (256, 1024)
    w_small, w_big = widths
    # the fastest candidates first: a deadline cuts the slow variants, not the comparison that matters
    out = [("slots refill", w_big, n, "slots", True), ("generate static (compiled)", w_big, w_big, "static", None),
           ("slots refill", w_small, n, "slots", True), ("generate dynamic", w_small, w_small, "dynamic", None),
           ("slots, length-sorted batches", w_big, n, "slots", False),
           ("slots refill", 2 * w_big, n, "slots", True),
           ("HFEngine (old, dynamic)", w_small, w_small, "hfengine", None),
           ("generate static (compiled)", w_small, w_small, "static", None)]
    return out


def measure(model, kind, reqs, width, args, capture):
    model.set_attn_implementation("sdpa")  # plain transformers, as a user would run it
    if kind == "static":  # first call compiles (and captures); the second is measured
        t0 = time.perf_counter()
        run_generate(model, reqs, width, True, args.temperature)
        first = time.perf_counter() - t0
        return run_generate(model, reqs, width, True, args.temperature) | {"first_call_s": round(first, 1)}
    if kind == "dynamic":
        return run_generate(model, reqs, width, False, args.temperature)
    return run_hf_engine(model, reqs, width, args.temperature)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="a tiny model on CPU (smoke test)")
    ap.add_argument("--requests", type=int, default=0, help="default 4,096 (tiny: 64): enough for the slots to run full between the first fill and the tail")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--deadline-s", type=float, default=190.0, help="start no variant after this many seconds")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--slot-width", type=int, default=0, help="the slot engine's cache columns (0: its default)")
    ap.add_argument("--only", default="", help="run only the variants whose name contains this")
    ap.add_argument("--attention", default="auto",
                    help="the slot variants' decode attention, comma-separated to run each: auto, sdpa, triton")
    args = ap.parse_args()
    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    n = args.requests or (64 if args.tiny else 4096)
    model = make_model(args.tiny, device)
    reqs = workload(n, model.config.vocab_size, 24 if args.tiny else 384)
    capture = device == "cuda"
    begin, rows = time.perf_counter(), []
    modes = args.attention.split(",")
    runs = [(f"{name} [{mode}]" if kind == "slots" and modes != ["auto"] else name, width, count, kind, refill, mode)
            for name, width, count, kind, refill in variants(args.tiny, n)
            for mode in (modes if kind == "slots" else ["auto"])]
    for name, width, count, kind, refill, attention in runs:
        if args.only not in name:
            continue
        if time.perf_counter() - begin > args.deadline_s:
            rows.append({"engine": name, "width": width, "skipped": "deadline"})
            continue
        part = reqs[:count]
        if device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        try:
            if kind == "slots":
                res = run_slots(model, part, width, args.temperature, refill, capture, 2048, args.slot_width,
                                attention)
            else:
                res = measure(model, kind, part, width, args, capture)
        except Exception as exc:  # one variant failing must not lose the others
            traceback.print_exc()
            rows.append({"engine": name, "width": width, "error": repr(exc)[:300]})
            continue
        real = sum(b for _, b in part)
        res.update(engine=name, width=width, requests=len(part), real_tokens=real,
                   tok_s=real / res["wall_s"], step_ms=1000 * res["wall_s"] / max(res["steps"], 1),
                   peak_gib=torch.cuda.max_memory_allocated() / 2 ** 30 if device == "cuda" else None)
        rows.append(res)
        print(f"{name} x{width}: {res['tok_s']:,.0f} tok/s ({time.perf_counter() - begin:.0f} s)", flush=True)
        if args.json:
            write(args, device, rows)
    print(table(rows, device, args))
    if args.json:
        write(args, device, rows)


def write(args, device, rows):
    with open(args.json, "w") as f:
        json.dump({"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "tiny": args.tiny,
                   "temperature": args.temperature, "torch": torch.__version__,
                   "transformers": __import__("transformers").__version__, "rows": rows}, f, indent=1)


def table(rows, device, args) -> str:
    lines = [f"generation engines, {'tiny' if args.tiny else 'SmolLM2-135M'} shape, {device}, T={args.temperature}; "
             "tok/s counts real answer tokens only (each row's drawn budget)",
             f"{'engine':40} {'width':>6} {'requests':>8} {'tok/s':>9} {'wall s':>7} {'step ms':>8} {'peak GiB':>8}"]
    for r in rows:
        if "tok_s" not in r:
            lines.append(f"{r['engine']:40} {r['width']:>6} {r.get('skipped') or r.get('error', '')[:60]}")
            continue
        peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "-"
        note = f"  (first call {r['first_call_s']} s)" if "first_call_s" in r else ""
        if "occupancy" in r:  # live rows over slots, summed over the steps: the tail and refills cost this
            note += (f"  (occupancy {r['occupancy']:.0%}, {r['slot_width']} columns, {r['wide_requests']} wide, "
                     f"{r['attention']})")
        lines.append(f"{r['engine']:40} {r['width']:>6} {r['requests']:>8} {r['tok_s']:>9,.0f} {r['wall_s']:>7.1f} "
                     f"{r['step_ms']:>8.2f} {peak:>8}{note}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
