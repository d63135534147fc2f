"""`dflash-pipeline evaluate`: acceptance length (tau) of the drafter against the target, and losslessness.

Speculative decoding with the target (transformers, KV cache) and the exported drafter, greedy:
the drafter drafts a block `[anchor, MASK x (bs-1)]` conditioned on the target features of all accepted
tokens; the target verifies the block in one forward; the leading drafts that equal the target's own
predictions are accepted, plus the target's next token (bonus). tau = mean tokens per target forward
(accepted drafts + 1). The per-position curve is the fraction of blocks whose draft k was accepted.

Prompts: held-out samples of the token shards (sample ids whose hash falls under `--holdout-fraction`,
the same split the train stage leaves out), each cut before its first supervised token.

Losslessness: every speculative output is compared token for token with plain greedy decoding of the
target. A divergence where plain decoding's top-2 logits are within `--tie-tolerance` is reported as a
numerical tie (the block forward and the one-token forward round differently); any other divergence fails.

The trained drafter runs beside an untrained one (same config, random weights). `evaluate-gate` fails the
run unless the trained tau beats the untrained one by `min_tau_gain` and decoding is lossless: wrong
target_layer_ids or shifted labels train a drafter that loads and runs but accepts (almost) nothing.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import torch

from dflash_pipeline import storage
from dflash_pipeline.drafter.runtime import keeps_torch_threads
from dflash_pipeline.errors import PipelineError

log = logging.getLogger("dflash_pipeline.drafter.evaluate")


def add_evaluate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drafter", required=True, help="exported drafter directory (config.json + model.safetensors)")
    p.add_argument("--model", required=True, help="target model directory")
    p.add_argument("--tokens", nargs="+", required=True, help="token shards holding the held-out samples")
    p.add_argument("--holdout-fraction", type=float, required=True)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--min-tau-gain", type=float, default=0.5, help="trained tau must exceed untrained by this")
    p.add_argument("--tie-tolerance", type=float, default=1e-3, help="logit gap treated as a numerical tie")
    p.add_argument("--seed", type=int, default=0, help="init seed of the untrained drafter")
    p.add_argument("--device", default="auto")
    p.add_argument("--cpu-threads", type=int, default=1, help="torch threads on CPU (decoding is many tiny ops)")
    p.add_argument("--out", required=True, help="report JSON")
    p.add_argument("--plot", required=True, help="acceptance-curve PNG")


def add_evaluate_gate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--report", required=True)
    p.add_argument("--out", required=True, help="marker file written when the gate passes")


def _features(hidden_states, layer_ids) -> torch.Tensor:
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


@torch.no_grad()
def greedy_generate(target, prompt: list[int], max_new: int, stop_ids: set[int], device) -> tuple[list[int], list[float]]:
    """Plain greedy decoding with the KV cache; also the top-1 minus top-2 logit gap of each step."""
    out = target(input_ids=torch.tensor([prompt], device=device), use_cache=True)
    past = out.past_key_values
    tokens, gaps = [], []
    logits = out.logits[0, -1].float()
    while True:
        top = torch.topk(logits, 2)
        tok = int(top.indices[0])
        tokens.append(tok)
        gaps.append(float(top.values[0] - top.values[1]))
        if tok in stop_ids or len(tokens) >= max_new:
            return tokens, gaps
        out = target(input_ids=torch.tensor([[tok]], device=device), past_key_values=past, use_cache=True)
        past = out.past_key_values
        logits = out.logits[0, -1].float()


@torch.no_grad()
def speculative_generate(target, drafter, head, prompt: list[int], max_new: int, stop_ids: set[int],
                         device) -> tuple[list[int], list[int]]:
    """Greedy speculative decoding; returns (generated tokens, accepted drafts per target forward)."""
    from dflash_pipeline.drafter.model import ContextCache

    cfg = drafter.config
    bs, ids = cfg.block_size, cfg.target_layer_ids
    dtype = next(drafter.parameters()).dtype
    out = target(input_ids=torch.tensor([prompt], device=device), use_cache=True, output_hidden_states=True)
    past = out.past_key_values
    feats = _features(out.hidden_states, ids)
    feat_pos = torch.arange(len(prompt), device=device)[None]
    cache = ContextCache(len(drafter.layers))
    generated = [int(out.logits[0, -1].argmax())]
    accepted: list[int] = []
    while generated[-1] not in stop_ids and len(generated) < max_new:
        start = len(prompt) + len(generated) - 1  # position of the anchor: the last token, not yet verified
        anchor = generated[-1]
        block = torch.full((1, bs), cfg.mask_token_id, dtype=torch.long, device=device)
        block[0, 0] = anchor
        hidden = drafter(head.embed(block).to(dtype), feats.to(dtype), feat_pos,
                         torch.arange(start, start + bs, device=device)[None], cache=cache)
        draft = head.lm_head(hidden[0, 1:].to(head.lm_head.weight.dtype)).argmax(-1)
        verify = torch.cat([block[0, :1], draft])[None]
        out = target(input_ids=verify, past_key_values=past, use_cache=True, output_hidden_states=True)
        post = out.logits[0].argmax(-1)
        match = (draft == post[:-1]).int()
        acc = int(match.cumprod(0).sum())
        accepted.append(acc)
        new = draft[:acc].tolist() + [int(post[acc])]
        _crop(past, start + acc + 1)
        feats = _features(out.hidden_states, ids)[:, : acc + 1]
        feat_pos = torch.arange(start, start + acc + 1, device=device)[None]
        for tok in new:
            generated.append(tok)
            if tok in stop_ids or len(generated) >= max_new:
                break
    return generated, accepted


def _crop(past, keep: int) -> None:
    """Keep the first `keep` positions of a transformers cache (crop takes a negative count to remove)."""
    extra = past.get_seq_length() - keep
    if extra > 0:
        past.crop(-extra)


def held_out_prompts(paths: list[str], fraction: float, n: int) -> list[dict]:
    from dflash_pipeline.drafter.sources import TokenSource

    src = TokenSource(paths, holdout_fraction=fraction, keep="holdout")
    samples = [src.get(i) for i in range(len(src))]
    samples = [s for s in samples if s["loss_mask"].any()]
    samples.sort(key=lambda s: s["sample_id"])
    prompts = []
    for s in samples[:n]:
        first = int(s["loss_mask"].nonzero()[0][0])
        if first > 0:
            prompts.append({"sample_id": s["sample_id"], "prompt": s["input_ids"][:first].tolist()})
    if not prompts:
        raise PipelineError(f"no held-out prompts: holdout fraction {fraction} selects no sample with a response "
                            f"in {len(paths)} token shard(s); raise evaluate.holdout_fraction")
    return prompts


def _stop_ids(model_dir: str, target) -> set[int]:
    ids: set[int] = set()
    eos = getattr(target.generation_config, "eos_token_id", None)
    if eos is None:
        eos = target.config.eos_token_id
    if eos is not None:
        ids.update([eos] if isinstance(eos, int) else eos)
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_dir)
        if tok.eos_token_id is not None:
            ids.add(int(tok.eos_token_id))
    except Exception:  # noqa: BLE001 - a target without a tokenizer decodes to max_new_tokens
        pass
    return ids


def evaluate_drafter(name, target, drafter, head, prompts, plain, max_new, stop_ids, device, tie_tol) -> dict:
    bs = drafter.config.block_size
    steps, accepted_total, produced = 0, 0, 0
    per_pos = [0] * bs
    exact, ties, failures = 0, 0, []
    t0 = time.perf_counter()
    for p, (ref, gaps) in zip(prompts, plain):
        out, acc = speculative_generate(target, drafter, head, p["prompt"], max_new, stop_ids, device)
        steps += len(acc)
        accepted_total += sum(acc)
        produced += len(out)
        for a in acc:
            for k in range(1, a + 1):
                per_pos[k] += 1
        if out == ref:
            exact += 1
            continue
        diverge = next((i for i, (x, y) in enumerate(zip(out, ref)) if x != y), min(len(out), len(ref)))
        gap = gaps[diverge] if diverge < len(gaps) else None
        if gap is not None and gap <= tie_tol:
            ties += 1
        else:
            failures.append({"sample_id": p["sample_id"], "position": diverge, "top2_gap": gap})
    wall = time.perf_counter() - t0
    tau = (accepted_total + steps) / max(1, steps)
    curve = [None] + [per_pos[k] / max(1, steps) for k in range(1, bs)]
    log.info("%s drafter: tau %.3f over %d target forwards, %d/%d outputs identical to greedy (%d ties)",
             name, tau, steps, exact, len(prompts), ties)
    return {"tau": tau, "target_forwards": steps, "generated_tokens": produced, "acceptance_per_position": curve,
            "identical_outputs": exact, "numerical_ties": ties, "lossless_failures": failures,
            "wall_seconds": round(wall, 2)}


def _run_evaluate(args) -> int:
    from transformers import AutoModelForCausalLM

    from dflash_pipeline.drafter.model import DFlashDrafter
    from dflash_pipeline.drafter.target_head import load_target_head
    from dflash_pipeline.drafter.export import load_exported

    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type == "cpu":
        torch.set_num_threads(max(1, args.cpu_threads))
    target = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device).eval()
    head = load_target_head(args.model, dtype=dtype).to(device)
    trained = load_exported(args.drafter, device=device, dtype=dtype)
    head.check_mask_token(trained.config.mask_token_id)
    torch.manual_seed(args.seed)
    untrained = DFlashDrafter(trained.config).to(device=device, dtype=dtype).eval()
    prompts = held_out_prompts(args.tokens, args.holdout_fraction, args.num_prompts)
    stop_ids = _stop_ids(args.model, target)
    log.info("%d held-out prompts, max %d new tokens, stop ids %s, device %s", len(prompts), args.max_new_tokens,
             sorted(stop_ids), device)
    t0 = time.perf_counter()
    plain = [greedy_generate(target, p["prompt"], args.max_new_tokens, stop_ids, device) for p in prompts]
    plain_wall = time.perf_counter() - t0
    results = {
        name: evaluate_drafter(name, target, d, head, prompts, plain, args.max_new_tokens, stop_ids, device,
                               args.tie_tolerance)
        for name, d in (("untrained", untrained), ("trained", trained))
    }
    tr, un = results["trained"], results["untrained"]
    reasons = []
    if tr["tau"] < un["tau"] + args.min_tau_gain:
        reasons.append(f"trained tau {tr['tau']:.3f} is not clearly better than the untrained drafter's "
                       f"{un['tau']:.3f} (needs +{args.min_tau_gain}): check target_layer_ids, labels and data")
    for name, r in results.items():
        if r["lossless_failures"]:
            reasons.append(f"{name} drafter: {len(r['lossless_failures'])} outputs differ from greedy decoding")
    report = {
        "passed": not reasons, "reasons": reasons,
        "prompts": {"count": len(prompts), "source": "held-out samples of the token shards (sample-id hash "
                    f"< {args.holdout_fraction}, excluded from training), cut before the first response token",
                    "shards": len(args.tokens)},
        "block_size": trained.config.block_size, "target_layer_ids": trained.config.target_layer_ids,
        "max_new_tokens": args.max_new_tokens, "min_tau_gain": args.min_tau_gain, "device": str(device),
        "plain_greedy_wall_seconds": round(plain_wall, 2), "untrained": un, "trained": tr,
    }
    storage.write_json(args.out, report)
    plot_acceptance(results, args.plot)
    print(f"tau trained {tr['tau']:.3f} vs untrained {un['tau']:.3f}; lossless: "
          f"{'yes' if not (tr['lossless_failures'] or un['lossless_failures']) else 'NO'}; "
          f"{'PASS' if report['passed'] else 'FAIL: ' + '; '.join(reasons)}")
    return 0


def plot_acceptance(results: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in results.items():
        curve = r["acceptance_per_position"]
        ks = list(range(1, len(curve)))
        ax.plot(ks, [curve[k] for k in ks], marker="o", label=f"{name} (tau {r['tau']:.2f})")
    ax.set_xlabel("draft position in block (k)")
    ax.set_ylabel("fraction of blocks accepting draft k")
    ax.set_ylim(0, 1.02)
    ax.set_title("DFlash acceptance per block position")
    ax.legend()
    fig.tight_layout()
    with storage.atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, format="png", dpi=90)
    plt.close(fig)


def run_evaluate_gate(args) -> int:
    report = json.loads(Path(args.report).read_text())
    tr, un = report["trained"]["tau"], report["untrained"]["tau"]
    if not report["passed"]:
        raise PipelineError("evaluation gate failed: " + "; ".join(report["reasons"]))
    with storage.atomic_open(args.out, "w") as fh:
        fh.write(f"tau trained {tr:.3f} vs untrained {un:.3f}; lossless\n")
    print(f"evaluation gate passed: tau trained {tr:.3f} vs untrained {un:.3f}")
    return 0


run_evaluate = keeps_torch_threads(_run_evaluate)
