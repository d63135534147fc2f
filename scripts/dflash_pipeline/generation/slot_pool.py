"""A pool of decode slots on one static KV cache (`SlotPool`), and the scheduler that feeds pools (`SlotScheduler`).

See slot_decode for the layout (rows right-aligned against the shared write column `t`) and the sampling.
"""

from __future__ import annotations

import collections
import logging

import numpy as np
import torch

from dflash_pipeline.generation.live_attention import LiveAttention
from dflash_pipeline.generation.slot_decode import (
    NO_TOP_P, PrefillCache, Request, SlotCache, cache_keyword, sample_rows,
)

LOG = logging.getLogger(__name__)


class SlotPool:
    """`rows` slots of `width` cache columns. `admit` prefills requests into free slots, `step` decodes one token
    for every row (a CUDA graph when `capture`), `harvest` returns the requests that finished.
    `decode_attention`: "triton" (live columns only, live_attention), "sdpa" (masked), "auto" (triton on a GPU
    where it imports)."""

    def __init__(self, model, eos_ids, *, rows: int, width: int, capture: bool, prefill_tokens: int = 16384,
                 decode_attention: str = "auto"):
        self.model, self.rows, self.width, self.capture = model, rows, width, capture
        self.prefill_tokens = prefill_tokens
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.cache_kw = cache_keyword(model)
        self.min = torch.finfo(self.dtype).min
        dev, long = self.device, torch.long
        self.eos = torch.tensor(sorted(eos_ids), dtype=long, device=dev)
        self.tokens = torch.zeros(rows, dtype=long, device=dev)     # each row's input token for the next step
        self.positions = torch.zeros(rows, dtype=long, device=dev)  # its position id
        self.steps = torch.zeros(rows, dtype=long, device=dev)      # tokens it has generated: the noise counter
        self.seeds = torch.zeros(rows, dtype=long, device=dev)
        self.budgets = torch.zeros(rows, dtype=long, device=dev)
        self.temperature = torch.zeros(rows, dtype=torch.float32, device=dev)
        self.top_k = torch.zeros(rows, dtype=long, device=dev)
        self.top_p = torch.zeros(rows, dtype=torch.float32, device=dev)
        self.finished = torch.ones(rows, dtype=torch.bool, device=dev)
        self.out = torch.zeros(rows, width, dtype=long, device=dev)  # generated tokens, by step
        self.mask = torch.full((rows, 1, 1, width), self.min, dtype=self.dtype, device=dev)
        self.cache = SlotCache()
        self.cache.pos = torch.zeros(1, dtype=long, device=dev)
        self.cache.start = torch.zeros(rows, dtype=torch.int32, device=dev)  # the mask's first 0 column, per row
        self.live_attention = LiveAttention(decode_attention, dev, self.cache.start, self.cache.pos)
        self.t = 0
        self.slots: list[Request | None] = [None] * rows
        self.steps_host = np.zeros(rows, dtype=np.int64)
        self.live = np.zeros(rows, dtype=bool)
        self.warp = False
        self.graphs: dict[bool, torch.cuda.CUDAGraph] = {}
        self.pool_handle = None
        self.step_count = 0
        self.row_steps = 0  # live rows summed over steps
        self.shifts = 0  # compactions and right shifts: each copies the whole cache

    # -- occupancy -------------------------------------------------------------------------------------
    @property
    def active(self) -> int:
        return int(self.live.sum())

    def free_slots(self) -> list[int]:
        return [i for i, r in enumerate(self.slots) if r is None]

    def fits(self, req: Request) -> bool:
        return len(req.prompt) + req.budget <= self.width

    def _warp(self) -> bool:
        live = [r for r in self.slots if r is not None and r.temperature > 0]
        return any(r.top_k > 0 or r.top_p < 1.0 for r in live)

    # -- the cache's columns -----------------------------------------------------------------------------
    def _allocate(self, pre: PrefillCache) -> None:
        for k in pre.keys:
            shape = (self.rows, k.shape[1], self.width, k.shape[3])
            self.cache.add_layer(torch.zeros(shape, dtype=k.dtype, device=self.device),
                                 torch.zeros(shape, dtype=k.dtype, device=self.device), self.live_attention)

    def _shift(self, d: int) -> None:
        """Move every row's columns by d (negative: to the left); the columns rolled in are masked."""
        for buf in self.cache.keys + self.cache.values:
            buf.copy_(torch.roll(buf, d, dims=2))
        self.mask.copy_(torch.roll(self.mask, d, dims=3))
        self.cache.start.add_(d).clamp_(0, self.width)  # live rows stay inside; a free row's start is stale
        if d < 0:
            self.mask[..., self.width + d:] = self.min
        else:
            self.mask[..., :d] = self.min
        self.t += d
        self.shifts += 1
        for r in self.slots:
            if r is not None:
                r.start += d

    def _make_room(self, need: int) -> None:
        """Before a step (a free column at t) or an admission (t >= the chunk's longest prompt)."""
        if self.active == 0:
            self.t = need  # nothing to keep: admitted rows get their mask rewritten
            return
        if self.t >= self.width:  # compact: the longest live row then starts at column 0
            self._shift(-min(r.start for r in self.slots if r is not None))
        if self.t < need:
            self._shift(need - self.t)

    # -- admission -------------------------------------------------------------------------------------
    def _prefill(self, reqs: list[Request]):
        """Left-padded prefill of `reqs` on their own; (first tokens, longest prompt, its cache)."""
        n, width = len(reqs), max(len(r.prompt) for r in reqs)
        ids = torch.zeros(n, width, dtype=torch.long)
        valid = torch.zeros(n, width, dtype=torch.bool)
        for j, r in enumerate(reqs):
            ids[j, width - len(r.prompt):] = torch.tensor(r.prompt)
            valid[j, width - len(r.prompt):] = True
        positions = (valid.long().cumsum(1) - 1).clamp(min=0)
        allowed = torch.tril(torch.ones(width, width, dtype=torch.bool)).unsqueeze(0) & valid.unsqueeze(1)
        mask = torch.zeros(n, 1, width, width, dtype=self.dtype).masked_fill(~allowed.unsqueeze(1), self.min)
        pre = PrefillCache()
        dev = self.device
        out = self.model(input_ids=ids.to(dev), position_ids=positions.to(dev), attention_mask=mask.to(dev),
                         use_cache=True, logits_to_keep=1, **{self.cache_kw: pre})
        params = self._row_params(reqs)
        warp = any(r.temperature > 0 and (r.top_k > 0 or r.top_p < 1.0) for r in reqs)
        first = sample_rows(out.logits[:, -1], params["seeds"], torch.zeros(n, dtype=torch.long, device=dev),
                            params["temperature"], params["top_k"], params["top_p"], warp)
        return first, width, pre

    def _row_params(self, reqs: list[Request]) -> dict:
        dev, vocab = self.device, 1 << 62
        return {
            "seeds": torch.tensor([r.seed & ((1 << 63) - 1) for r in reqs], dtype=torch.long, device=dev),
            "temperature": torch.tensor([max(r.temperature, 0.0) for r in reqs], dtype=torch.float32, device=dev),
            "top_k": torch.tensor([r.top_k if r.top_k > 0 else vocab for r in reqs], dtype=torch.long, device=dev),
            "top_p": torch.tensor([r.top_p if r.top_p < 1.0 else NO_TOP_P for r in reqs], dtype=torch.float32,
                                  device=dev),
            "budgets": torch.tensor([r.budget for r in reqs], dtype=torch.long, device=dev),
        }

    def admit(self, reqs: list[Request]) -> list[Request]:
        """Prefill `reqs` (at most the free slots) into free slots; returns those already done (first token an
        end token, or a budget of one), which take no slot."""
        done = []
        reqs = sorted(reqs, key=lambda r: len(r.prompt))
        chunk: list[Request] = []
        for r in reqs:  # chunks of similar prompt lengths, at most prefill_tokens padded tokens each
            if chunk and (len(chunk) + 1) * len(r.prompt) > self.prefill_tokens:
                done += self._admit_chunk(chunk)
                chunk = []
            chunk.append(r)
        if chunk:
            done += self._admit_chunk(chunk)
        return done

    def _admit_chunk(self, reqs: list[Request]) -> list[Request]:
        first, width, pre = self._prefill(reqs)
        if not self.cache.keys:
            self._allocate(pre)
        eos = set(self.eos.tolist())
        done, keep = [], []
        for j, (r, tok) in enumerate(zip(reqs, first.tolist())):
            r.tokens = [tok]
            if tok in eos or r.budget <= 1:
                done.append(r)
            else:
                keep.append(j)
        if not keep:
            return done
        placed = [reqs[j] for j in keep]
        place_first = [reqs[j].tokens[0] for j in keep]
        self._make_room(width)
        t, free = self.t, self.free_slots()
        idx_host = free[:len(placed)]
        idx = torch.tensor(idx_host, dtype=torch.long, device=self.device)
        sel = torch.tensor(keep, dtype=torch.long, device=self.device)
        for dst, src in zip(self.cache.keys + self.cache.values, pre.keys + pre.values):
            dst[idx, :, t - width:t] = src.index_select(0, sel)
        lengths = torch.tensor([len(r.prompt) for r in placed], dtype=torch.long, device=self.device)
        cols = torch.arange(self.width, device=self.device).unsqueeze(0)
        valid = (cols >= (t - lengths).unsqueeze(1)) & (cols < t)
        self.mask[idx, 0, 0] = torch.where(valid, 0.0, self.min).to(self.dtype)
        self.cache.start[idx] = (t - lengths).to(torch.int32)
        params = self._row_params(placed)
        self.tokens[idx] = torch.tensor(place_first, dtype=torch.long, device=self.device)
        self.positions[idx] = lengths
        self.steps[idx] = 1
        for name in ("seeds", "temperature", "top_k", "top_p", "budgets"):
            getattr(self, name)[idx] = params[name]
        self.out[idx, 0] = self.tokens[idx]
        self.finished[idx] = False
        for slot, r in zip(idx_host, placed):
            r.slot, r.start = slot, t - len(r.prompt)
            self.slots[slot] = r
            self.steps_host[slot] = 1
            self.live[slot] = True
        self.warp = self._warp()
        return done

    # -- decoding --------------------------------------------------------------------------------------
    def _body(self, warp: bool) -> None:
        """One decode step for every row, on device tensors only (what the graph captures)."""
        self.mask.index_fill_(3, self.cache.pos, 0.0)  # each row attends to the token it writes now
        out = self.model(input_ids=self.tokens.unsqueeze(1), position_ids=self.positions.unsqueeze(1),
                         attention_mask=self.mask, use_cache=True, **{self.cache_kw: self.cache})
        nxt = sample_rows(out.logits[:, -1], self.seeds, self.steps, self.temperature, self.top_k, self.top_p, warp)
        self.out.scatter_(1, self.steps.clamp(max=self.width - 1).unsqueeze(1), nxt.unsqueeze(1))
        self.finished.copy_(torch.isin(nxt, self.eos) | (self.steps + 1 >= self.budgets))
        self.tokens.copy_(nxt)
        self.positions.add_(1)
        self.steps.add_(1)
        self.cache.pos.add_(1)

    def _graph(self, warp: bool):
        graph = self.graphs.get(warp)
        if graph is not None:
            return graph
        state = [self.tokens, self.positions, self.steps, self.cache.pos, self.finished]
        saved = [s.clone() for s in state]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up outside the capture (allocator, lazy kernels)
                self._body(warp)
        torch.cuda.current_stream().wait_stream(side)
        self.pool_handle = self.pool_handle or torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool_handle):
            self._body(warp)
        for s, v in zip(state, saved):  # the warm-up's writes: columns and counters the next real step redoes
            s.copy_(v)
        self.graphs[warp] = graph
        return graph

    def step(self) -> None:
        self._make_room(0)
        self.cache.pos.fill_(self.t)
        if self.capture:
            self._graph(self.warp).replay()
        else:
            self._body(self.warp)
        self.t += 1
        self.step_count += 1
        self.row_steps += int(self.live.sum())  # occupancy: answer tokens a step over rows
        self.steps_host[self.live] += 1

    def harvest(self) -> list[Request]:
        """The requests that finished at the last step, with their tokens; their slots are free again."""
        finished = self.finished.cpu().numpy()
        done = [r for r in self.slots if r is not None and finished[r.slot]]
        if not done:
            return []
        idx = torch.tensor([r.slot for r in done], dtype=torch.long, device=self.device)
        longest = int(max(self.steps_host[r.slot] for r in done))
        rows = self.out[idx, :longest].tolist()
        for r, toks in zip(done, rows):
            r.tokens = toks[:int(self.steps_host[r.slot])]
            self.slots[r.slot] = None
            self.live[r.slot] = False
        self.budgets[idx] = 0
        self.warp = self._warp()
        return done


class SlotScheduler:
    """Requests onto pools: `main` (rows x width) takes those whose prompt + budget fit its width, `wide` (a
    sixteenth of the rows, the whole context) the rest, run when enough of them wait or nothing else does.

    refill=True: a row is refilled as soon as it finishes, in groups of at least `min_refill` (a prefill's launch
    cost is shared; a few rows idle meanwhile). refill=False: a pool takes new requests only when all its rows
    are done, the shortest prompts first (length-sorted fixed-width batches)."""

    def __init__(self, model, eos_ids, *, rows: int, width: int, context: int, refill: bool = True,
                 capture: bool = False, prefill_tokens: int = 16384, min_refill: int | None = None,
                 decode_attention: str = "auto"):
        self.model, self.eos_ids, self.capture, self.refill = model, eos_ids, capture, refill
        self.decode_attention = decode_attention
        self.prefill_tokens = prefill_tokens
        self.context = max(context, width)
        self.main = SlotPool(model, eos_ids, rows=rows, width=width, capture=capture, prefill_tokens=prefill_tokens,
                             decode_attention=decode_attention)
        self.wide: SlotPool | None = None
        self.wide_rows = max(1, min(rows // 16, rows * width // (4 * self.context)))
        self.min_refill = min_refill or max(1, rows // 16)
        self.waiting = {"main": collections.deque(), "wide": collections.deque()}

    def submit(self, req: Request) -> None:
        if self.main.fits(req):
            self.waiting["main"].append(req)
            return
        if len(req.prompt) + req.budget > self.context:
            raise ValueError(f"prompt {len(req.prompt)} + budget {req.budget} tokens exceed the context {self.context}")
        if self.wide is None:
            width = -(-self.context // 64) * 64
            LOG.info("slot engine: a wide pool of %d rows x %d columns for long prompts", self.wide_rows, width)
            self.wide = SlotPool(self.model, self.eos_ids, rows=self.wide_rows, width=width, capture=self.capture,
                                 prefill_tokens=self.prefill_tokens, decode_attention=self.decode_attention)
        self.waiting["wide"].append(req)

    @property
    def busy(self) -> bool:
        return any(self.waiting.values()) or self.main.active > 0 or bool(self.wide and self.wide.active)

    @property
    def active(self) -> int:
        return self.main.active + (self.wide.active if self.wide else 0)

    def round(self) -> list[Request]:
        """Admit, decode one step and harvest, in each pool with work; the requests that finished."""
        done = self._serve(self.main, self.waiting["main"], self.refill)
        wide_wait = self.waiting["wide"]
        # the wide pool starts when it can fill its rows, or once nothing waits for the main pool: then it runs
        # beside the main pool's tail (sparse rows, an idle GPU) instead of after it, refilled like the main one
        main_tail = not self.waiting["main"]
        if self.wide is not None and (self.wide.active or len(wide_wait) >= self.wide.rows
                                      or (wide_wait and main_tail)):
            done += self._serve(self.wide, wide_wait, self.refill)
        return done

    def _serve(self, pool: SlotPool, waiting: collections.deque, refill: bool) -> list[Request]:
        done: list[Request] = []
        free = pool.rows - pool.active
        take: list[Request] = []
        if waiting and free:
            if refill and (pool.active == 0 or free >= min(self.min_refill, len(waiting))):
                take = [waiting.popleft() for _ in range(min(free, len(waiting)))]
            elif not refill and pool.active == 0:
                ordered = sorted(waiting, key=lambda r: len(r.prompt))
                take, rest = ordered[:pool.rows], ordered[pool.rows:]
                waiting.clear()
                waiting.extend(rest)
        if take:
            done += pool.admit(take)
        if pool.active:
            pool.step()
            done += pool.harvest()
        return done

    def run(self, requests: list[Request]) -> list[Request]:
        """Every request to the end (benchmarks, tests): the finished requests in the order they finished."""
        for r in requests:
            self.submit(r)
        done: list[Request] = []
        while self.busy:
            done += self.round()
        return done
