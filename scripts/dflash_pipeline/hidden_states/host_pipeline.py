"""The host side of extraction, behind the GPU: two threads and a pool, joined by bounded queues.

  dispatcher  waits for a batch's device-to-host copy, hands its samples to the encode pool (compress, checksum).
  writer      appends the encoded samples in order and makes them durable every `flush_tokens` tokens, so a
              killed job resumes from the last flushed chunk (writer.py's journal).
The GPU only waits when the queues are full, i.e. when the disk or the compressors are slower.
"""

from __future__ import annotations

import concurrent.futures as cf
import queue
import threading

from dflash_pipeline.hidden_states.batching import Batch, encode_sample
from dflash_pipeline.hidden_states.writer import HiddenStateShardWriter


class HostPipeline:
    def __init__(self, writer: HiddenStateShardWriter, encode_threads: int, queue_batches: int, flush_tokens: int,
                 background_flush: bool):
        self.writer, self.flush_tokens, self.background_flush = writer, flush_tokens, background_flush
        self.pool = cf.ThreadPoolExecutor(max(1, encode_threads), thread_name_prefix="encode")
        self.batches: queue.Queue = queue.Queue(maxsize=max(1, queue_batches))
        self.encoded: queue.Queue = queue.Queue(maxsize=max(1, queue_batches))
        self.errors: list[BaseException] = []
        self.stats = {"samples": 0, "tokens": 0, "stored_bytes": 0}
        self.threads = [threading.Thread(target=self._dispatch, name="dispatch", daemon=True),
                        threading.Thread(target=self._write, name="writer", daemon=True)]
        for th in self.threads:
            th.start()

    def put(self, batch: Batch) -> None:
        """Queue a batch (blocks while the host side is `queue_batches` behind)."""
        self.batches.put(batch)

    def finish(self, raise_errors: bool = True) -> None:
        """Wait for everything queued; raises the first error of a host thread (unless `raise_errors` is off:
        the caller has its own error to raise)."""
        self.batches.put(None)
        for th in self.threads:
            th.join()
        self.pool.shutdown(wait=True)
        if self.errors and raise_errors:
            raise self.errors[0]

    def _dispatch(self) -> None:
        try:
            while (batch := self.batches.get()) is not None:
                if batch.event is not None:
                    batch.event.synchronize()
                self.encoded.put([self.pool.submit(encode_sample, self.writer.codec, batch, b)
                                  for b in range(len(batch.ids))])
        except BaseException as exc:  # pragma: no cover - surfaced by finish()
            self.errors.append(exc)
        finally:
            self.encoded.put(None)

    def _write(self) -> None:
        since_flush = 0
        try:
            while (futures := self.encoded.get()) is not None:
                for f in futures:
                    since_flush += self._append(f.result())
                if since_flush >= self.flush_tokens:
                    self.writer.flush(background=self.background_flush)
                    since_flush = 0
        except BaseException as exc:
            self.errors.append(exc)
            while self.encoded.get() is not None:  # drain so the dispatcher never blocks
                pass

    def _append(self, enc) -> int:
        self.writer.add_encoded(enc)
        self.stats["samples"] += 1
        self.stats["tokens"] += enc.num_tokens
        self.stats["stored_bytes"] += sum(len(memoryview(p).cast("B")) for p, _ in enc.sections)
        return enc.num_tokens
