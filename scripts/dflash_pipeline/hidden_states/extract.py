"""Extract the target's hidden states at the drafter's `target_layer_ids` for one token shard.

Pipeline, per shard:
  main thread  sort samples by length, cut token-budget batches (right padding, no attention mask: with a
               causal model the real tokens never see the pads, and sorted lengths keep the waste small),
               forward under inference_mode with hooks on the wanted layers only; the forward stops right
               after the last wanted layer (no later layers, no final norm, no LM head). On the GPU the
               captured states are stacked, turned into byte planes (or fp8 + scales) and copied into
               pinned host memory on a side stream.
  dispatcher   waits for a batch's copy, hands its samples to a thread pool that compresses and checksums.
  writer       appends encoded samples in order and makes them durable every `flush_tokens` tokens, so a
               killed job resumes from the last flushed chunk (see hidden_states_format's journal).
The GPU only waits when the bounded queues are full, i.e. when the disk or the compressors are slower.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass

import numpy as np

from dflash_pipeline.hidden_states import shard_format as hsf
from dflash_pipeline.hidden_states.codec import quantize_fp8
from dflash_pipeline import storage
from dflash_pipeline.errors import PipelineError
from dflash_pipeline.target_layers import resolve_target_layer_ids, validate_target_layer_ids

log = logging.getLogger(__name__)


class _StopForward(Exception):
    """Raised by the hook of the last wanted layer: nothing after it is needed."""


# ------------------------------------------------------------------------------------------ model access


def text_config(config):
    return getattr(config, "text_config", None) or config


def find_decoder_layers(model):
    """The target's decoder layer list (dense, MoE, hybrid GDN, or the language model of a VL wrapper)."""
    import torch

    n = text_config(model.config).num_hidden_layers
    candidates = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and name.split(".")[-1] == "layers" and len(module) == n:
            if any(part in name for part in ("visual", "vision", "audio", "mtp")):
                continue
            candidates.append((name.count("."), name, module))
    if not candidates:
        raise PipelineError(f"cannot find the {n} decoder layers of {type(model).__name__}")
    return sorted(candidates)[0][2]


class LayerCapture:
    """Forward hooks on the wanted layers; `run(input_ids)` returns their outputs [B, S, n, H].

    An id k captures the output of decoder layer k, i.e. `hidden_states[k + 1]` of output_hidden_states.
    """

    def __init__(self, model, layer_ids):
        self.model = model
        self.layers = find_decoder_layers(model)
        self.ids = validate_target_layer_ids(layer_ids, len(self.layers))
        self._caps: dict[int, object] = {}
        self._active = False
        self._handles = []
        last = self.ids[-1]
        for i in self.ids:
            self._handles.append(self.layers[i].register_forward_hook(self._hook(i, i == last)))

    def _hook(self, i, stop):
        def hook(module, args, output):
            if not self._active:  # other forwards of the model are left alone
                return None
            self._caps[i] = output[0] if isinstance(output, (tuple, list)) else output
            if stop:
                raise _StopForward

        return hook

    def run(self, input_ids, **kwargs):
        import torch

        self._caps.clear()
        self._active = True
        try:
            self.model(input_ids=input_ids, use_cache=False, **kwargs)
        except _StopForward:
            pass
        finally:
            self._active = False
        missing = [i for i in self.ids if i not in self._caps]
        if missing:
            raise PipelineError(f"layers {missing} produced no output in the forward pass")
        out = torch.stack([self._caps[i] for i in self.ids], dim=2)
        self._caps.clear()
        return out

    def compile(self):
        """torch.compile each needed layer's forward (the hooks stay outside the compiled code); fuses the
        norms, rotary and activation kernels around the matmuls. Layers after the last wanted one never run."""
        import torch

        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        for layer in self.layers[: self.ids[-1] + 1]:
            layer.forward = torch.compile(layer.forward, dynamic=None)

    def remove(self):
        for h in self._handles:
            h.remove()
        self._handles.clear()


def resolve_device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise PipelineError(f"--device {name}: no CUDA device visible (CUDA_VISIBLE_DEVICES="
                            f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")
    return name


def load_target(model_path: str, device: str, compute_dtype: str = "auto", attn_implementation: str = "sdpa",
                trust_remote_code: bool = False):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = {"auto": torch.bfloat16 if device != "cpu" else torch.float32, "bfloat16": torch.bfloat16,
             "float32": torch.float32, "float16": torch.float16}[compute_dtype]
    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    kwargs = dict(dtype=dtype, trust_remote_code=trust_remote_code)
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    model = AutoModelForCausalLM.from_pretrained(model_path, config=config, **kwargs)
    model.to(device).eval()
    return model


# ------------------------------------------------------------------------------------------ batching


def token_budget_batches(lengths, token_budget: int, max_batch: int = 256, max_padding: float = 0.2):
    """Indices sorted by length (longest first) cut into batches with batch * max_len <= token_budget and
    at most `max_padding` of each batch's tokens being padding (a new batch starts when a sample is
    shorter than (1 - max_padding) x the batch's longest)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches, cur = [], []
    for i in order:
        longest = lengths[cur[0]] if cur else lengths[i]
        if cur and ((len(cur) + 1) * longest > token_budget or len(cur) >= max_batch
                    or lengths[i] < (1 - max_padding) * longest):
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


@dataclass
class _Batch:
    ids: list           # sample ids
    input_ids: list     # numpy int32 per sample
    loss_mask: list
    lengths: list
    host: object        # host tensor: planes [P, B, S, L*H] (zstd), [B, S, L, H] (raw) or (q, scales) (fp8)
    event: object       # CUDA event of the copy, or None


def _to_host_layout(feats, codec: str, dtype: str):
    """[B, S, L, H] captured states -> the layout the codec stores, computed where the states are."""
    import torch

    tdt = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    if codec == "fp8":
        q, scales = quantize_fp8(feats)
        return (q, scales)
    x = feats.to(tdt)
    if codec == "raw":
        return x.contiguous()
    idt, nbits = (torch.int16, 16) if dtype == "bfloat16" else (torch.int32, 32)
    bits = x.contiguous().view(idt)
    rot = (bits << 1) | ((bits >> (nbits - 1)) & 1)  # the sign bit moves to the bottom (hsf.split_planes)
    B, S, L, H = x.shape
    item = nbits // 8
    return rot.view(torch.uint8).view(B, S, L * H, item).permute(3, 0, 1, 2).contiguous()


def _copy_to_host(obj, stream):
    import torch

    if isinstance(obj, tuple):
        return tuple(_copy_to_host(o, stream) for o in obj)
    if obj.device.type == "cpu":
        return obj
    host = torch.empty(obj.shape, dtype=obj.dtype, pin_memory=True)
    with torch.cuda.stream(stream):
        host.copy_(obj, non_blocking=True)
    obj.record_stream(stream)
    return host


def _encode_sample(codec: hsf.Codec, batch: _Batch, b: int):
    t = batch.lengths[b]
    kind = codec.codec
    if kind == "zstd":
        planes = batch.host[:, b, :t].numpy()  # [P, t, L*H]; each plane contiguous
        return codec.encode(batch.ids[b], batch.input_ids[b], batch.loss_mask[b], planes=planes)
    if kind == "raw":
        x = batch.host[b, :t]
        return codec.encode(batch.ids[b], batch.input_ids[b], batch.loss_mask[b], x)
    q, s = batch.host
    return codec.encode(batch.ids[b], batch.input_ids[b], batch.loss_mask[b],
                        fp8=(q[b, :t].numpy(), s[b, :t].numpy()))


# ------------------------------------------------------------------------------------------ the stage


def _maybe_test_kill():
    # the resume test kills the process for real (SIGKILL, no cleanup) right after the Nth durable chunk
    left = os.environ.get("DFLASH_TEST_KILL_AFTER_FLUSHES")
    if left is not None:
        left = int(left) - 1
        os.environ["DFLASH_TEST_KILL_AFTER_FLUSHES"] = str(left)
        if left <= 0:
            import signal

            os.kill(os.getpid(), signal.SIGKILL)


def read_token_shard(path: str):
    import pyarrow.parquet as pq

    with storage.open_binary(path) as fh:
        table = pq.read_table(fh, columns=["sample_id", "input_ids", "loss_mask"])
    ids = table.column("sample_id").to_pylist()
    input_ids = [np.asarray(x, dtype=np.int32) for x in table.column("input_ids").to_pylist()]
    loss_mask = [np.asarray(x, dtype=np.uint8) for x in table.column("loss_mask").to_pylist()]
    return ids, input_ids, loss_mask


def extract_shard(tokens_path: str, model_path: str, out_path: str, *, layer_ids=None, drafter_config=None,
                  codec: str = "zstd", level: int = 3, dtype: str = "bfloat16", token_budget: int = 16384,
                  max_batch: int = 256, device: str = "auto", compute_dtype: str = "auto",
                  attn_implementation: str = "sdpa", trust_remote_code: bool = False, flush_tokens: int = 262144,
                  encode_threads: int = 4, queue_batches: int = 2, skip_unsupervised: bool = True,
                  stats_path: str | None = None, model=None, compile=False,
                  pad_multiple: int = 1) -> dict:
    """Extract one shard; returns its stats. `model` may be passed in (tests, benchmarks)."""
    import torch

    t_start = time.perf_counter()
    device = resolve_device(device)
    if model is None:
        model = load_target(model_path, device, compute_dtype, attn_implementation, trust_remote_code)
    tcfg = text_config(model.config)
    num_layers = int(tcfg.num_hidden_layers)
    if layer_ids:
        layer_ids = validate_target_layer_ids(layer_ids, num_layers)
    else:
        layer_ids = resolve_target_layer_ids(drafter_config, num_layers)
    capture = LayerCapture(model, layer_ids)
    if compile == "auto":
        compile = device.startswith("cuda")
    if compile:
        capture.compile()
        pad_multiple = max(pad_multiple, 64)
    metadata = {
        "target_layer_ids": layer_ids, "hidden_size": int(tcfg.hidden_size), "num_layers": num_layers,
        "model_path": str(model_path), "model_type": getattr(model.config, "model_type", None),
        "tokens_path": str(tokens_path), "compute_dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
    }
    sample_ids, input_ids, loss_mask = read_token_shard(tokens_path)
    keep = [i for i in range(len(sample_ids)) if len(input_ids[i]) > 0
            and (not skip_unsupervised or int(loss_mask[i].sum()) > 0)]
    skipped = len(sample_ids) - len(keep)
    writer = hsf.HiddenStateShardWriter(out_path, metadata, codec=codec, level=level, dtype=dtype, resume=True)
    done = writer.completed_ids
    todo = [i for i in keep if sample_ids[i] not in done]
    if done:
        log.info("resuming %s: %d samples already written, %d to go", out_path, len(done), len(todo))
    lengths = [len(input_ids[i]) for i in todo]
    batches = [[todo[j] for j in b] for b in token_budget_batches(lengths, token_budget, max_batch)]
    on_gpu = device.startswith("cuda")
    copy_stream = torch.cuda.Stream() if on_gpu else None
    pool = cf.ThreadPoolExecutor(max(1, encode_threads), thread_name_prefix="encode")
    q_batches: queue.Queue = queue.Queue(maxsize=max(1, queue_batches))
    q_write: queue.Queue = queue.Queue(maxsize=max(1, queue_batches))
    errors: list[BaseException] = []
    stats = {"samples": 0, "tokens": 0, "padded_tokens": 0, "stored_bytes": 0, "raw_bf16_bytes": 0}
    L, H = len(layer_ids), int(tcfg.hidden_size)

    def dispatcher():
        try:
            while (batch := q_batches.get()) is not None:
                if batch.event is not None:
                    batch.event.synchronize()
                q_write.put([pool.submit(_encode_sample, writer.codec, batch, b) for b in range(len(batch.ids))])
        except BaseException as exc:  # pragma: no cover - surfaced below
            errors.append(exc)
        finally:
            q_write.put(None)

    def write_loop():
        since_flush = 0
        try:
            while (futures := q_write.get()) is not None:
                for f in futures:
                    enc = f.result()
                    writer.add_encoded(enc)
                    stats["samples"] += 1
                    stats["tokens"] += enc.num_tokens
                    stats["stored_bytes"] += sum(len(memoryview(p).cast("B")) for p, _ in enc.sections)
                    since_flush += enc.num_tokens
                if since_flush >= flush_tokens:
                    writer.flush(background=on_gpu)
                    since_flush = 0
                    _maybe_test_kill()
        except BaseException as exc:
            errors.append(exc)
            while q_write.get() is not None:  # drain so the dispatcher never blocks
                pass

    threads = [threading.Thread(target=dispatcher, name="dispatch", daemon=True),
               threading.Thread(target=write_loop, name="writer", daemon=True)]
    for th in threads:
        th.start()
    t_gpu = time.perf_counter()
    try:
        with torch.inference_mode():
            for batch_idx in batches:
                if errors:
                    break
                lens = [len(input_ids[i]) for i in batch_idx]
                S = -(-max(lens) // pad_multiple) * pad_multiple  # few distinct shapes for compiled layers
                x = np.zeros((len(batch_idx), S), dtype=np.int64)
                for r, i in enumerate(batch_idx):
                    x[r, : lens[r]] = input_ids[i]
                xt = torch.from_numpy(x)
                if on_gpu:
                    xt = xt.pin_memory().to(device, non_blocking=True)
                feats = capture.run(xt)
                host = _to_host_layout(feats, codec, dtype)
                del feats
                event = None
                if on_gpu:
                    copy_stream.wait_stream(torch.cuda.current_stream())
                    host = _copy_to_host(host, copy_stream)
                    event = torch.cuda.Event()
                    event.record(copy_stream)
                stats["padded_tokens"] += len(batch_idx) * S
                q_batches.put(_Batch([sample_ids[i] for i in batch_idx], [input_ids[i] for i in batch_idx],
                                     [loss_mask[i] for i in batch_idx], lens, host, event))
    finally:
        q_batches.put(None)
        for th in threads:
            th.join()
        pool.shutdown(wait=True)
        capture.remove()
    if errors:
        writer.abort()
        raise errors[0]
    writer.close()
    elapsed = time.perf_counter() - t_start
    gpu_elapsed = time.perf_counter() - t_gpu
    stats["raw_bf16_bytes"] = stats["tokens"] * L * H * 2
    stats.update({
        "shard": os.path.basename(out_path), "resumed_samples": len(done), "skipped_unsupervised": skipped,
        "target_layer_ids": layer_ids, "hidden_size": H, "codec": codec, "level": level, "dtype": dtype,
        "compression_vs_bf16": stats["stored_bytes"] / stats["raw_bf16_bytes"] if stats["tokens"] else None,
        "padding_waste": 1 - stats["tokens"] / stats["padded_tokens"] if stats["padded_tokens"] else 0.0,
        "seconds": elapsed, "seconds_extract": gpu_elapsed,
        "tokens_per_s": stats["tokens"] / gpu_elapsed if gpu_elapsed > 0 else None,
        "device": torch.cuda.get_device_name() if on_gpu else "cpu",
        "file_bytes": os.path.getsize(out_path),
    })
    log.info("%s: %d samples, %d tokens, %.1f tok/s, %.3f x bf16, padding %.1f%%", out_path, stats["samples"],
             stats["tokens"], stats["tokens_per_s"] or 0, stats["compression_vs_bf16"] or 0,
             100 * stats["padding_waste"])
    if stats_path:
        storage.write_json(stats_path, stats)
    return stats


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", required=True, help="token shard (parquet: sample_id, input_ids, loss_mask)")
    p.add_argument("--model", required=True, help="target model directory")
    p.add_argument("--out", required=True, help="hidden-state shard to write (.dfhs)")
    p.add_argument("--stats", help="JSON with tokens, bytes, throughput of this shard")
    p.add_argument("--target-layer-ids", help="comma-separated layer ids (default: from --drafter-config)")
    p.add_argument("--drafter-config", default="{}",
                   help="JSON of the config's drafter section (target_layer_ids or num_layers)")
    p.add_argument("--codec", choices=hsf.CODECS, default="zstd")
    p.add_argument("--level", type=int, default=3, help="zstd level (0: store uncompressed)")
    p.add_argument("--dtype", choices=hsf.STORED_DTYPES, default="bfloat16", help="stored dtype")
    p.add_argument("--token-budget", type=int, default=16384, help="tokens per forward batch (incl. padding)")
    p.add_argument("--max-batch", type=int, default=256)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (honours CUDA_VISIBLE_DEVICES)")
    p.add_argument("--compute-dtype", default="auto", choices=["auto", "bfloat16", "float32", "float16"],
                   help="auto: bf16 on GPU, fp32 on CPU")
    p.add_argument("--attn-implementation", default="sdpa")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--flush-tokens", type=int, default=262144, help="make progress durable every N tokens")
    p.add_argument("--encode-threads", type=int, default=4)
    p.add_argument("--compile", choices=["auto", "true", "false"], default="auto",
                   help="torch.compile the target's layers; auto: on a GPU (~1.3x faster forward, ~15-30 s to compile)")


def run(args) -> int:
    ids = [int(x) for x in args.target_layer_ids.split(",")] if args.target_layer_ids else None
    extract_shard(
        args.tokens, args.model, args.out, layer_ids=ids, drafter_config=json.loads(args.drafter_config or "{}"),
        codec=args.codec, level=args.level, dtype=args.dtype, token_budget=args.token_budget,
        max_batch=args.max_batch, device=args.device, compute_dtype=args.compute_dtype,
        attn_implementation=args.attn_implementation, trust_remote_code=args.trust_remote_code,
        flush_tokens=args.flush_tokens, encode_threads=args.encode_threads, stats_path=args.stats,
        compile={"true": True, "false": False}.get(args.compile, "auto"))
    return 0
