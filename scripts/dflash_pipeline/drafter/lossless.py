"""Is greedy speculative decoding lossless? Where an output departs from plain greedy decoding, tell the numerics
(a tie) from a real divergence (the drafter, the verification or a cache is wrong).

At the first differing position, plain decoding chose `ref` and the speculative run emitted `got`. It is a
**numerical tie** when each forward ranks the other's token within what its logits' dtype resolves of its own
top logit: plain's logit for `got` is at most `tol` below plain's top, and the verification forward's logit for
`ref` at most `tol` below its top, with `tol = max(floor, TIE_ULPS * ulp(|top logit|))`, the ulp of that dtype
at the top logit's magnitude. Both forwards record their NEAR_K best tokens per position
(drafter/batched_decoding.py), so a tie of three or more tokens counts too: on the H100 (SmolLM2-135M, bf16,
batch 80) the untrained and the trained drafter failed an older rule (the same two tokens first, in opposite
order) on the same eight held-out prompts, every one with top-2 gaps of 0 to 0.25 against a tolerance of 0.5
and a gap of exactly 0 in at least one forward: more than two tokens tied there. Anything else is a **real
divergence**, and only those fail the gate.

Why this tolerance: block verification (a block of tokens in one forward) and one-token decoding reduce in a
different order in every matmul and attention, so the same logit comes out rounded differently, and the final
logits are stored in the model's dtype. In bf16 (8 significant bits) one ulp is 0.125 at |logit| 16-32: the
two divergences seen on the H200 (top-2 gaps 0.125 and 0.25 on SmolLM2-135M) were 1-2 ulps, which no fixed
tolerance like 1e-3 can call a tie (it is below one bf16 ulp for any logit above 0.25). Four ulps leave room
for rounding accumulated over the layers; in float32 the same rule allows ~4e-6 at |logit| 8, so a CPU test
cannot pass a wrong token off as a tie. A drafter or cache bug shows as a token the verification does not rank
near its top, or as gaps far above the dtype's resolution.

Ulps alone are not enough: on the H100 (stop 36) one MT-Bench position flipped by 5 ulps (plain gap 0.156 at a top
logit of 4-8, verify gap 0.031), for the untrained and the trained drafter alike. So the rule also measures the
noise at that position: the other tokens both forwards recorded move between the two forwards too, and how far
their logits spread apart (`drift_range`, the range of plain minus verification over those shared tokens) is the
numerics' own size there. The flip (plain_gap + verify_gap: how far the pair's margin moved) is a tie when it is
within NOISE_FACTOR times that spread, provided the spread itself is numerical (<= NOISE_CAP_ULPS ulps): a wrong
cache or mask moves every logit by whole units and is still a failure.
"""

from __future__ import annotations

import math
import statistics

import torch

TIE_ULPS = 4
NOISE_FACTOR = 2.0  # a pair's margin may move this many times as far as the other shared tokens spread
NOISE_CAP_ULPS = 64  # a spread larger than this is not rounding (fp32 on CPU spreads ~14 ulps by itself)

RULE = (f"numerical tie: at the first differing token, plain greedy's logit for the speculative token and the "
        f"verification forward's logit for plain's token are each <= max(tie_tolerance, {TIE_ULPS} ulps of that "
        "forward's top logit in the logits' dtype) below that forward's top logit, or the pair's margin moved "
        f"(plain_gap + verify_gap) by <= {NOISE_FACTOR:g}x the spread of the other shared tokens' logits between the "
        f"two forwards, that spread being <= {NOISE_CAP_ULPS} ulps; any other difference is a lossless failure")


def ulp(dtype_name: str, value: float) -> float:
    """One unit in the last place of `dtype_name` at |value|."""
    eps = torch.finfo(getattr(torch, dtype_name)).eps
    mag = abs(value)
    return eps * 2.0 ** math.floor(math.log2(mag)) if mag > 0 else eps


def tie_tolerance(dtype_name: str, top_logit: float, floor: float) -> float:
    """max(floor, TIE_ULPS ulps of `dtype_name` at |top_logit|)."""
    return max(floor, TIE_ULPS * ulp(dtype_name, top_logit))


def _logits(row, i: int) -> dict[int, float]:
    """The recorded best tokens at position i with their logits (top logit minus each one's distance below it)."""
    return {t: row.top1[i] - g for t, g in zip(row.near_ids[i], row.near_gaps[i])}


def drift_range(plain, verify, i: int, pair: set[int]) -> float | None:
    """The spread (max - min) of plain's minus the verification's logit over the tokens both recorded at position
    i, the pair in question left out; None below two such tokens."""
    a, b = _logits(plain, i), _logits(verify, i)
    drift = [a[t] - b[t] for t in a.keys() & b.keys() - pair]
    return max(drift) - min(drift) if len(drift) >= 2 else None


def _first_difference(out: list[int], ref: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(out, ref)) if x != y), min(len(out), len(ref)))


def _below_top(row, i: int, token: int) -> float | None:
    """How far `token`'s logit lies below the top logit of the forward that chose position i (None: not among the
    tokens recorded there)."""
    return next((g for t, g in zip(row.near_ids[i], row.near_gaps[i]) if t == token), None)


def classify(out, ref, dtype_name: str, floor: float) -> dict | None:
    """None when identical, else {"tie": bool, "position", "plain_gap", "verify_gap", "tolerance", tokens}:
    plain_gap, how far plain's logit for the speculative token lies below its top; verify_gap, how far the
    verification's logit for plain's token lies below its top (None: not among the recorded best tokens).

    `out`, `ref`: RowOutput of the speculative run and of plain greedy decoding (with their records)."""
    if out.tokens == ref.tokens:
        return None
    i = _first_difference(out.tokens, ref.tokens)
    has = lambda row: i < len(row.tokens) and i < len(row.near_ids)  # noqa: E731
    finding = {"position": i, "greedy_token": ref.tokens[i] if i < len(ref.tokens) else None,
               "speculative_token": out.tokens[i] if i < len(out.tokens) else None,
               "plain_gap": None, "verify_gap": None, "top2_gap": ref.gap[i] if i < len(ref.gap) else None,
               "tolerance": None, "drift_range": None, "tie": False}
    if not (has(ref) and has(out)):
        return finding  # one output ends early, or no records (one-prompt fallback): strict
    finding["plain_gap"] = _below_top(ref, i, out.tokens[i])
    finding["verify_gap"] = _below_top(out, i, ref.tokens[i])
    tol_plain = tie_tolerance(dtype_name, ref.top1[i], floor)
    tol_verify = tie_tolerance(dtype_name, out.top1[i], floor)
    finding["tolerance"] = max(tol_plain, tol_verify)
    if finding["plain_gap"] is None or finding["verify_gap"] is None:
        return finding
    within_ulps = finding["plain_gap"] <= tol_plain and finding["verify_gap"] <= tol_verify
    spread = finding["drift_range"] = drift_range(ref, out, i, {ref.tokens[i], out.tokens[i]})
    cap = NOISE_CAP_ULPS * ulp(dtype_name, max(abs(ref.top1[i]), abs(out.top1[i])))
    within_noise = (spread is not None and spread <= cap
                    and finding["plain_gap"] + finding["verify_gap"] <= NOISE_FACTOR * spread)
    finding["tie"] = within_ulps or within_noise
    return finding


def lossless_report(outputs, references, sample_ids, dtype_name: str, floor: float) -> dict:
    """identical_outputs, numerical_ties (count) with `ties` (gap distribution, positions), lossless_failures."""
    exact, ties, failures = 0, [], []
    for out, ref, sid in zip(outputs, references, sample_ids):
        finding = classify(out, ref, dtype_name, floor)
        if finding is None:
            exact += 1
        elif finding.pop("tie"):
            ties.append({"sample_id": sid, **finding})
        else:
            failures.append({"sample_id": sid, **finding})
    gaps = [t["plain_gap"] for t in ties]
    summary = {"count": len(ties), "gap_min": min(gaps) if gaps else None,
               "gap_median": statistics.median(gaps) if gaps else None, "gap_max": max(gaps) if gaps else None,
               "positions": ties, "logits_dtype": dtype_name, "rule": RULE}
    return {"identical_outputs": exact, "numerical_ties": len(ties), "ties": summary, "lossless_failures": failures}
