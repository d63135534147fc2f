"""`dflash-pipeline evaluate`: acceptance length (tau) of the drafter against the target, and losslessness.

Speculative decoding (drafter/speculative.py) with the target (transformers, KV cache) and the exported
drafter. tau = mean tokens per target forward (accepted drafts + 1); the per-position curve is the fraction
of blocks whose draft k was accepted. Greedy decoding always runs (the gate and the lossless check); each
temperature > 0 in `--temperatures` adds a run with speculative sampling (rejection sampling: the output is
distributed as the target's own sampling at that temperature), since users serve at T > 0 and tau moves
with it. The gate looks at the greedy run only.

Prompts: held-out samples of the token shards (sample ids whose hash falls under `--holdout-fraction`,
the same split the train stage leaves out), each cut before its first supervised token.

Decoding is batched (drafter/batched_decoding.py: many prompts at once, each row at its own positions, a
step captured as a CUDA graph on a GPU), `--batch-size` rows of similar prompt length at a time; plain greedy
decoding runs once per prompt set and is shared by all drafters. Prompts longer than the target's room
(max_position_embeddings - max_new_tokens - block_size) are skipped with a count (an error if none remain).

Losslessness: every greedy speculative output is compared token for token with plain greedy decoding of the
target. A difference where each forward ranks the other's token within the logits' dtype resolution of its
own top logit (max(`--tie-tolerance`, 4 ulps): drafter/lossless.py) is a numerical tie
(block verification and one-token decoding round differently), reported with its gap distribution; any other
difference is a lossless failure and fails the gate.

The report also gives the wall-clock speedup of speculative over plain greedy decoding at batch 1, both sides
graph-captured on a GPU (`--speedup-prompts` prompts), beside tau.

Kinds of turn: tau on turns whose output is a tool call and on chat turns, separately (`by_turn` in each run,
`turns` in the report). A turn is a tool call when the target's own output in that run opens a call in the
layout of its chat template (Qwen's `<tool_call>`, the layout the pipeline's hf engine and tool masks read): at
serving time the model's output, not the data set, decides which requests are agentic, and the data may come
from another model. The data's own next turn is counted beside it (`turns.data`). Targets whose template has no
`<tool_call>` get no breakdown (`turns.unavailable` says why).

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
    p.add_argument("--num-prompts", type=int)
    p.add_argument("--max-new-tokens", type=int)
    p.add_argument("--min-tau-gain", type=float, help="trained tau must exceed untrained by this")
    p.add_argument("--tie-tolerance", type=float,
                   help="absolute floor of the logit distance treated as a numerical tie; the tolerance is the larger "
                        "of this and 4 ulps of the top logit in the logits' dtype (bf16: 0.5 at |logit| 16-32)")
    p.add_argument("--batch-size", type=int, help="prompts decoded together (rows of similar length)")
    p.add_argument("--eager", action="store_true", default=None, help="no CUDA graphs on a GPU (they are never used on CPU)")
    p.add_argument("--speedup-prompts", type=int,
                   help="held-out prompts timed at batch 1, speculative vs plain greedy (0: not measured)")
    p.add_argument("--temperatures", type=float, nargs="+",
                   help="tau at each; 0 is greedy (always run: the gate and the lossless check), > 0 speculative "
                        "sampling")
    p.add_argument("--prompts-file",
                   help="evaluation prompts beside the held-out split: MT-Bench question.jsonl (question_id, category, "
                        "turns; the first turn is asked) or pkg://PACKAGE/PATH; tau per category and pooled")
    p.add_argument("--seed", type=int, default=0, help="init seed of the untrained drafter and the sampling seed")
    p.add_argument("--device", default="auto")
    p.add_argument("--trust-remote-code", action="store_true", default=None, help="run the target's own modeling code")
    p.add_argument("--cpu-threads", type=int, help="torch threads on CPU (decoding is many tiny ops)")
    p.add_argument("--out", required=True, help="report JSON")
    p.add_argument("--plot", required=True, help="acceptance-curve PNG")


def held_out_prompts(paths: list[str], fraction: float, n: int) -> list[dict]:
    """Each held-out sample's tokens up to its first supervised token (the token row tokenize wrote: the target's
    chat template with the sample's tools, data/chat_masking.py), and the data's own first response (`data_turn`:
    the supervised run that follows)."""
    from dflash_pipeline.drafter.sources import TokenSource

    src = TokenSource(paths, holdout_fraction=fraction, keep="holdout")
    samples = [src.get(i) for i in range(len(src))]
    samples = [s for s in samples if s["loss_mask"].any()]
    samples.sort(key=lambda s: s["sample_id"])
    prompts = []
    for s in samples[:n]:
        mask = s["loss_mask"].tolist()
        first = mask.index(1)
        end = mask.index(0, first) if 0 in mask[first:] else len(mask)
        if first > 0:
            prompts.append({"sample_id": s["sample_id"], "prompt": s["input_ids"][:first].tolist(),
                            "data_turn": s["input_ids"][first:end].tolist()})
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


TURN_KINDS = ("tool_call", "chat")


class TurnKinds:
    """Tells a tool-call turn from a chat turn by the text of its tokens: a turn that opens a call in Qwen's layout
    (`<tool_call>`, generation/tool_calls.py) calls a tool, whether or not the call is complete (a call cut by
    max_new_tokens is still call tokens to draft). Only for targets whose chat template writes calls that way
    (`unavailable` says why not)."""

    def __init__(self, tokenizer):
        from dflash_pipeline.generation.tool_calls import QWEN_CALL_MARK

        self.tokenizer, self.mark = tokenizer, QWEN_CALL_MARK
        template = getattr(tokenizer, "chat_template", None)
        self.unavailable = None if isinstance(template, str) and QWEN_CALL_MARK in template else (
            f"the target's chat template writes no {QWEN_CALL_MARK} calls: tool-call turns cannot be told apart")

    @classmethod
    def of_model(cls, model_dir: str, trust_remote_code: bool = False) -> "TurnKinds | None":
        """The target's TurnKinds, or None when it has no tokenizer (nothing to decode the outputs with)."""
        from dflash_pipeline.target import load_tokenizer

        try:
            return cls(load_tokenizer(model_dir, trust_remote_code=trust_remote_code))
        except Exception as exc:  # noqa: BLE001 - a target without a tokenizer: no breakdown, said in the log
            log.warning("no tokenizer for %s (%s): tau is not reported per kind of turn", model_dir, exc)
            return None

    def __call__(self, tokens: list[int]) -> str:
        text = self.tokenizer.decode(list(tokens), skip_special_tokens=False)
        return "tool_call" if self.mark in text else "chat"


def _by_turn(rows: list, kinds: "TurnKinds | None", bs: int) -> dict | None:
    """tau, forwards, curve and prompt count per kind of turn, each row's kind from the tokens it generated."""
    if kinds is None or kinds.unavailable:
        return None
    groups: dict[str, list[list[int]]] = {k: [] for k in TURN_KINDS}
    for r in rows:
        groups[kinds(r.tokens)].append(r.accepted)
    out = {}
    for kind, accepted in groups.items():
        if accepted:
            out[kind] = {"prompts": len(accepted), **_acceptance([a for acc in accepted for a in acc], bs)}
        else:
            out[kind] = {"prompts": 0, "tau": None, "target_forwards": 0, "acceptance_per_position": None}
    return out


def _as_rows(plain) -> list:
    """Plain greedy outputs as RowOutput (older callers pass greedy_generate's (tokens, gaps) pairs)."""
    from dflash_pipeline.drafter.batched_decoding import RowOutput

    return [r if isinstance(r, RowOutput) else RowOutput(list(r[0]), gap=list(r[1])) for r in plain]


def plain_greedy(target, prompts, max_new, stop_ids, batch_size: int = 32, graphs: bool = True):
    """Plain greedy decoding of every prompt (batched), shared by all drafters: (rows, timing)."""
    from dflash_pipeline.drafter.decode_sets import decode_all

    return decode_all(target, [p["prompt"] for p in prompts], max_new, stop_ids, batch_size=batch_size,
                      graphs=graphs)


def _run_stats(rows, timing, t0, prompts, bs, kinds, check: dict | None = None) -> dict:
    """One drafter's report at one temperature (the keys in report.json's order): acceptance, tokens, the
    lossless check (greedy only), times, and tau per category and per kind of turn."""
    per_prompt = [r.accepted for r in rows]
    return {**_acceptance([a for acc in per_prompt for a in acc], bs),
            "generated_tokens": sum(len(r.tokens) for r in rows), **(check or {}),
            "wall_seconds": round(time.perf_counter() - t0, 2), "decode_seconds": round(timing["decode_seconds"], 3),
            "by_category": _by_category(prompts, per_prompt, bs), "by_turn": _by_turn(rows, kinds, bs)}


def evaluate_drafter(name, target, drafter, head, prompts, plain, max_new, stop_ids, device, tie_tol,
                     batch_size: int = 32, graphs: bool = True, kinds: TurnKinds | None = None) -> dict:
    """Greedy: tau, and every output compared token for token with plain greedy decoding (drafter/lossless.py:
    a difference is a numerical tie or a lossless failure)."""
    from dflash_pipeline.drafter.decode_sets import decode_all
    from dflash_pipeline.drafter.lossless import lossless_report

    t0 = time.perf_counter()
    rows, timing = decode_all(target, [p["prompt"] for p in prompts], max_new, stop_ids, drafter=drafter, head=head,
                              batch_size=batch_size, graphs=graphs)
    check = lossless_report(rows, _as_rows(plain), [p["sample_id"] for p in prompts], timing["logits_dtype"],
                            tie_tol)
    stats = _run_stats(rows, timing, t0, prompts, drafter.config.block_size, kinds, check)
    log.info("%s drafter, greedy: tau %.3f over %d target forwards, %d/%d outputs identical to greedy (%d ties, "
             "%d failures)", name, stats["tau"], stats["target_forwards"], check["identical_outputs"], len(prompts),
             check["numerical_ties"], len(check["lossless_failures"]))
    return stats


def evaluate_sampled(name, target, drafter, head, prompts, max_new, stop_ids, device, temperature, seed,
                     batch_size: int = 32, graphs: bool = True, kinds: TurnKinds | None = None) -> dict:
    """Temperature > 0: tau under speculative sampling (lossless by construction: rejection sampling)."""
    from dflash_pipeline.drafter.batched_rules import BatchedSampling
    from dflash_pipeline.drafter.decode_sets import decode_all

    t0 = time.perf_counter()
    rows, timing = decode_all(target, [p["prompt"] for p in prompts], max_new, stop_ids, drafter=drafter, head=head,
                              rule=BatchedSampling(temperature), seed=seed, batch_size=batch_size, graphs=graphs)
    stats = _run_stats(rows, timing, t0, prompts, drafter.config.block_size, kinds)
    log.info("%s drafter, temperature %g: tau %.3f over %d target forwards", name, temperature, stats["tau"],
             stats["target_forwards"])
    return stats


def evaluate_prompt_set(args, target, head, drafters, prompts, stop_ids, device,
                        kinds: TurnKinds | None = None) -> tuple[dict, dict, float, list]:
    """Greedy (tau + lossless check against plain greedy) and each sampled temperature, for every drafter; the
    plain greedy outputs last."""
    t0 = time.perf_counter()
    run = dict(batch_size=args.batch_size, graphs=not args.eager, kinds=kinds)
    plain, _ = plain_greedy(target, prompts, args.max_new_tokens, stop_ids, batch_size=args.batch_size,
                            graphs=not args.eager)
    plain_wall = time.perf_counter() - t0
    greedy = {name: evaluate_drafter(name, target, d, head, prompts, plain, args.max_new_tokens, stop_ids, device,
                                     args.tie_tolerance, **run) for name, d in drafters.items()}
    sampled_temps = sorted({float(t) for t in args.temperatures if float(t) > 0})
    sampled = {f"{t:g}": {name: evaluate_sampled(name, target, d, head, prompts, args.max_new_tokens, stop_ids,
                                                  device, t, args.seed, **run) for name, d in drafters.items()}
               for t in sampled_temps}
    return greedy, sampled, plain_wall, plain


def speedup_at_batch_1(target, drafter, head, prompts, max_new, stop_ids, graphs: bool = True) -> dict:
    """Wall-clock speedup of greedy speculative decoding over plain greedy decoding, one prompt at a time, both
    sides graph-captured on a GPU (capture excluded: a server captures once): what a user serving at batch 1
    sees, beside tau."""
    from dflash_pipeline.drafter.decode_sets import decode_all

    ids = [p["prompt"] for p in prompts]
    plain, tp = decode_all(target, ids, max_new, stop_ids, batch_size=1, graphs=graphs)
    spec, ts = decode_all(target, ids, max_new, stop_ids, drafter=drafter, head=head, batch_size=1, graphs=graphs)
    stats = _acceptance([a for r in spec for a in r.accepted], drafter.config.block_size)
    n_plain, n_spec = sum(len(r.tokens) for r in plain), sum(len(r.tokens) for r in spec)
    return {"prompts": len(prompts), "plain_seconds": round(tp["decode_seconds"], 4),
            "speculative_seconds": round(ts["decode_seconds"], 4),
            "speedup": round(tp["decode_seconds"] / max(ts["decode_seconds"], 1e-9), 3), "tau": stats["tau"],
            "plain_tokens_per_s": round(n_plain / max(tp["decode_seconds"], 1e-9), 1),
            "speculative_tokens_per_s": round(n_spec / max(ts["decode_seconds"], 1e-9), 1),
            "cuda_graphs": graphs and next(target.parameters()).device.type == "cuda"}


def context_room(target, max_new: int, block_size: int) -> int | None:
    """Longest prompt the target can decode max_new tokens after (plus a verification block), or None."""
    from dflash_pipeline.target import text_config

    mpe = getattr(text_config(target.config), "max_position_embeddings", None)
    return None if not mpe else int(mpe) - max_new - block_size


def fit_prompts(prompts: list[dict], room: int | None, what: str) -> tuple[list[dict], dict]:
    """The prompts that fit the target's context; the others are skipped with a count (an error if none fit)."""
    long = [p for p in prompts if room is not None and len(p["prompt"]) > room]
    kept = [p for p in prompts if not (room is not None and len(p["prompt"]) > room)]
    skipped = {"count": len(long), "room_tokens": room, "sample_ids": [p["sample_id"] for p in long][:20],
               "longest": max((len(p["prompt"]) for p in long), default=None)}
    if long:
        print(f"{what}: skipped {len(long)} of {len(prompts)} prompts longer than the target's room of {room} tokens "
              f"(max_position_embeddings - max_new_tokens - block_size; longest {skipped['longest']})")
    if not kept:
        raise PipelineError(f"{what}: all {len(prompts)} prompts are longer than the target's room of {room} tokens "
                            "(max_position_embeddings - max_new_tokens - block_size): nothing to evaluate; lower "
                            "evaluate.max_new_tokens or use shorter prompts")
    return kept, skipped


def tau_table(greedy: dict, sampled: dict) -> dict:
    """{temperature: {drafter: {"pooled": tau, "by_category": {category: tau}}}} ("0" is greedy)."""
    runs = {"0": greedy, **sampled}
    return {t: {name: {"pooled": r["tau"], "by_category": {c: v["tau"] for c, v in r["by_category"].items()}}
                for name, r in by.items()} for t, by in runs.items()}


def turn_table(greedy: dict, sampled: dict) -> dict:
    """{temperature: {drafter: {kind: {"tau", "prompts"}}}} ("0" is greedy), from each run's `by_turn`."""
    runs = {"0": greedy, **sampled}
    return {t: {name: {k: {"tau": v["tau"], "prompts": v["prompts"]} for k, v in r["by_turn"].items()}
                for name, r in by.items()} for t, by in runs.items()}


def turns_report(prompts: list[dict], greedy: dict, sampled: dict, kinds: TurnKinds | None, plain: list) -> dict:
    """The held-out set's tau per kind of turn (the target's output in each run decides), the data's own next
    turns counted the same way, and how the kinds of the target's plain greedy outputs compare with the data's."""
    if kinds is None:
        return {"unavailable": "the target has no tokenizer to read its outputs with"}
    if kinds.unavailable:
        return {"unavailable": kinds.unavailable}
    out = {"kind_of_turn": f"tool_call: the target's output in that run opens a {kinds.mark} call; chat: any other",
           "tau": turn_table(greedy, sampled)}
    if all("data_turn" in p for p in prompts):
        data = [kinds(p["data_turn"]) for p in prompts]
        pairs = list(zip(data, (kinds(r.tokens) for r in _as_rows(plain))))
        out["data"] = {k: data.count(k) for k in TURN_KINDS}
        out["greedy_vs_data"] = {f"data {d}, target {t}": pairs.count((d, t)) for d in TURN_KINDS for t in TURN_KINDS}
    return out


def _prompts_file_report(args, target, head, drafters, stop_ids, device, room,
                         kinds: TurnKinds | None = None) -> dict | None:
    if not args.prompts_file:
        return None
    prompts = file_prompts(args.prompts_file, args.model, args.trust_remote_code)
    log.info("%d prompts from %s", len(prompts), args.prompts_file)
    prompts, skipped = fit_prompts(prompts, room, args.prompts_file)
    greedy, sampled, plain_wall, _ = evaluate_prompt_set(args, target, head, drafters, prompts, stop_ids, device,
                                                         kinds)
    categories: dict[str, int] = {}
    for p in prompts:
        categories[p["category"]] = categories.get(p["category"], 0) + 1
    return {"path": args.prompts_file, "count": len(prompts), "categories": categories,
            "skipped_long_prompts": skipped,
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
    room = context_room(target, args.max_new_tokens, drafters["trained"].config.block_size)
    prompts, skipped = fit_prompts(held_out_prompts(args.tokens, args.holdout_fraction, args.num_prompts), room,
                                   "held-out prompts")
    stop_ids = _stop_ids(args.model, target, args.trust_remote_code)
    log.info("%d held-out prompts, max %d new tokens, stop ids %s, device %s, temperatures %s", len(prompts),
             args.max_new_tokens, sorted(stop_ids), device, sorted({0.0, *map(float, args.temperatures)}))
    kinds = TurnKinds.of_model(args.model, args.trust_remote_code)
    greedy, sampled, plain_wall, plain = evaluate_prompt_set(args, target, head, drafters, prompts, stop_ids, device,
                                                             kinds)
    from_file = _prompts_file_report(args, target, head, drafters, stop_ids, device, room, kinds)
    speedup = None
    if args.speedup_prompts > 0:
        speedup = speedup_at_batch_1(target, drafters["trained"], head, prompts[: args.speedup_prompts],
                                     args.max_new_tokens, stop_ids, graphs=not args.eager)
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
                    "shards": len(args.tokens), "skipped_long_prompts": skipped},
        "block_size": drafters["trained"].config.block_size,
        "target_layer_ids": drafters["trained"].config.target_layer_ids,
        "max_new_tokens": args.max_new_tokens, "min_tau_gain": args.min_tau_gain, "device": str(device),
        "batch_size": args.batch_size, "cuda_graphs": device.type == "cuda" and not args.eager,
        "plain_greedy_wall_seconds": round(plain_wall, 2), "untrained": un, "trained": tr,
        # tau per temperature; "0" is the greedy run above (the gate's), others speculative sampling
        "temperatures": {"0": {n: r["tau"] for n, r in greedy.items()},
                         **{t: {n: r["tau"] for n, r in by.items()} for t, by in sampled.items()}},
        "speedup_batch1": speedup,
        "sampled": sampled, "sampling": "temperature only (no top-k/top-p), seed " + str(args.seed),
        "prompts_file": from_file,
        # tau on tool-call turns and on chat turns of the held-out set (the target's output decides the kind)
        "turns": turns_report(prompts, greedy, sampled, kinds, plain),
    }
    storage.write_json(args.out, report)
    plot_acceptance(greedy, sampled, args.plot, from_file)
    _print_summary(args, report, greedy, sampled, from_file)
    return 0


def _print_summary(args, report: dict, greedy: dict, sampled: dict, from_file: dict | None) -> None:
    tr, un = greedy["trained"], greedy["untrained"]
    at_t = "".join(f"; T={t}: {by['trained']['tau']:.3f} vs {by['untrained']['tau']:.3f}" for t, by in sampled.items())
    ties = sum(r["numerical_ties"] for r in greedy.values())
    print(f"tau trained {tr['tau']:.3f} vs untrained {un['tau']:.3f} (greedy){at_t}; lossless: "
          f"{'yes' if not (tr['lossless_failures'] or un['lossless_failures']) else 'NO'}"
          f"{f' ({ties} numerical ties)' if ties else ''}; "
          f"{'PASS' if report['passed'] else 'FAIL: ' + '; '.join(report['reasons'])}")
    if report["speedup_batch1"]:
        s = report["speedup_batch1"]
        print(f"batch 1, greedy, {s['prompts']} prompts: speculative {s['speculative_tokens_per_s']:.0f} tok/s vs plain "
              f"{s['plain_tokens_per_s']:.0f} tok/s: speedup {s['speedup']:.2f}x at tau {s['tau']:.2f}"
              f"{' (CUDA graphs)' if s['cuda_graphs'] else ''}")
    for t, by in (report.get("turns") or {}).get("tau", {}).items():
        parts = [f"{k} {_tau_text(by['trained'][k]['tau'])} vs {_tau_text(by['untrained'][k]['tau'])} "
                 f"({by['trained'][k]['prompts']} prompts)" for k in TURN_KINDS]
        print(f"held-out {'greedy' if t == '0' else 'T=' + t}, by kind of turn (the target's output), tau trained vs "
              f"untrained: {'; '.join(parts)}")
    for t, by in (from_file or {}).get("tau", {}).items():
        cats = ", ".join(f"{c} {v:.2f}" for c, v in by["trained"]["by_category"].items())
        print(f"{args.prompts_file} T={t}: tau trained {by['trained']['pooled']:.3f} vs untrained "
              f"{by['untrained']['pooled']:.3f} pooled; trained by category: {cats}")


def _tau_text(tau: float | None) -> str:
    return "-" if tau is None else f"{tau:.3f}"


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


run_evaluate = keeps_torch_threads(_run_evaluate)
