"""`SlotEngine`: the hf backend on the slot decoder (slot_pool, slot_decode): a static KV cache, a CUDA-graph
decode step, finished rows refilled at once, sampling on the GPU with per-request seeds.

Same contract as `engines.HFEngine` (`await complete(messages, params, max_new_tokens) -> Completion`, the
content / reasoning split, finish_reason stop or length, output_ids through the end token): the client, the
journal and the stage do not know which one runs. The decoder runs in its own thread; requests reach it through a
thread-safe queue and their answers come back to the event loop with `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time

from dflash_pipeline import settings
from dflash_pipeline.generation.client import Completion
from dflash_pipeline.generation.engines import HFEngine, capped_budget, with_tool_calls

LOG = logging.getLogger(__name__)
LOG_EVERY_S = 30.0


def slot_width(context_length: int, max_new_tokens: int) -> int:
    """Cache columns per slot: room for the answer and a prompt of up to 640 tokens (more for longer answers),
    a multiple of 64; longer requests go to the wide pool. Masked SDPA reads every column at every step, the
    Triton decode attention (live_attention) only each row's live ones."""
    width = max(1024, 2 * max_new_tokens + 256)
    return min(-(-width // 64) * 64, -(-context_length // 64) * 64)


class SlotEngine(HFEngine):
    """transformers in-process on the slot decoder: `batch_size` slots, each refilled as soon as its request is
    done; `capacity` (the client's requests in flight) is twice that, so a refill always finds requests waiting."""

    def __init__(self, model_path: str, *, batch_size: int = 256, device: str = "cpu", dtype: str = "auto",
                 context_length: int | None = None, trust_remote_code: bool = False, threads: int | None = None,
                 width: int = 0, max_new_tokens: int | None = None, refill: bool = True, capture: bool | None = None,
                 decode_attention: str = "auto"):
        super().__init__(model_path, batch_size=batch_size, device=device, dtype=dtype, context_length=context_length,
                         trust_remote_code=trust_remote_code, threads=threads)
        self.width, self.refill, self.capture = width, refill, capture
        self.max_new_tokens = max_new_tokens or settings.default("generate.max_new_tokens")  # sizes the slots
        self.decode_attention = decode_attention  # live_attention.MODES; auto: the Triton kernel on a GPU
        self.scheduler = None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None
        # rounds run while requests waited for a free main-pool slot: every freed slot refilled, the state a long
        # run keeps; answer tokens decoded and seconds spent in them (read by the calibration)
        self.saturated_tokens, self.saturated_seconds = 0, 0.0

    @property
    def calibration_requests(self) -> int:
        """A calibration keeps every slot busy (the rate of a wide pool is not that of a few rows)."""
        return self.capacity

    def describe(self) -> str:
        pool = self.scheduler.main if self.scheduler else None
        how = "CUDA graph" if pool and pool.capture else "eager"
        shape = (f"{pool.rows} slots x {pool.width} columns, {how}, {pool.live_attention.name} attention" if pool
                 else f"{self.batch_size} slots")
        return f"hf slots ({shape}) on {self.device}"

    def saturated(self) -> tuple[int, float]:
        """(answer tokens, seconds) decoded so far in rounds that ran with requests waiting for a slot."""
        return self.saturated_tokens, self.saturated_seconds

    def _decoded(self) -> int:
        sch = self.scheduler
        return sch.main.row_steps + (sch.wide.row_steps if sch.wide else 0)

    async def start(self, wait_s: float = 0) -> None:
        await asyncio.to_thread(self._load)
        await asyncio.to_thread(self._build)
        self._thread = threading.Thread(target=self._decode_loop, name="slot-decoder", daemon=True)
        self._thread.start()

    def _build(self) -> None:
        import torch

        from dflash_pipeline.generation.slot_decode import use_slot_attention
        from dflash_pipeline.generation.slot_pool import SlotScheduler

        use_slot_attention(self.model)
        on_gpu = self.model.device.type == "cuda"
        capture = on_gpu if self.capture is None else self.capture
        width = self.width or slot_width(self.context_length, self.max_new_tokens)
        self.scheduler = SlotScheduler(self.model, self.eos_ids, rows=self.batch_size,
                                       width=min(width, self.context_length), context=self.context_length,
                                       refill=self.refill, capture=capture, decode_attention=self.decode_attention)
        if on_gpu:
            torch.cuda.synchronize()
        LOG.info("%s", self.describe())

    async def close(self) -> None:
        if self._thread and self._thread.is_alive():
            self._inbox.put(None)
            await asyncio.to_thread(self._thread.join, 60)

    async def complete(self, messages, params, max_new_tokens: int, tools: list | None = None) -> Completion:
        from dflash_pipeline.generation.slot_decode import Request

        if self._failure is not None:
            raise self._failure
        ids = self.render(messages, params.enable_thinking, tools)
        budget = capped_budget(len(ids), max_new_tokens, self.context_length)
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        req = Request(prompt=list(ids), budget=budget, seed=params.seed or 0, temperature=params.temperature,
                      top_k=params.top_k, top_p=params.top_p, tag=(future, loop, params.enable_thinking))
        self._in_flight += 1
        try:
            self._inbox.put(req)
            return with_tool_calls(await future, tools)
        finally:
            self._in_flight -= 1

    # -- the decoder's thread ----------------------------------------------------------------------------
    def _take(self) -> bool:
        """Move the queued requests to the scheduler (waiting for one when idle); False at the sentinel."""
        block = not self.scheduler.busy
        while True:
            try:
                req = self._inbox.get(block=block)
            except queue.Empty:
                return True
            if req is None:
                return False
            self.scheduler.submit(req)
            block = False

    def _decode_loop(self) -> None:
        import torch

        last_log, tokens0, t0 = time.monotonic(), 0, time.perf_counter()
        try:
            with torch.inference_mode():
                while self._take():
                    started, decoded = time.perf_counter(), self._decoded()
                    done = self.scheduler.round()
                    spent = time.perf_counter() - started
                    self.generate_seconds += spent
                    if self.scheduler.waiting["main"]:  # requests left waiting after the admission: a full pool
                        self.saturated_tokens += self._decoded() - decoded
                        self.saturated_seconds += spent
                    for req in done:
                        self.generated_tokens += len(req.tokens)
                        future, loop, thinking = req.tag
                        loop.call_soon_threadsafe(self._resolve, future, req, thinking)
                    if time.monotonic() - last_log > LOG_EVERY_S:
                        LOG.info("hf slots: %d rows busy, %.0f tok/s over the last %.0f s", self.scheduler.active,
                                 (self.generated_tokens - tokens0) / (time.perf_counter() - t0),
                                 time.perf_counter() - t0)
                        last_log, tokens0, t0 = time.monotonic(), self.generated_tokens, time.perf_counter()
        except BaseException as exc:  # a model failure fails every request, this one and those to come
            LOG.exception("the slot decoder failed")
            self._failure = exc
            self._fail_pending(exc)

    def _fail_pending(self, exc: BaseException) -> None:
        pools = [self.scheduler.main] + ([self.scheduler.wide] if self.scheduler.wide else [])
        reqs = [r for p in pools for r in p.slots if r is not None]
        reqs += [r for w in self.scheduler.waiting.values() for r in w]
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                reqs.append(item)
        for req in reqs:
            future, loop, _ = req.tag
            loop.call_soon_threadsafe(lambda f=future: f.done() or f.set_exception(exc))

    def _resolve(self, future, req, enable_thinking: bool) -> None:
        if not future.done():  # a cancelled request's answer is dropped
            future.set_result(self._completion(list(req.tokens), req.prompt, enable_thinking))
