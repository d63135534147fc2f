"""The `extract` stage: the target's hidden states at the drafter's `target_layer_ids` for one token shard.

Per shard: read the token shard; open the output writer, which resumes a partial file only when it was written
from the same token content, the same target (`target.fingerprint`) and the same settings; sort the samples
still to do by length and cut token-budget batches (right padding, no attention mask: with a causal model the
real tokens never see the pads, and sorted lengths keep the waste small); run the forward under inference_mode
with hooks on the wanted layers only (capture.py); on the GPU turn the captured states into byte planes (or fp8
+ scales) and copy them into pinned memory on a side stream (batching.py); the host pipeline encodes, writes and
makes progress durable (host_pipeline.py); close the shard and write its stats.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass

import numpy as np

from dflash_pipeline import settings, storage, target
from dflash_pipeline.compile_profile import name_compiled_workload
from dflash_pipeline.errors import PipelineError
from dflash_pipeline.hidden_states.batching import Batch, copy_to_host, to_host_layout, token_budget_batches
from dflash_pipeline.hidden_states.capture import LayerCapture
from dflash_pipeline.hidden_states.compile_choice import should_compile
from dflash_pipeline.hidden_states.group_stats import shard_name, write_group_stats
from dflash_pipeline.hidden_states.host_pipeline import HostPipeline
from dflash_pipeline.hidden_states.layout import CODECS, STORED_DTYPES
from dflash_pipeline.hidden_states.writer import HiddenStateShardWriter
from dflash_pipeline.progress import Progress
from dflash_pipeline.target_layers import resolve_target_layer_ids

log = logging.getLogger(__name__)


@dataclass
class ExtractSettings:
    """How to extract. The keys of the config's `extract` section default to the schema's (settings.field)."""

    target_layer_ids: list | None = None  # the plan's (the workflow's); None: resolved as the plan does
    num_layers: int = settings.field("drafter.num_layers")  # the drafter's depth
    codec: str = settings.field("extract.codec")
    level: int = settings.field("extract.level")
    dtype: str = settings.field("extract.dtype")                  # stored dtype
    token_budget: int = settings.field("extract.token_budget")    # tokens per forward batch, padding included
    max_batch: int = 256
    device: str = settings.field("extract.device")
    compute_dtype: str = "auto"
    attn_implementation: str = settings.field("extract.attn_implementation")
    trust_remote_code: bool = settings.field("target.trust_remote_code")
    flush_tokens: int = settings.field("extract.flush_tokens")    # progress becomes durable every this many tokens
    encode_threads: int = settings.field("extract.encode_threads")
    queue_batches: int = 2
    skip_unsupervised: bool = True      # samples without a loss-masked token teach the drafter nothing
    compile: bool | str = settings.field("extract.compile")  # torch.compile the layers; auto: on a GPU when the shard amortises it
    pad_multiple: int = 1               # pad batch lengths to a multiple (few shapes for compiled layers)


@dataclass
class TokenShard:
    sample_ids: list
    input_ids: list   # numpy int32 per sample
    loss_mask: list   # numpy uint8 per sample
    fingerprint: str  # of the content: a shard rewritten with other tokens under the same ids differs


def _content_fingerprint(sample_ids, input_ids, loss_mask) -> str:
    h = hashlib.sha256()
    for sid, ids, mask in zip(sample_ids, input_ids, loss_mask):
        h.update(f"{sid}\0{len(ids)}\0".encode())
        h.update(ids.tobytes())
        h.update(mask.tobytes())
    return h.hexdigest()[:32]


def read_token_shard(path: str) -> TokenShard:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        with storage.open_binary(path) as fh:
            table = pq.read_table(fh, columns=["sample_id", "input_ids", "loss_mask"])
    except (OSError, pa.ArrowException, KeyError) as exc:  # missing, unreadable, not parquet, columns missing
        raise PipelineError(f"{path}: cannot read the token shard ({type(exc).__name__}: {exc})") from exc
    ids = table.column("sample_id").to_pylist()
    input_ids = [np.asarray(x if x is not None else [], dtype=np.int32) for x in table.column("input_ids").to_pylist()]
    loss_mask = [np.asarray(x if x is not None else [], dtype=np.uint8) for x in table.column("loss_mask").to_pylist()]
    _check_token_rows(path, ids, input_ids, loss_mask)
    return TokenShard(ids, input_ids, loss_mask, _content_fingerprint(ids, input_ids, loss_mask))


def _check_token_rows(path: str, ids: list, input_ids: list, loss_mask: list) -> None:
    """What would otherwise fail only after the GPU work (or make a resume skip the wrong sample)."""
    seen: set = set()
    for row, (sid, tokens, mask) in enumerate(zip(ids, input_ids, loss_mask)):
        if not isinstance(sid, str) or not sid:
            raise PipelineError(f"{path}: row {row} has no sample_id")
        if sid in seen:
            raise PipelineError(f"{path}: sample {sid!r} appears twice (row {row})")
        seen.add(sid)
        if len(tokens) != len(mask):
            raise PipelineError(f"{path}: sample {sid!r} has {len(tokens)} input_ids but {len(mask)} loss_mask values")


def check_token_range(path: str, tokens: TokenShard, rows: int) -> None:
    """Every token id indexes the target's embedding (an id outside it is data tokenized for another model)."""
    for sid, ids in zip(tokens.sample_ids, tokens.input_ids):
        if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= rows):
            bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
            raise PipelineError(f"{path}: sample {sid!r}: token id {bad} outside the target's embedding "
                                f"(0..{rows - 1}): tokenized for another model?")


# ------------------------------------------------------------------------------------------ phases


def _layer_ids(model, settings: ExtractSettings) -> list[int]:
    num_target_layers = int(target.text_config(model.config).num_hidden_layers)
    return resolve_target_layer_ids(settings.target_layer_ids, settings.num_layers, num_target_layers)


def _prepare_capture(model, settings: ExtractSettings, device: str, tokens: int) -> tuple[LayerCapture, int]:
    """Hooks on the wanted layers (compiled when `should_compile`); returns them and the pad multiple."""
    capture = LayerCapture(model, _layer_ids(model, settings))
    compile_layers = should_compile(settings.compile, device, tokens)
    log.info("extract: %d tokens to do, %s", tokens, "compiled layers" if compile_layers else "eager layers")
    if compile_layers:
        if not getattr(model, "_dflash_layers_compiled", False):  # once per model: a job extracts several shards
            # every extraction job of this target (and calibrate-rates' warm-up) shares the compiled profile
            name_compiled_workload("extract", {"config": model.config.to_dict(), "layers": capture.ids})
            capture.compile()
            model._dflash_layers_compiled = True
        return capture, max(settings.pad_multiple, 64)
    return capture, settings.pad_multiple


def _shard_metadata(model, model_path: str, tokens_path: str, tokens: TokenShard, layer_ids) -> dict:
    """What the shard says about itself; also what a resume must match (writer.py's journal header)."""
    tcfg = target.text_config(model.config)
    return {
        "target_layer_ids": list(layer_ids), "hidden_size": int(tcfg.hidden_size),
        "num_layers": int(tcfg.num_hidden_layers), "model_path": str(model_path),
        "model_type": getattr(model.config, "model_type", None), "target_fingerprint": target.fingerprint(model_path),
        "tokens_path": str(tokens_path), "tokens_fingerprint": tokens.fingerprint,
        "compute_dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
    }


def _samples_to_do(tokens: TokenShard, settings: ExtractSettings, done: set) -> tuple[list[int], int]:
    """Indices of the samples still to extract, and how many the shard skips as empty or unsupervised."""
    keep = [i for i, ids in enumerate(tokens.input_ids) if len(ids) > 0
            and (not settings.skip_unsupervised or int(tokens.loss_mask[i].sum()) > 0)]
    return [i for i in keep if tokens.sample_ids[i] not in done], len(tokens.sample_ids) - len(keep)


def _forward_batch(capture, tokens: TokenShard, idx: list[int], settings, pad_multiple: int, device, stream):
    """One batch through the target; its states in the codec's layout, on their way to host memory."""
    import torch

    lens = [len(tokens.input_ids[i]) for i in idx]
    S = -(-max(lens) // pad_multiple) * pad_multiple
    x = np.zeros((len(idx), S), dtype=np.int64)
    for r, i in enumerate(idx):
        x[r, : lens[r]] = tokens.input_ids[i]
    xt = torch.from_numpy(x)
    if stream is not None:
        xt = xt.pin_memory().to(device, non_blocking=True)
    host = to_host_layout(capture.run(xt), settings.codec, settings.dtype)
    event = None
    if stream is not None:  # the copy runs on a side stream while the next forward starts
        stream.wait_stream(torch.cuda.current_stream())
        host = copy_to_host(host, stream)
        event = torch.cuda.Event()
        event.record(stream)
    return Batch([tokens.sample_ids[i] for i in idx], [tokens.input_ids[i] for i in idx],
                 [tokens.loss_mask[i] for i in idx], lens, host, event), len(idx) * S


def _run_batches(capture, tokens, batches, settings, pad_multiple, device, host: HostPipeline,
                 progress: Progress) -> int:
    """Forward every batch, feeding the host pipeline; returns the padded token count."""
    import torch

    stream = torch.cuda.Stream() if device.startswith("cuda") else None
    padded = 0
    try:
        with torch.inference_mode():
            for idx in batches:
                if host.errors:
                    break
                batch, n = _forward_batch(capture, tokens, idx, settings, pad_multiple, device, stream)
                padded += n
                host.put(batch)
                progress.update(sum(len(tokens.input_ids[i]) for i in idx))
    except BaseException:
        host.finish(raise_errors=False)
        raise
    host.finish()
    return padded


def _stats(out_path, host: HostPipeline, padded: int, resumed: int, skipped: int, meta: dict, settings,
           device: str, t_start: float, t_gpu: float) -> dict:
    import torch

    # the whole shard (samples resumed from an earlier run included); the rate is this run's work
    cols = host.writer._cols
    stats = {"samples": len(cols["sample_ids"]), "tokens": int(sum(cols["num_tokens"])),
             "stored_bytes": int(sum(cols["lengths"])), "padded_tokens": padded,
             "this_run": dict(host.stats)}
    now = time.perf_counter()
    raw = stats["tokens"] * meta["num_feature_layers"] * meta["hidden_size"] * 2
    stats.update({
        "raw_bf16_bytes": raw, "shard": os.path.basename(out_path), "resumed_samples": resumed,
        "skipped_unsupervised": skipped, "target_layer_ids": meta["target_layer_ids"],
        "hidden_size": meta["hidden_size"], "codec": settings.codec, "level": settings.level, "dtype": settings.dtype,
        "compression_vs_bf16": stats["stored_bytes"] / raw if raw else None,
        "padding_waste": 1 - host.stats["tokens"] / padded if padded else 0.0,
        "seconds": now - t_start, "seconds_extract": now - t_gpu,
        "tokens_per_s": host.stats["tokens"] / (now - t_gpu) if now > t_gpu else None,
        "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
        "file_bytes": os.path.getsize(out_path),
    })
    return stats


# ------------------------------------------------------------------------------------------ the stage


def resume_key(meta: dict, settings: ExtractSettings) -> str:
    """What a finished shard file was written from (tokens, target, layers, codec): a grouped job that was
    killed after some of its shards skips those whose stats carry the same key."""
    what = [meta, settings.codec, settings.level, settings.dtype, settings.skip_unsupervised]
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _finished_before(out_path: str, stats_path: str | None, key: str) -> dict | None:
    """The stats of a complete shard file written from the same inputs (renamed into place: never partial)."""
    if not stats_path or not os.path.exists(out_path) or not os.path.exists(stats_path):
        return None
    try:
        stats = storage.read_json(stats_path)
    except (OSError, ValueError):
        return None
    return stats if isinstance(stats, dict) and stats.get("resume_key") == key else None


def load_target(model_path: str, settings: ExtractSettings):
    device = target.resolve_device(settings.device)
    return target.load_model(model_path, device, settings.compute_dtype, attn_implementation=
                             settings.attn_implementation, trust_remote_code=settings.trust_remote_code)


def extract_shard(tokens_path: str, model_path: str, out_path: str, settings: ExtractSettings | None = None, *,
                  stats_path: str | None = None, model=None, tokens: TokenShard | None = None,
                  job: dict | None = None) -> dict:
    """Extract one shard; returns its stats. `model` may be passed in (a grouped job, tests, benchmarks)."""
    settings = settings or ExtractSettings()
    t_start = time.perf_counter()
    device = target.resolve_device(settings.device)
    tokens = tokens or read_token_shard(tokens_path)  # before loading the target: a bad input fails in seconds
    if model is None:
        model = load_target(model_path, settings)
    check_token_range(tokens_path, tokens, model.get_input_embeddings().num_embeddings)  # before any file is opened
    meta = _shard_metadata(model, model_path, tokens_path, tokens, _layer_ids(model, settings))
    key = resume_key(meta, settings)
    earlier = _finished_before(out_path, stats_path, key)
    if earlier is not None:
        log.info("%s: already extracted from the same tokens and settings (%d samples): kept", out_path,
                 earlier.get("samples", 0))
        return earlier
    capture = None
    try:
        writer = HiddenStateShardWriter(out_path, meta, codec=settings.codec, level=settings.level,
                                        dtype=settings.dtype, resume=True)
        done = writer.completed_ids
        todo, skipped = _samples_to_do(tokens, settings, done)
        capture, pad_multiple = _prepare_capture(model, settings, device,
                                                 sum(len(tokens.input_ids[i]) for i in todo))
        if done:
            log.info("resuming %s: %d samples already written, %d to go", out_path, len(done), len(todo))
        lengths = [len(tokens.input_ids[i]) for i in todo]
        batches = [[todo[j] for j in b] for b in token_budget_batches(lengths, settings.token_budget,
                                                                         settings.max_batch)]
        host = HostPipeline(writer, settings.encode_threads, settings.queue_batches, settings.flush_tokens,
                            background_flush=device.startswith("cuda"))
        t_gpu = time.perf_counter()
        try:
            progress = Progress(f"extract {os.path.basename(out_path)}", sum(lengths), "tokens", log)
            padded = _run_batches(capture, tokens, batches, settings, pad_multiple, device, host, progress)
        except BaseException:
            writer.abort()
            raise
        writer.close()
    finally:
        if capture is not None:
            capture.remove()
    stats = _stats(out_path, host, padded, len(done), skipped, writer.metadata, settings, device, t_start, t_gpu)
    stats["resume_key"] = key
    if job:
        stats["job"] = job
    log.info("%s: %d samples, %d tokens, %.1f tok/s, %.3f x bf16, padding %.1f%%", out_path, stats["samples"],
             stats["tokens"], stats["tokens_per_s"] or 0, stats["compression_vs_bf16"] or 0,
             100 * stats["padding_waste"])
    if stats_path:
        storage.write_json(stats_path, stats)
    return stats


def extract_shards(tokens_paths: list, model_path: str, out_paths: list, settings: ExtractSettings | None = None,
                   *, stats_paths: list | None = None, model=None) -> list[dict]:
    """A job's shards, one after another in one process (rules/extract.smk: a group of extract.shards_per_job
    shards; one shard is a group of one): python, torch and the target load once, and the layers compile once
    when the group's tokens amortise it. Each shard is its own resumable file and stats."""
    settings = settings or ExtractSettings()
    stats_paths = list(stats_paths or [None] * len(out_paths))
    if not len(tokens_paths) == len(out_paths) == len(stats_paths):
        raise PipelineError(f"extract: {len(tokens_paths)} --tokens, {len(out_paths)} --out and "
                            f"{len(stats_paths)} --stats: one of each per shard")
    t0 = time.perf_counter()
    shards = [read_token_shard(p) for p in tokens_paths]  # every input before the target: a bad one fails in seconds
    model = model if model is not None else load_target(model_path, settings)
    startup = time.perf_counter() - t0
    device = target.resolve_device(settings.device)
    group_tokens = sum(int(sum(len(ids) for ids in shard.input_ids)) for shard in shards)
    shard_settings = dataclasses.replace(settings, compile=should_compile(settings.compile, device, group_tokens))
    results = []
    for i, (tokens_path, shard, out, stats_path) in enumerate(zip(tokens_paths, shards, out_paths, stats_paths)):
        job = {"shards": len(shards), "position": i, "startup_s": round(startup, 3) if i == 0 else 0.0}
        results.append(extract_shard(tokens_path, model_path, out, shard_settings, stats_path=stats_path,
                                     model=model, tokens=shard, job=job))
    log.info("extract: %d shard(s) in one job, %.1f s to start (inputs read, target loaded)", len(shards), startup)
    return results


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", nargs="+", required=True,
                   help="token shard(s) (parquet: sample_id, input_ids, loss_mask), extracted in one process")
    p.add_argument("--model", required=True, help="target model directory")
    p.add_argument("--out", nargs="+", required=True, help="hidden-state shard to write (.dfhs), one per --tokens")
    p.add_argument("--stats", nargs="*", default=None,
                   help="JSON with tokens, bytes, throughput of each shard, one per --tokens")
    p.add_argument("--group-stats", help="the same stats of every shard in one file, written once all are done "
                                         "(what the plan and the report read: hidden_states/group_stats.py)")
    p.add_argument("--target-layer-ids", type=int, nargs="+",
                   help="the target's layer ids (the workflow passes the plan's); default: spread for --num-layers")
    p.add_argument("--num-layers", type=int, help="the drafter's layers (their target layers when no ids are given)")
    p.add_argument("--codec", choices=CODECS)
    p.add_argument("--level", type=int, help="zstd level (0: store uncompressed)")
    p.add_argument("--dtype", choices=STORED_DTYPES, help="stored dtype")
    p.add_argument("--token-budget", type=int, help="tokens per forward batch (incl. padding)")
    p.add_argument("--max-batch", type=int, default=256)
    p.add_argument("--device", help="auto | cpu | cuda | cuda:N (honours CUDA_VISIBLE_DEVICES)")
    p.add_argument("--compute-dtype", default="auto", choices=list(target.COMPUTE_DTYPES),
                   help="auto: bf16 on GPU, fp32 on CPU")
    p.add_argument("--attn-implementation")
    p.add_argument("--trust-remote-code", action="store_true", default=None)
    p.add_argument("--flush-tokens", type=int, help="make progress durable every N tokens")
    p.add_argument("--encode-threads", type=int)
    p.add_argument("--compile", choices=["auto", "true", "false"],
                   help="torch.compile the target's layers; auto: on a GPU when the shard's tokens x layer parameters "
                        "amortise the compilation (~1.3x faster forward, ~15-30 s to compile)")


def settings_from_args(args) -> ExtractSettings:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(ExtractSettings) if hasattr(args, f.name)}
    values["target_layer_ids"] = [int(x) for x in args.target_layer_ids] if args.target_layer_ids else None
    values["compile"] = {"true": True, "false": False}.get(args.compile, "auto")
    return ExtractSettings(**values)


def run(args) -> int:
    results = extract_shards(args.tokens, args.model, args.out, settings_from_args(args),
                             stats_paths=args.stats or None)
    if args.group_stats:
        write_group_stats(args.group_stats, {shard_name(out): stats for out, stats in zip(args.out, results)})
    return 0
