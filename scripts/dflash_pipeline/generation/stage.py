"""`dflash-pipeline generate`: regenerate every assistant answer of one or more shards with the target.

One process may take several shards (`--input a b --out A B`): they share one engine (one set of SGLang
servers, started once) and one pool of workers, so the servers stay saturated across shard boundaries; each
shard is finalized as soon as its last sample is done (`shards.ShardJob`). A rerun reads each shard's journal
and sends only the samples not yet done.

Modules: `client` (one sample: turns, seeds, retries, policies), `engines` (HTTP servers, hf in-process),
`servers` (the SGLang launcher), `sglang_flags` (SGLang's real flag list), `journal` (exactly-once records).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

from dflash_pipeline import settings, storage, target
from dflash_pipeline.errors import PipelineError
from dflash_pipeline.generation.client import Counters, FatalError, Policy, SamplingParams, generate_sample
from dflash_pipeline.generation.journal import RECORD_FORMAT
from dflash_pipeline.generation.shards import ShardJob
from dflash_pipeline.progress import duration

LOG = logging.getLogger("dflash_pipeline.generation.stage")
# the servers' API key (SGLang --api-key) comes from the environment, never from a command line or config file
API_KEY_ENV = "DFLASH_GENERATE_API_KEY"


def add_arguments(p: argparse.ArgumentParser) -> None:
    _add_shard_arguments(p.add_argument_group("shards"))
    _add_backend_arguments(p.add_argument_group("backend"))
    _add_sampling_arguments(p.add_argument_group("sampling and policy"))


def _add_shard_arguments(io_) -> None:
    io_.add_argument("--input", nargs="+", required=True, help="ingested shard(s) (SAMPLE_SCHEMA Parquet)")
    io_.add_argument("--out", nargs="+", required=True, help="completion shard(s), one per --input")
    io_.add_argument("--journal-dir", help="where the per-shard journals live (default: OUT_DIR/journal)")
    io_.add_argument("--journal-mirror", help="s3:// prefix to mirror journals to (default when --out is on S3: "
                     "OUT_PREFIX/journal)")
    io_.add_argument("--flush-every", type=int, help="journal: fsync after this many samples")
    io_.add_argument("--flush-interval", type=float, default=2.0, help="journal: or after this many seconds")
    io_.add_argument("--mirror-interval", type=float, default=30.0, help="journal mirror: upload period (s)")
    io_.add_argument("--no-retry-failed", dest="retry_failed", action="store_false", default=None,
                     help="on a rerun, do not retry samples that failed for a transient reason")
    io_.add_argument("--progress-interval", type=float, help="seconds between progress lines")
    io_.add_argument("--calibration", help="the calibration's JSON (`dflash-pipeline calibrate`): progress lines and "
                     "summaries compare the live rate with it")


def _add_backend_arguments(be) -> None:
    be.add_argument("--backend", choices=["hf", "sglang", "servers"], required=True)
    be.add_argument("--model", help="target model directory (hf, sglang; api=generate renders with its tokenizer)")
    be.add_argument("--model-name", help="model identity recorded with each sample (default: from the server)")
    be.add_argument("--servers", nargs="*", help="running endpoints (backend servers)")
    be.add_argument("--api", choices=["chat", "generate"],
                    help="chat: /v1/chat/completions (reasoning parsed by the server); generate: /generate")
    be.add_argument("--max-in-flight", type=int, help="requests in flight per server")
    be.add_argument("--request-timeout", type=float, help="seconds per request")
    be.add_argument("--all-down-timeout", type=float,
                    help="stop the run when every server has been down this long (s); also how long the start "
                         "waits for a healthy server (backend servers)")
    be.add_argument("--revive-after", type=float, default=5.0,
                    help="seconds before a server taken out is probed again (doubling while it stays down)")
    be.add_argument("--sglang-json", default="{}", help="config generate.sglang as JSON (launch flags)")
    be.add_argument("--server-log-dir", help="sglang backend: server logs go here")
    be.add_argument("--devices", help="sglang backend: GPU ids to use (default: CUDA_VISIBLE_DEVICES)")
    be.add_argument("--batch-size", type=int, help="hf backend: generate batch size")
    be.add_argument("--device", help="hf backend: torch device")
    be.add_argument("--threads", type=int, help="hf backend: torch CPU threads (0: torch's default)")
    be.add_argument("--max-batch-tokens", type=int,
                    help="hf backend: rows x (longest prompt + budget) per generate call (0: no limit)")
    be.add_argument("--cache", choices=["dynamic", "static"],
                    help="hf backend: transformers' KV cache (static: its generate compiles the decode step on a GPU)")
    be.add_argument("--engine", choices=["auto", "slots", "generate"],
                    help="hf backend: slots (static KV cache, CUDA-graph step, finished rows refilled), generate "
                         "(transformers' generate on length-sorted batches); auto: slots on a GPU, generate on CPU")
    be.add_argument("--slot-width", type=int,
                    help="hf slots: KV cache columns per slot (0: room for max_new_tokens and a 640-token prompt)")
    be.add_argument("--dtype", choices=["auto", "bfloat16", "float16", "float32"])
    be.add_argument("--context-length", type=int,
                    help="prompt + answer limit (default: the servers' max_model_len, or the model's config)")
    be.add_argument("--trust-remote-code", action="store_true", default=None)


def _add_sampling_arguments(sp) -> None:
    sp.add_argument("--max-new-tokens", type=int)
    sp.add_argument("--temperature", type=float)
    sp.add_argument("--top-p", type=float)
    sp.add_argument("--top-k", type=int)
    sp.add_argument("--seed", type=int, help="base seed; every sample's requests carry a seed derived from it "
                                             "and the sample id (default 0)")
    sp.add_argument("--enable-thinking", action=argparse.BooleanOptionalAction, default=None)
    sp.add_argument("--turns", choices=["first", "all"],
                    help="first: answer the first user turn only; all: every assistant turn, in order, "
                         "conditioned on the model's own earlier answers")
    sp.add_argument("--max-turns", type=int,
                    help="turns all: regenerate at most this many assistant turns of a conversation (0: all)")
    sp.add_argument("--on-length", choices=["keep", "drop", "retry"],
                    help="what to do with an answer cut at max_new_tokens (finish_reason=length)")
    sp.add_argument("--length-retry-max-new-tokens", type=int,
                    help="on_length=retry: the larger budget of the one retry (then dropped)")
    sp.add_argument("--max-retries", type=int, help="transient failures per request before giving up")
    sp.add_argument("--backoff-base", type=float, default=0.5)
    sp.add_argument("--backoff-max", type=float, default=30.0)
    sp.add_argument("--empty-retries", type=int)


# --------------------------------------------------------------------------------------------------------
# progress
# --------------------------------------------------------------------------------------------------------
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
        eta = (self.todo - done_now) / rate if rate > 0 else None
        return (f"generate: {done}/{self.total} samples ({100 * done / max(self.total, 1):.1f}%) | "
                f"elapsed {duration(wall)} | "
                f"{c.completion_tokens / wall:,.0f} tok/s | {rate:.2f} samples/s | in flight {self.engine.in_flight} | "
                f"failed {c.failed} | length {c.length} | empty {c.empty} | retries {c.retries} | "
                f"ETA {duration(eta) if done_now < self.todo else '0 s'} | {self.engine.describe()}"
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
    return (settings.options(SamplingParams, args),
            settings.options(Policy, args, backoff_base_s=args.backoff_base, backoff_max_s=args.backoff_max))


# SGLang's weight_version unless the server was started with --weight-version: it names no weights
UNVERSIONED = (None, "", "default")


def weights_identity(args, engine) -> dict:
    """What identifies the target's weights in the journal's fingerprint: the model directory's fingerprint
    (config + weight files' names, sizes, mtimes) where we have it, and what the servers report. Without
    --model, the directory is the servers' own `model_path` when this machine sees it (a shared file system)."""
    model_dir = args.model
    served = getattr(engine, "served_model_path", None)
    if not model_dir and args.backend != "hf" and served and Path(served).is_dir():
        model_dir = served
    ident = {"model_dir": target.fingerprint(model_dir) if model_dir else None}
    if args.backend != "hf":
        ident["servers"] = engine.identity  # model path @ weight_version
    return ident


def unidentified_weights(args, engine, ident: dict) -> str | None:
    """Why the weights behind the servers cannot be told apart from other weights under the same path (None
    when they can): then a journal's answers may be another model's, and are not reused."""
    if args.backend == "hf" or ident["model_dir"] is not None or engine.weight_version not in UNVERSIONED:
        return None
    return (f"the servers' weights cannot be identified: their model_path {engine.served_model_path!r} is not a "
            f"directory on this machine and their weight_version is {engine.weight_version!r}, so another model "
            "served under that path would look the same. Pass --model DIR (a copy of the served model, "
            "fingerprinted here) or start SGLang with --weight-version V; or delete the journal to generate again")


def shard_settings(args, engine, params: SamplingParams, policy: Policy) -> tuple[str, dict, dict]:
    """(sampling JSON, journal settings, summary meta) of this run."""
    model = args.model_name or engine.model_name
    sampling_json = params.to_json(**policy.recorded(), length_retry_max_new_tokens=policy.length_retry_max_new_tokens,
                                   api=args.api)
    settings = {"model": model, "weights": weights_identity(args, engine), "record_format": RECORD_FORMAT,
                "sampling": json.loads(sampling_json)}
    meta = {"model": model, "sampling_params": json.loads(sampling_json), "backend": args.backend}
    return sampling_json, settings, meta


# --------------------------------------------------------------------------------------------------------
# the run: one queue of (shard, sample) over all shards, `engine.capacity` workers
# --------------------------------------------------------------------------------------------------------
def _check_rejections(jobs: list[ShardJob], rec: dict) -> None:
    rejected = sum(j.counters.rejected for j in jobs)
    finished = sum(j.counters.ok + j.counters.failed for j in jobs)
    if rejected >= 16 and rejected * 2 > finished:
        raise FatalError(f"the server rejects most requests ({rejected} of {finished}), e.g. "
                         f"{rec['failure_reason']!r}: check the configuration (a rerun retries them)")


async def _worker(queue: asyncio.Queue, engine, jobs, params, policy, model, sampling_json, progress, meta,
                  summaries: list) -> None:
    while True:
        try:
            job, row = queue.get_nowait()
        except asyncio.QueueEmpty:
            return
        rec = await generate_sample(engine, row, params, policy, job.counters, model, sampling_json)
        job.journal.add(rec)
        _check_rejections(jobs, rec)
        job.remaining -= 1
        if job.remaining == 0:
            summaries.append(await asyncio.to_thread(job.finalize, {**meta, **progress.versus_calibration()}))


async def _reporter(jobs: list[ShardJob], progress: Progress, interval: float) -> None:
    """Flushes journals on time and logs a progress line every `interval` seconds."""
    last = time.monotonic()
    while True:
        await asyncio.sleep(min(interval, 1.0))
        for job in jobs:
            if not job.finalized:
                job.journal.maybe_flush()
        if time.monotonic() - last >= interval:
            last = time.monotonic()
            LOG.info("%s", progress.line())


async def run_shards(jobs: list[ShardJob], engine, args, progress_interval: float) -> list[dict]:
    params, policy = request_settings(args)
    sampling_json, settings, meta = shard_settings(args, engine, params, policy)
    unidentified = unidentified_weights(args, engine, settings["weights"])
    summaries: list[dict] = []
    for job in jobs:
        await asyncio.to_thread(job.open, settings, args, unidentified)
    if unidentified:
        LOG.warning("%s; a rerun will not resume from this run's journal", unidentified)
    queue: asyncio.Queue = asyncio.Queue()
    for job in jobs:
        if not job.todo:
            summaries.append(await asyncio.to_thread(job.finalize, meta))
        for row in job.todo:
            queue.put_nowait((job, row))
    progress = Progress(jobs, engine, calibration_rate(getattr(args, "calibration", None)))
    LOG.info("%d shards, %d samples, %d to generate with %s (%d requests in flight at most)", len(jobs),
             progress.total, progress.todo, engine.describe(), engine.capacity)
    report_task = asyncio.create_task(_reporter(jobs, progress, progress_interval))
    workers = [asyncio.create_task(_worker(queue, engine, jobs, params, policy, settings["model"], sampling_json,
                                           progress, meta, summaries))
               for _ in range(max(1, min(engine.capacity, progress.todo)))]
    try:
        done, _ = await asyncio.wait(workers, return_when=asyncio.FIRST_EXCEPTION)
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


# --------------------------------------------------------------------------------------------------------
# engines and servers
# --------------------------------------------------------------------------------------------------------
def hf_engine_kind(args) -> str:
    """The hf backend's engine: `--engine`, where auto is the slot decoder on a GPU and generate on CPU."""
    engine = getattr(args, "engine", "auto")
    if engine == "auto":
        return "slots" if str(args.device).startswith("cuda") else "generate"
    return engine


def make_engine(args, urls: list[str] | None = None):
    """The engine these flags configure (hf in-process, or HTTP to `urls` / --servers); not started yet."""
    from dflash_pipeline.generation.engines import HFEngine, HTTPEngine, chat_renderer

    if args.backend == "hf":
        if not args.model:
            raise PipelineError("--backend hf needs --model")
        if hf_engine_kind(args) == "slots":
            from dflash_pipeline.generation.slot_engine import SlotEngine

            return SlotEngine(args.model, batch_size=args.batch_size, device=args.device, dtype=args.dtype,
                              context_length=args.context_length, trust_remote_code=args.trust_remote_code,
                              threads=args.threads or None, width=args.slot_width,
                              max_new_tokens=args.max_new_tokens)
        return HFEngine(args.model, batch_size=args.batch_size, device=args.device, dtype=args.dtype,
                        context_length=args.context_length, trust_remote_code=args.trust_remote_code,
                        threads=args.threads or None, max_batch_tokens=args.max_batch_tokens or None,
                        cache=args.cache)
    render = None
    if args.api == "generate":
        if not args.model:
            raise PipelineError("--api generate needs --model (its tokenizer renders the prompts)")
        render = chat_renderer(args.model, trust_remote_code=args.trust_remote_code)
    return HTTPEngine(urls or args.servers, max_in_flight=args.max_in_flight, request_timeout_s=args.request_timeout,
                      api=args.api, model=args.model_name or None, render=render, context_length=args.context_length,
                      all_down_timeout_s=args.all_down_timeout, revive_after_s=args.revive_after,
                      api_key=os.environ.get(API_KEY_ENV) or None)


async def _amain(jobs, args, urls) -> list[dict]:
    loop = asyncio.get_running_loop()
    main_task = asyncio.current_task()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, main_task.cancel)
    engine = make_engine(args, urls)
    # servers we launched are healthy already; running ones (SGLang: 503 during warm-up) get the full budget
    await engine.start(wait_s=60.0 if urls else args.all_down_timeout)
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
    from dflash_pipeline.generation.servers import launched_servers, requests_in_flight, sglang_command

    if not args.model:
        raise PipelineError("--backend sglang needs --model")
    cfg = json.loads(args.sglang_json)
    command = sglang_command(args.model, cfg, trust_remote_code=args.trust_remote_code)  # checked: fails here
    if os.environ.get(API_KEY_ENV):
        command += ["--api-key", os.environ[API_KEY_ENV]]  # hidden in every logged command
    devices = args.devices or os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = [d for d in devices.split(",") if d.strip()] if devices else None
    sglang = lambda key: settings.value(cfg, f"generate.sglang.{key}")  # noqa: E731 - the schema fills gaps
    args.max_in_flight = requests_in_flight(cfg)
    LOG.info("sglang: %d requests in flight per server (max_running_requests %s x dp_size %s, per DP replica)",
             args.max_in_flight, sglang("max_running_requests"), sglang("dp_size"))
    with launched_servers(command, instances=int(sglang("instances")), devices=devices,
                          log_dir=args.server_log_dir, startup_timeout_s=float(sglang("startup_timeout_s")),
                          gpus_per_server=int(sglang("tp_size")) * int(sglang("dp_size"))) as urls:
        yield urls


def _shard_jobs(args) -> list[ShardJob]:
    journal_dir = Path(args.journal_dir) if args.journal_dir else None
    jobs = []
    for inp, out in zip(args.input, args.out):
        name = Path(out.rstrip("/")).name.removesuffix(".parquet")
        mirror = args.journal_mirror or None  # "" (the config's default) means: none given
        if mirror is None and storage.is_s3(out):
            mirror = out.rsplit("/", 1)[0] + "/journal"
        jdir = journal_dir or (Path(".generate-journal") if storage.is_s3(out) else Path(out).parent / "journal")
        jobs.append(ShardJob(inp, out, jdir / f"{name}.jsonl", f"{mirror.rstrip('/')}/{name}" if mirror else None))
    return jobs


def run(args) -> int:
    if len(args.input) != len(args.out):
        raise PipelineError(f"--input has {len(args.input)} shards but --out has {len(args.out)}")
    if args.backend == "servers" and not args.servers:
        raise PipelineError("--backend servers needs --servers URL [URL ...]")
    if args.model and (args.backend == "hf" or args.api == "generate") and Path(args.model).is_dir():
        from dflash_pipeline.planning.preflight import has_chat_template

        if not has_chat_template(Path(args.model)):  # the prompts are rendered here: say so before any work
            raise PipelineError(f"generate --model {args.model}: the target has no chat template (no "
                                "chat_template.jinja, no chat_template in tokenizer_config.json); copy the model's "
                                "template there, or use a chat model")
    jobs = _shard_jobs(args)
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
