"""`dflash-pipeline generate`: regenerate every assistant answer of one or more shards with the target.

One process may take several shards (`--input a b --out A B`): they share one engine (one set of SGLang
servers, started once) and one pool of workers, so the servers stay saturated across shard boundaries; each
shard is finalized as soon as its last sample is done.

Per shard: `OUT` (Parquet, `generation_client.COMPLETION_SCHEMA`, exactly one row per input sample, in input
order), `OUT` with `.summary.json` (counts, tokens, throughput) and a journal `JOURNAL_DIR/<shard>.jsonl`
(see `generation_journal`). A rerun reads the journal and sends only the samples not yet done.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import logging
import os
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from dflash_pipeline import storage
from dflash_pipeline.errors import PipelineError
from dflash_pipeline.generation.client import (
    COMPLETION_SCHEMA, Counters, FatalError, HTTPEngine, Policy, SamplingParams, generate_sample,
)
from dflash_pipeline.generation.journal import Journal

LOG = logging.getLogger("dflash_pipeline.generation.stage")


def add_arguments(p: argparse.ArgumentParser) -> None:
    io_ = p.add_argument_group("shards")
    io_.add_argument("--input", nargs="+", required=True, help="ingested shard(s) (SAMPLE_SCHEMA Parquet)")
    io_.add_argument("--out", nargs="+", required=True, help="completion shard(s), one per --input")
    io_.add_argument("--journal-dir", help="where the per-shard journals live (default: OUT_DIR/journal)")
    io_.add_argument("--journal-mirror", help="s3:// prefix to mirror journals to (default when --out is on S3: "
                     "OUT_PREFIX/journal)")
    io_.add_argument("--flush-every", type=int, default=32, help="journal: fsync after this many samples")
    io_.add_argument("--flush-interval", type=float, default=2.0, help="journal: or after this many seconds")
    io_.add_argument("--mirror-interval", type=float, default=30.0, help="journal mirror: upload period (s)")
    io_.add_argument("--no-retry-failed", dest="retry_failed", action="store_false",
                     help="on a rerun, do not retry samples that failed for a transient reason")
    io_.add_argument("--progress-interval", type=float, default=10.0, help="seconds between progress lines")
    io_.add_argument("--calibration", help="the calibration's JSON (`dflash-pipeline calibrate`): progress lines and "
                     "summaries compare the live rate with it")

    be = p.add_argument_group("backend")
    be.add_argument("--backend", choices=["hf", "sglang", "servers"], required=True)
    be.add_argument("--model", help="target model directory (hf, sglang; api=generate renders with its tokenizer)")
    be.add_argument("--model-name", help="model identity recorded with each sample (default: from the server)")
    be.add_argument("--servers", nargs="*", default=[], help="running endpoints (backend servers)")
    be.add_argument("--api", choices=["chat", "generate"], default="chat",
                    help="chat: /v1/chat/completions (reasoning parsed by the server); generate: /generate")
    be.add_argument("--max-in-flight", type=int, default=64, help="requests in flight per server")
    be.add_argument("--request-timeout", type=float, default=3600.0, help="seconds per request")
    be.add_argument("--all-down-timeout", type=float, default=600.0,
                    help="stop the run when every server has been down this long (s)")
    be.add_argument("--revive-after", type=float, default=5.0,
                    help="seconds before a server taken out is probed again (doubling while it stays down)")
    be.add_argument("--sglang-json", default="{}", help="config generate.sglang as JSON (launch flags)")
    be.add_argument("--server-log-dir", help="sglang backend: server logs go here")
    be.add_argument("--devices", help="sglang backend: GPU ids to use (default: CUDA_VISIBLE_DEVICES)")
    be.add_argument("--batch-size", type=int, default=32, help="hf backend: generate batch size")
    be.add_argument("--device", default="cpu", help="hf backend: torch device")
    be.add_argument("--threads", type=int, default=0, help="hf backend: torch CPU threads (0: torch's default)")
    be.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    be.add_argument("--context-length", type=int, help="hf backend: prompt + answer limit (default: model's)")
    be.add_argument("--trust-remote-code", action="store_true")

    sp = p.add_argument_group("sampling and policy")
    sp.add_argument("--max-new-tokens", type=int, default=2048)
    sp.add_argument("--temperature", type=float, default=0.6)
    sp.add_argument("--top-p", type=float, default=0.95)
    sp.add_argument("--top-k", type=int, default=20)
    sp.add_argument("--seed", type=int)
    sp.add_argument("--enable-thinking", action=argparse.BooleanOptionalAction, default=True)
    sp.add_argument("--turns", choices=["first", "all"], default="first",
                    help="first: answer the first user turn only; all: every assistant turn, in order, "
                         "conditioned on the model's own earlier answers")
    sp.add_argument("--on-length", choices=["keep", "drop", "retry"], default="keep",
                    help="what to do with an answer cut at max_new_tokens (finish_reason=length)")
    sp.add_argument("--length-retry-max-new-tokens", type=int, default=0,
                    help="on_length=retry: the larger budget of the one retry (then dropped)")
    sp.add_argument("--max-retries", type=int, default=8, help="transient failures per request before giving up")
    sp.add_argument("--backoff-base", type=float, default=0.5)
    sp.add_argument("--backoff-max", type=float, default=30.0)
    sp.add_argument("--empty-retries", type=int, default=1)


# --------------------------------------------------------------------------------------------------------
class ShardJob:
    def __init__(self, input_path: str, out: str, journal_path: Path, mirror: str | None):
        self.input_path = input_path
        self.out = out
        self.name = Path(out.rstrip("/")).name.removesuffix(".parquet")
        self.summary_path = out.removesuffix(".parquet") + ".summary.json"
        self.journal_path = journal_path
        self.mirror = mirror
        self.rows = _read_rows(input_path)
        ids = [r["sample_id"] for r in self.rows]
        if len(set(ids)) != len(ids):
            raise PipelineError(f"{input_path}: duplicate sample ids; generation is keyed by sample id")
        self.counters = Counters()
        self.journal: Journal | None = None
        self.todo: list[dict] = []
        self.remaining = 0
        self.resumed = 0
        self.t0 = time.monotonic()
        self.finalized = False

    def open(self, settings: dict, args) -> None:
        self.journal = Journal(self.journal_path, self.name, settings, flush_every=args.flush_every,
                               flush_interval_s=args.flush_interval, mirror=self.mirror,
                               mirror_interval_s=args.mirror_interval)
        wanted = {r["sample_id"] for r in self.rows}
        stray = set(self.journal.done) - wanted
        if stray:
            LOG.warning("%s: %d journal records are not in the input (ignored)", self.name, len(stray))
        for row in self.rows:
            rec = self.journal.done.get(row["sample_id"])
            if rec is None or (args.retry_failed and rec["status"] != "ok" and not rec.get("permanent", True)):
                self.todo.append(row)
        self.resumed = len(self.rows) - len(self.todo)
        self.remaining = len(self.todo)
        if self.resumed:
            LOG.info("%s: %d of %d samples already done (journal); %d to generate", self.name, self.resumed,
                     len(self.rows), len(self.todo))

    def finalize(self, meta: dict) -> dict:
        self.journal.flush()
        records = []
        for row in self.rows:
            rec = self.journal.done.get(row["sample_id"])
            if rec is None:
                raise RuntimeError(f"{self.name}: sample {row['sample_id']} has no result")  # cannot happen
            records.append({k: rec.get(k) for k in COMPLETION_SCHEMA.names})
        table = pa.Table.from_pylist(records, schema=COMPLETION_SCHEMA)
        _write_parquet(table, self.out)
        statuses = [r["status"] for r in records]
        wall = time.monotonic() - self.t0
        reasons: dict[str, int] = {}
        for r in records:
            if r["status"] != "ok":
                key = r["failure_reason"].split(":")[0][:80]
                reasons[key] = reasons.get(key, 0) + 1
        summary = {
            "shard": self.name,
            "input": self.input_path,
            "output": self.out,
            "samples": len(records),
            "ok": statuses.count("ok"),
            "failed": statuses.count("failed"),
            "failure_reasons": reasons,
            "finish_reason_length": sum(r["finish_reason"] == "length" for r in records if r["status"] == "ok"),
            "prompt_tokens": sum(r["prompt_tokens"] for r in records),
            "completion_tokens": sum(r["completion_tokens"] for r in records),
            "resumed_from_journal": self.resumed,
            "this_run": {**asdict(self.counters), "wall_s": round(wall, 3),
                         "completion_tokens_per_s": round(self.counters.completion_tokens / max(wall, 1e-9), 1),
                         "samples_per_s": round(len(self.todo) / max(wall, 1e-9), 3)},
            **meta,
        }
        _write_json(summary, self.summary_path)
        self.finalized = True
        LOG.info("%s: done: %d ok, %d failed (%s) -> %s", self.name, summary["ok"], summary["failed"],
                 reasons or "none", self.out)
        return summary


def _read_rows(path: str) -> list[dict]:
    if storage.is_s3(path):
        with storage.open_binary(path) as fh:
            table = pq.read_table(pa.BufferReader(fh.read()))
    else:
        table = pq.read_table(path)
    missing = {"sample_id", "source", "source_id", "messages"} - set(table.column_names)
    if missing:
        raise PipelineError(f"{path}: not an ingested shard (missing columns {sorted(missing)})")
    return table.select(["sample_id", "source", "source_id", "messages"]).to_pylist()


def _write_parquet(table: pa.Table, out: str) -> None:
    if storage.is_s3(out):
        buf = io.BytesIO()
        pq.write_table(table, buf, compression="zstd")
        bucket, key = storage.split_s3(out)
        storage.s3_client().put_object(Bucket=bucket, Key=key, Body=buf.getvalue())
        return
    with storage.atomic_path(out) as tmp:
        pq.write_table(table, tmp, compression="zstd")


def _write_json(obj: dict, out: str) -> None:
    if storage.is_s3(out):
        bucket, key = storage.split_s3(out)
        storage.s3_client().put_object(Bucket=bucket, Key=key, Body=json.dumps(obj, indent=2).encode())
        return
    storage.write_json(out, obj)


def _fmt_eta(seconds: float) -> str:
    if seconds != seconds or seconds == float("inf"):
        return "?"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


class Progress:
    def __init__(self, jobs: list[ShardJob], engine, calibration_tok_s: float | None = None):
        self.jobs = jobs
        self.engine = engine
        self.total = sum(len(j.rows) for j in jobs)
        self.todo = sum(len(j.todo) for j in jobs)
        self.t0 = time.monotonic()
        self.calibration_tok_s = calibration_tok_s

    def versus_calibration(self) -> dict:
        """The live output rate (server start-up excluded, as in the calibration) against the calibration's."""
        if not self.calibration_tok_s:
            return {}
        live = sum(j.counters.completion_tokens for j in self.jobs) / max(time.monotonic() - self.t0, 1e-9)
        return {"calibration": {"output_tok_s": self.calibration_tok_s, "live_output_tok_s": round(live, 1),
                                "ratio": round(live / self.calibration_tok_s, 3)}}

    def line(self) -> str:
        done_now = self.todo - sum(j.remaining for j in self.jobs)
        done = self.total - self.todo + done_now
        c = Counters()
        for j in self.jobs:
            for k in ("ok", "failed", "length", "empty", "retries", "completion_tokens"):
                setattr(c, k, getattr(c, k) + getattr(j.counters, k))
        wall = max(time.monotonic() - self.t0, 1e-9)
        rate = done_now / wall
        eta = (self.todo - done_now) / rate if rate > 0 else float("inf")
        return (f"generate: {done}/{self.total} samples ({100 * done / max(self.total, 1):.1f}%) | "
                f"{c.completion_tokens / wall:,.0f} tok/s | {rate:.2f} samples/s | in flight {self.engine.in_flight} | "
                f"failed {c.failed} | length {c.length} | empty {c.empty} | retries {c.retries} | "
                f"ETA {_fmt_eta(eta) if done_now < self.todo else '0m00s'} | {self.engine.describe()}"
                + (f" | running at {self.versus_calibration()['calibration']['ratio']:.2f}x of calibration"
                   if self.calibration_tok_s else ""))


def calibration_rate(path: str | None) -> float | None:
    """The output tok/s a calibration measured (None without one)."""
    if not path:
        return None
    try:
        return float(storage.read_json(path)["throughput"]["output_tok_s"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise PipelineError(f"{path}: not a calibration result ({type(exc).__name__}: {exc})") from None


def request_settings(args) -> tuple[SamplingParams, Policy]:
    """The sampling parameters and client policy of these flags (`calibrate` sends exactly what `generate` does)."""
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, enable_thinking=args.enable_thinking, seed=args.seed)
    policy = Policy(turns=args.turns, on_length=args.on_length,
                    length_retry_max_new_tokens=args.length_retry_max_new_tokens, max_retries=args.max_retries,
                    backoff_base_s=args.backoff_base, backoff_max_s=args.backoff_max,
                    empty_retries=args.empty_retries)
    return params, policy


async def run_shards(jobs: list[ShardJob], engine, args, progress_interval: float) -> list[dict]:
    params, policy = request_settings(args)
    model = args.model_name or engine.model_name
    sampling_json = params.to_json(turns=policy.turns, on_length=policy.on_length,
                                   length_retry_max_new_tokens=policy.length_retry_max_new_tokens, api=args.api)
    settings = {"model": model, "sampling": json.loads(sampling_json)}
    meta = {"model": model, "sampling_params": json.loads(sampling_json), "backend": args.backend}
    summaries: list[dict] = []
    for job in jobs:
        await asyncio.to_thread(job.open, settings, args)
    queue: asyncio.Queue = asyncio.Queue()
    for job in jobs:
        if not job.todo:
            summaries.append(await asyncio.to_thread(job.finalize, meta))
        for row in job.todo:
            queue.put_nowait((job, row))
    progress = Progress(jobs, engine, calibration_rate(getattr(args, "calibration", None)))
    LOG.info("%d shards, %d samples, %d to generate with %s (%d requests in flight at most)", len(jobs),
             progress.total, progress.todo, engine.describe(), engine.capacity)

    async def worker() -> None:
        while True:
            try:
                job, row = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            rec = await generate_sample(engine, row, params, policy, job.counters, model, sampling_json)
            job.journal.add(rec)
            rejected = sum(j.counters.rejected for j in jobs)
            finished = sum(j.counters.ok + j.counters.failed for j in jobs)
            if rejected >= 16 and rejected * 2 > finished:
                raise FatalError(f"the server rejects most requests ({rejected} of {finished}), e.g. "
                                 f"{rec['failure_reason']!r}: check the configuration (a rerun retries them)")
            job.remaining -= 1
            if job.remaining == 0:
                summaries.append(await asyncio.to_thread(job.finalize, {**meta, **progress.versus_calibration()}))

    async def reporter() -> None:
        while True:
            await asyncio.sleep(min(progress_interval, 1.0))
            for job in jobs:
                if not job.finalized:
                    job.journal.maybe_flush()
            if time.monotonic() - reporter.last >= progress_interval:
                reporter.last = time.monotonic()
                LOG.info("%s", progress.line())

    reporter.last = time.monotonic()
    report_task = asyncio.create_task(reporter())
    workers = [asyncio.create_task(worker()) for _ in range(max(1, min(engine.capacity, progress.todo)))]
    try:
        done, pending = await asyncio.wait(workers, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            if task.exception():
                raise task.exception()
    finally:
        for task in workers:
            task.cancel()
        report_task.cancel()
        await asyncio.gather(*workers, report_task, return_exceptions=True)
        for job in jobs:  # whatever finished is synced before we leave, also on cancellation
            if job.journal:
                job.journal.close()
    LOG.info("%s", progress.line())
    return summaries


def _engine(args, urls: list[str] | None = None):
    if args.backend == "hf":
        from dflash_pipeline.generation.backends import HFEngine

        if not args.model:
            raise PipelineError("--backend hf needs --model")
        return HFEngine(args.model, batch_size=args.batch_size, device=args.device, dtype=args.dtype,
                        context_length=args.context_length, trust_remote_code=args.trust_remote_code,
                        seed=args.seed or 0, threads=args.threads or None)
    render = None
    if args.api == "generate":
        if not args.model:
            raise PipelineError("--api generate needs --model (its tokenizer renders the prompts)")
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)

        def render(messages, enable_thinking):  # the prompt's token ids, sent as input_ids
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                           enable_thinking=enable_thinking)
            return tok(text, add_special_tokens=False)["input_ids"]
    return HTTPEngine(urls or args.servers, max_in_flight=args.max_in_flight, request_timeout_s=args.request_timeout,
                      api=args.api, model=args.model_name or None, render=render, all_down_timeout_s=args.all_down_timeout,
                      revive_after_s=args.revive_after)


def make_engine(args, urls: list[str] | None = None):
    """The engine these flags configure (hf in-process, or HTTP to `urls` / --servers); not started yet."""
    return _engine(args, urls)


async def _amain(jobs, args, urls) -> list[dict]:
    loop = asyncio.get_running_loop()
    main_task = asyncio.current_task()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, main_task.cancel)
    engine = _engine(args, urls)
    await engine.start(wait_s=60.0)
    try:
        return await run_shards(jobs, engine, args, args.progress_interval)
    finally:
        await engine.close()


def _terminate(signum, frame):
    raise SystemExit(128 + signum)  # unwinds through `finally`, so launched servers are stopped


@contextlib.contextmanager
def serving(args):
    """The server URLs of these flags: sglang servers launched for the block (always stopped after it), or
    None (hf in-process; --servers are used as given). Call with SIGTERM/SIGINT turned into exceptions."""
    if args.backend != "sglang":
        yield None
        return
    from dflash_pipeline.generation.backends import launched_servers, sglang_command

    if not args.model:
        raise PipelineError("--backend sglang needs --model")
    cfg = json.loads(args.sglang_json)
    devices = args.devices or os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = [d for d in devices.split(",") if d.strip()] if devices else None
    command = sglang_command(args.model, cfg, trust_remote_code=args.trust_remote_code)
    with launched_servers(command, instances=int(cfg.get("instances") or 1), devices=devices,
                          log_dir=args.server_log_dir, startup_timeout_s=float(cfg.get("startup_timeout_s")
                                                                               or 1800)) as urls:
        args.max_in_flight = int(cfg.get("max_in_flight") or args.max_in_flight)
        yield urls


def run(args) -> int:
    if len(args.input) != len(args.out):
        raise PipelineError(f"--input has {len(args.input)} shards but --out has {len(args.out)}")
    if args.backend == "servers" and not args.servers:
        raise PipelineError("--backend servers needs --servers URL [URL ...]")
    journal_dir = Path(args.journal_dir) if args.journal_dir else None
    jobs = []
    for inp, out in zip(args.input, args.out):
        name = Path(out.rstrip("/")).name.removesuffix(".parquet")
        mirror = args.journal_mirror or None  # "" (the config's default) means: none given
        if mirror is None and storage.is_s3(out):
            mirror = out.rsplit("/", 1)[0] + "/journal"
        jdir = journal_dir or (Path(".generate-journal") if storage.is_s3(out) else Path(out).parent / "journal")
        jobs.append(ShardJob(inp, out, jdir / f"{name}.jsonl", f"{mirror.rstrip('/')}/{name}" if mirror else None))
    previous = {s: signal.signal(s, _terminate) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        with serving(args) as urls:
            summaries = asyncio.run(_amain(jobs, args, urls))
    except asyncio.CancelledError:
        LOG.error("generation interrupted; the journal keeps every finished sample, rerun to continue")
        return 130
    finally:
        for s, handler in previous.items():
            with contextlib.suppress(Exception):
                signal.signal(s, handler)
    failed = sum(s["failed"] for s in summaries)
    total = sum(s["samples"] for s in summaries)
    print(f"generated {len(summaries)} shard(s): {total - failed} ok, {failed} failed", file=sys.stderr)
    return 0
