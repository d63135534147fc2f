"""Batched speculative decoding (and plain greedy decoding) of many prompts at once, for evaluation.

The one-prompt path (drafter/speculative.py) is the reference: per row, this gives the same tokens and, under
greedy verification, the same drafts kept at every step (tests/test_batched_decoding.py). Rows accept
different numbers of drafts, so every row keeps its own positions: the caches are indexed by position
(drafter/position_caches.py) and a row's state (tokens so far, anchor position, step count) lives in tensors
that a step updates in place, without a host synchronisation. A step (drafter block, target block
verification, acceptance, bookkeeping) therefore has static shapes and runs as one CUDA graph on a GPU
(eagerly on CPU); the host only checks every few steps whether a row is still running. Finished rows stay
in the batch and change nothing.

Only targets whose layers are all full attention with sdpa or eager attention take this path
(`supports_batched`); others (hybrid linear attention) decode one prompt at a time.
"""

from __future__ import annotations

import gc
import inspect
import time
from dataclasses import dataclass, field

import torch

from dflash_pipeline.drafter.batched_rules import BATCHED_GREEDY, uniforms
from dflash_pipeline.drafter.position_caches import PositionContextCache, PositionKVCache, additive_mask
from dflash_pipeline.target import text_config
from dflash_pipeline.target_layers import LayerOutputs


@dataclass
class RowOutput:
    """One prompt's decoding; greedy runs also record, per generated token, the forward that chose it: its top
    logit, top-1 minus top-2 gap, and its NEAR_K best tokens with each one's distance below the top logit (the
    lossless check's tie evidence: several tokens can tie within the dtype's resolution, not only two)."""

    tokens: list[int]
    accepted: list[int] = field(default_factory=list)  # drafts kept per target forward (speculative)
    top1: list[float] = field(default_factory=list)
    gap: list[float] = field(default_factory=list)
    near_ids: list[list[int]] = field(default_factory=list)
    near_gaps: list[list[float]] = field(default_factory=list)


@dataclass
class BatchRun:
    rows: list[RowOutput]
    decode_seconds: float  # prefill + steps, synchronised; allocation and graph capture excluded
    setup_seconds: float
    prefill_seconds: float  # of decode_seconds: the prompts' prefill (synchronised before the first step)
    logits_dtype: torch.dtype


def supports_batched(target) -> bool:
    tc = text_config(target.config)
    kinds = set(getattr(tc, "layer_types", None) or ["full_attention"])
    impl = getattr(target.config, "_attn_implementation", None) or "sdpa"
    return kinds == {"full_attention"} and impl in ("sdpa", "eager")


class StepGraph:
    """`fn` (no arguments, static tensors only) captured as a CUDA graph on a GPU, called eagerly elsewhere."""

    def __init__(self, fn, device: torch.device, enabled: bool):
        self.fn, self.graph = fn, None
        if enabled and device.type == "cuda":
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(2):  # warm-up: lazy initialisation and kernel selection outside the capture
                    fn()
            torch.cuda.current_stream(device).wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            # no garbage collection inside the capture: freeing an earlier graph there (a decoder or a compiled
            # training step left in a reference cycle; torch no longer collects before a capture) invalidates it
            # (H100, stop 37: "operation not permitted when stream is capturing (function reset)")
            gc.collect()
            gc.disable()
            try:
                with torch.cuda.graph(self.graph):
                    fn()
            finally:
                gc.enable()

    def __call__(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.fn()


class _Target:
    """The target's forward over a position-indexed cache with an explicit mask (4D masks pass through)."""

    def __init__(self, target, batch: int, length: int, device):
        self.model = target
        self.dtype = next(target.parameters()).dtype
        self.cache = PositionKVCache(target.config, batch, length, self.dtype, device)
        params = inspect.signature(target.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"  # transformers >= 5.2x: `cache`
        self.additive = getattr(target.config, "_attn_implementation", None) == "eager"

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, keep=None) -> torch.Tensor:
        self.cache.positions = positions
        mask = self.cache.causal_mask(positions)
        if self.additive:
            mask = additive_mask(mask, self.dtype)
        kw = {self.cache_kw: self.cache}
        if keep is not None:
            kw["logits_to_keep"] = keep
        return self.model(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=True, **kw).logits


NEAR_K = 8  # tokens recorded per greedy position: bf16 logits of a small model tie three or more ways at times


def _near(logits: torch.Tensor):
    """(top logit, top-1 minus top-2 gap, the NEAR_K best token ids, each one's distance below the top logit)
    per position, float32."""
    vals, idx = logits.topk(min(NEAR_K, logits.shape[-1]), dim=-1)
    vals = vals.float()
    return vals[..., 0], vals[..., 0] - vals[..., 1], idx, vals[..., :1] - vals


class _Rows:
    """Per-row decoding state on the device, updated in place by each step."""

    def __init__(self, batch: int, max_new: int, width: int, vocab: int, device):
        long = dict(dtype=torch.long, device=device)
        self.tokens = torch.zeros(batch, max_new + width, **long)
        self.count = torch.zeros(batch, **long)  # tokens generated so far
        self.start = torch.zeros(batch, **long)  # position of the anchor: the last generated token
        self.last = torch.zeros(batch, **long)  # the anchor token
        self.active = torch.zeros(batch, dtype=torch.bool, device=device)
        self.steps = torch.zeros(batch, **long)  # target forwards after the prefill (the RNG counter too)
        self.accepted = torch.full((batch, max_new + 1), -1, **long)
        self.top1 = torch.zeros(batch, max_new + width, dtype=torch.float32, device=device)
        self.gap = torch.zeros_like(self.top1)
        k = min(NEAR_K, vocab)
        self.near_ids = torch.zeros(batch, max_new + width, k, **long)
        self.near_gaps = torch.zeros(batch, max_new + width, k, dtype=torch.float32, device=device)
        self.max_new = max_new

    def record_step(self, kept: torch.Tensor) -> None:
        """Drafts kept by this forward (-1 for finished rows), then count the forward."""
        self.accepted.scatter_(1, self.steps[:, None], torch.where(self.active, kept, -1)[:, None])
        self.steps += self.active.long()

    def emit(self, emitted: torch.Tensor, n_new: torch.Tensor, stop: torch.Tensor, records=None) -> None:
        """Append emitted[:, :n_new] to each active row, cut after a stop token or at max_new."""
        offs = torch.arange(emitted.shape[1], device=emitted.device)
        cols = self.count[:, None] + offs
        self.tokens.scatter_(1, cols, emitted)
        if records is not None:
            for buf, value in zip(self.records(), records):
                index = cols if value.dim() == 2 else cols[..., None].expand_as(value)
                buf.scatter_(1, index, value)
        stop_hit = (emitted[..., None] == stop).any(-1) & (offs[None] < n_new[:, None])
        upto = torch.where(stop_hit.any(1), stop_hit.int().argmax(1) + 1, n_new)
        take = torch.minimum(upto, self.max_new - self.count) * self.active.long()
        done = (stop_hit & (offs[None] < take[:, None])).any(1) | (self.count + take >= self.max_new)
        last = emitted.gather(1, (take - 1).clamp_min(0)[:, None]).squeeze(1)
        self.last.copy_(torch.where(take > 0, last, self.last))
        self.count += take
        self.start += take
        self.active &= ~done

    def records(self) -> tuple[torch.Tensor, ...]:
        """The per-token tie evidence, in _near's order."""
        return self.top1, self.gap, self.near_ids, self.near_gaps

    def outputs(self, speculative: bool, records: bool) -> list[RowOutput]:
        count, steps = self.count.tolist(), self.steps.tolist()
        tokens, acc = self.tokens.tolist(), self.accepted.tolist()
        top1, gap, near_ids, near_gaps = (t.tolist() for t in self.records()) if records else ([],) * 4
        rows = []
        for b, n in enumerate(count):
            row = RowOutput(tokens[b][:n], acc[b][: steps[b]] if speculative else [])
            if records:
                row.top1, row.gap = top1[b][:n], gap[b][:n]
                row.near_ids, row.near_gaps = near_ids[b][:n], near_gaps[b][:n]
            rows.append(row)
        return rows


class BatchDecoder:
    """Decodes `prompts` together: speculative with `drafter` + `head` under `rule`, else plain greedy.

    `uids` name the rows for the counter-based randomness (a row's draws do not depend on its batch).
    """

    def __init__(self, target, prompts: list[list[int]], max_new: int, stop_ids, *, drafter=None, head=None,
                 rule=BATCHED_GREEDY, seed: int = 0, uids=None, graphs: bool = True):
        t0 = time.perf_counter()
        self.device = next(target.parameters()).device
        self.prompts, self.max_new, self.rule, self.seed = prompts, max_new, rule, seed
        self.drafter, self.head = drafter, head
        self.width = drafter.config.block_size if drafter is not None else 1
        self.record = rule.temperature == 0
        batch, longest = len(prompts), max(len(p) for p in prompts)
        length = longest + max_new + self.width
        self.tgt = _Target(target, batch, length, self.device)
        self.rows = _Rows(batch, max_new, self.width, text_config(target.config).vocab_size, self.device)
        self.uid = torch.tensor(list(uids if uids is not None else range(batch)), dtype=torch.long, device=self.device)
        self.stop = torch.tensor(sorted(stop_ids), dtype=torch.long, device=self.device)
        self.cap = None
        if drafter is not None:
            cfg = drafter.config
            self.cap = LayerOutputs(target, cfg.target_layer_ids)
            self.ddtype = next(drafter.parameters()).dtype
            self.dcache = PositionContextCache(cfg, batch, length, self.ddtype, self.device)
            self.feats = torch.zeros(batch, self.width, len(cfg.target_layer_ids) * text_config(target.config).hidden_size,
                                     dtype=self.tgt.dtype, device=self.device)
            self.ctx_pos = torch.zeros(batch, self.width, dtype=torch.long, device=self.device)
            self.mask_ids = torch.full((batch, self.width - 1), cfg.mask_token_id, dtype=torch.long, device=self.device)
            step = lambda: self._spec_step(self.feats, self.ctx_pos)  # noqa: E731
        else:
            step = self._plain_step
        self.ones = torch.ones(batch, dtype=torch.long, device=self.device)
        try:
            # captured before the prefill: the warm-up runs on the zeroed state, which the prefill overwrites
            with torch.no_grad():
                self.step = StepGraph(step, self.device, graphs)
        except BaseException:
            self.close()
            raise
        _sync(self.device)
        self.setup_seconds = time.perf_counter() - t0

    def _prefill(self) -> None:
        """The prompts' forward (right-padded), the first token of every row, and (speculative) the first step
        with the prompts' features as the drafter's context."""
        rows, dev = self.rows, self.device
        lengths = torch.tensor([len(p) for p in self.prompts], dtype=torch.long, device=dev)
        longest = max(len(p) for p in self.prompts)
        ids = torch.zeros(len(self.prompts), longest, dtype=torch.long, device=dev)
        for b, p in enumerate(self.prompts):
            ids[b, : len(p)] = torch.tensor(p, dtype=torch.long)
        pos = torch.arange(longest, device=dev)[None].expand(len(self.prompts), -1)
        keep = torch.unique(lengths - 1)  # the LM head only at each row's last prompt token
        logits = self.tgt(ids, pos, keep)
        col = torch.searchsorted(keep, lengths - 1) if logits.shape[1] == keep.numel() else lengths - 1
        last = logits.gather(1, col[:, None, None].expand(-1, 1, logits.shape[-1])).squeeze(1)
        for t in (rows.count, rows.steps, rows.tokens, *rows.records()):
            t.zero_()
        rows.accepted.fill_(-1)
        rows.start.copy_(lengths - 1)
        rows.active.fill_(True)
        first = self.rule.first(last, uniforms(self.seed, self.uid, rows.steps, 1))
        records = [r[:, None] for r in _near(last)] if self.record else None
        rows.emit(first[:, None], self.ones, self.stop, records)
        if self.cap is not None:
            self._spec_step(self.cap.features(), pos)

    def _spec_step(self, feats: torch.Tensor, ctx_pos: torch.Tensor) -> None:
        """Draft a block per row, verify it in one target forward, keep what the rule accepts."""
        rows, bs = self.rows, self.width
        block_pos = rows.start[:, None] + torch.arange(bs, device=self.device)
        block = torch.cat([rows.last[:, None], self.mask_ids], 1)
        self.dcache.positions = ctx_pos
        hidden = self.drafter(self.head.embed(block).to(self.ddtype), feats.to(self.ddtype), ctx_pos, block_pos,
                              mask=self.dcache.block_mask(rows.start, bs), cache=self.dcache)
        draft_logits = self.head.lm_head(hidden[:, 1:].to(self.head.lm_head.weight.dtype))
        slots = self.rule.slots_for(bs)
        u = uniforms(self.seed, self.uid, rows.steps + 1, slots) if slots else None
        draft, q = self.rule.propose(draft_logits, u)
        logits = self.tgt(torch.cat([rows.last[:, None], draft], 1), block_pos)
        new_feats = self.cap.features()
        kept, emitted = self.rule.accept(draft, q, logits, u)
        self.feats.copy_(new_feats)
        self.ctx_pos.copy_(block_pos)
        rows.record_step(kept)
        rows.emit(emitted, kept + 1, self.stop, _near(logits) if self.record else None)

    def _plain_step(self) -> None:
        rows = self.rows
        logits = self.tgt(rows.last[:, None], rows.start[:, None])
        nxt = logits.argmax(-1)
        rows.steps += rows.active.long()
        rows.emit(nxt, self.ones, self.stop, _near(logits))

    def run(self) -> BatchRun:
        try:
            t0 = time.perf_counter()
            with torch.no_grad():
                self._prefill()
                _sync(self.device)
                prefill = time.perf_counter() - t0
                check = 8 if self.device.type == "cuda" else 1  # a host sync every few steps on a GPU
                for i in range(self.max_new):
                    if i % check == 0 and not bool(self.rows.active.any()):
                        break
                    self.step()
            _sync(self.device)
            seconds = time.perf_counter() - t0
            rows = self.rows.outputs(self.drafter is not None, self.record)
            return BatchRun(rows, seconds, self.setup_seconds, prefill, self.tgt.dtype)
        finally:
            self.close()

    def close(self) -> None:
        if self.cap is not None:
            self.cap.remove()
            self.cap = None
        self.step = None  # the captured step refers back to this decoder: freed now, not by a later collection


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
