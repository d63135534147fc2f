"""Generation backends: in-process transformers (`hf`) and the SGLang server launcher (`sglang`).

`HFEngine` batches concurrent requests from the client's workers into `model.generate` calls run in a
thread, so the CPU demo uses exactly the client code that drives SGLang servers.

`ManagedServer` starts one server process (by default `python -m sglang.launch_server ...`; the command is
configurable, which is how the tests launch their SGLang-speaking test server through this same code path),
bound to 127.0.0.1 on a free port, waits for `GET /health`, and always stops it: on success, on an exception,
on SIGTERM/SIGINT (the caller turns those into exceptions), and, if the job itself is killed with SIGKILL,
through the kernel's parent-death signal. The server runs in its own process group, so its workers go too.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from dflash_pipeline.errors import PipelineError
from dflash_pipeline.generation.client import Completion, PermanentError, split_reasoning

LOG = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------------------
# hf: in-process transformers, batched
# --------------------------------------------------------------------------------------------------------
class HFEngine:
    def __init__(self, model_path: str, *, batch_size: int = 32, device: str = "cpu", dtype: str = "auto",
                 context_length: int | None = None, trust_remote_code: bool = False, max_wait_s: float = 0.02,
                 seed: int = 0, threads: int | None = None):
        self.threads = threads
        self.model_path = str(model_path)
        self.batch_size = batch_size
        self.device = device
        self.dtype = dtype
        self.context_length = context_length
        self.trust_remote_code = trust_remote_code
        self.max_wait_s = max_wait_s
        self.seed = seed
        self.model = None
        self._queue: asyncio.Queue | None = None
        self._task: asyncio.Task | None = None
        self._in_flight = 0

    @property
    def capacity(self) -> int:
        return 2 * self.batch_size  # one batch running, the next one filling

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def describe(self) -> str:
        return f"hf in-process on {self.device}"

    async def start(self, wait_s: float = 0) -> None:
        await asyncio.to_thread(self._load)
        self._queue = asyncio.Queue()
        self._task = asyncio.create_task(self._batch_loop())

    def _load(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if self.threads:
            # small models on a shared CPU: one intra-op thread avoids OpenMP spin contention (30x here)
            torch.set_num_threads(self.threads)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path, trust_remote_code=self.trust_remote_code)
        self.tokenizer.padding_side = "left"
        dtype = {"auto": "auto", "bfloat16": torch.bfloat16, "float32": torch.float32,
                 "float16": torch.float16}[self.dtype]
        self.model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=dtype,
                                                          trust_remote_code=self.trust_remote_code)
        self.model.to(self.device).eval()
        if self.context_length is None:
            self.context_length = int(getattr(self.model.config, "max_position_embeddings", 1 << 30))
        self.eos_ids = {i for i in [self.tokenizer.eos_token_id,
                                    self.tokenizer.convert_tokens_to_ids("<|im_end|>")] if isinstance(i, int)}
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else min(self.eos_ids)
        self.model_name = self.model_path

    async def close(self) -> None:
        if self._task and not self._task.done():
            self._queue.put_nowait(None)  # the batch loop ends at the sentinel
            try:
                await asyncio.wait_for(asyncio.shield(self._task), 30)
            except (asyncio.TimeoutError, Exception):
                self._task.cancel()

    def render(self, messages: list[dict], enable_thinking: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                  enable_thinking=enable_thinking)

    async def complete(self, messages, params, max_new_tokens: int) -> Completion:
        ids = self.tokenizer(self.render(messages, params.enable_thinking), add_special_tokens=False)["input_ids"]
        if len(ids) + max_new_tokens > self.context_length:
            raise PermanentError(f"prompt too long: {len(ids)} prompt tokens + {max_new_tokens} new tokens "
                                 f"exceed the context length {self.context_length}")
        future = asyncio.get_running_loop().create_future()
        self._in_flight += 1
        try:
            await self._queue.put((ids, max_new_tokens, params, future))
            return await future
        finally:
            self._in_flight -= 1

    async def _batch_loop(self) -> None:
        while True:
            first = await self._queue.get()
            if first is None:
                return
            batch = [first]
            await asyncio.sleep(self.max_wait_s)  # let concurrent requests join the batch
            stop = False
            while len(batch) < self.batch_size and not self._queue.empty():
                item = self._queue.get_nowait()
                if item is None:
                    stop = True
                    break
                batch.append(item)
            # one generate call per (budget, sampling) group
            groups: dict = {}
            for item in batch:
                groups.setdefault((item[1], item[2]), []).append(item)
            for (budget, params), items in groups.items():
                live = [it for it in items if not it[3].done()]
                if not live:
                    continue
                try:
                    results = await asyncio.to_thread(self._generate, [it[0] for it in live], budget, params)
                except Exception as exc:  # a model failure fails these requests, not the loop
                    for it in live:
                        if not it[3].done():
                            it[3].set_exception(exc)
                    continue
                for it, res in zip(live, results):
                    if not it[3].done():
                        it[3].set_result(res)
            if stop:
                return

    def _generate(self, prompts: list[list[int]], budget: int, params) -> list[Completion]:
        import torch

        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, i in enumerate(order):
            p = prompts[i]
            input_ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        kwargs = dict(max_new_tokens=budget, pad_token_id=self.pad_id, eos_token_id=sorted(self.eos_ids))
        if params.temperature > 0:
            kwargs.update(do_sample=True, temperature=params.temperature, top_p=params.top_p,
                          top_k=params.top_k if params.top_k > 0 else None)
            torch.manual_seed(self.seed if params.seed is None else params.seed)
        else:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        with torch.inference_mode():
            out = self.model.generate(input_ids=input_ids.to(self.device), attention_mask=mask.to(self.device),
                                      **kwargs)
        new = out[:, width:].tolist()
        results: list[Completion | None] = [None] * len(prompts)
        for row, i in enumerate(order):
            tokens = new[row]
            finish = "length"
            for k, t in enumerate(tokens):
                if t in self.eos_ids:
                    tokens, finish = tokens[:k + 1], "stop"  # the end token is part of what was generated
                    break
            text = self.tokenizer.decode(tokens[:-1] if finish == "stop" else tokens, skip_special_tokens=False)
            content, reasoning = split_reasoning(text, params.enable_thinking)
            results[i] = Completion(content=content, reasoning=reasoning, finish_reason=finish,
                                    prompt_tokens=len(prompts[i]), completion_tokens=len(tokens),
                                    server="hf", output_ids=tokens, prompt_ids=list(prompts[i]))
        return results


# --------------------------------------------------------------------------------------------------------
# sglang: launch servers, wait for /health, always shut them down
# --------------------------------------------------------------------------------------------------------
def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # runs in the child before exec
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: SIGTERM when the job dies, even by SIGKILL


def sglang_command(model_path: str, cfg: dict, trust_remote_code: bool = False) -> list[str]:
    """The launch command from config `generate.sglang` (host and port are added by the launcher)."""
    base = list(cfg.get("launch_command") or [sys.executable, "-m", "sglang.launch_server"])
    cmd = base + ["--model-path", str(model_path)]
    if cfg.get("reasoning_parser"):
        cmd += ["--reasoning-parser", str(cfg["reasoning_parser"])]
    for key, flag in [("mem_fraction_static", "--mem-fraction-static"),
                      ("max_running_requests", "--max-running-requests"),
                      ("context_length", "--context-length"), ("tp_size", "--tp-size"), ("dp_size", "--dp-size"),
                      ("mamba_scheduler_strategy", "--mamba-scheduler-strategy")]:
        if cfg.get(key) not in (None, ""):
            cmd += [flag, str(cfg[key])]
    if trust_remote_code:
        cmd.append("--trust-remote-code")
    cmd += [str(a) for a in cfg.get("extra_args") or []]
    return cmd


class ManagedServer:
    def __init__(self, command: list[str], *, host: str = "127.0.0.1", env: dict | None = None,
                 log_path: str | os.PathLike | None = None, startup_timeout_s: float = 1800.0,
                 stop_grace_s: float = 30.0, name: str = "sglang"):
        self.command = list(command)
        self.host = host
        self.env = env
        self.log_path = Path(log_path) if log_path else None
        self.startup_timeout_s = startup_timeout_s
        self.stop_grace_s = stop_grace_s
        self.name = name
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None
        self._log = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> None:
        self.port = free_port(self.host)
        cmd = self.command + ["--host", self.host, "--port", str(self.port)]
        if self.log_path:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = open(self.log_path, "ab")
        LOG.info("%s: starting %s", self.name, " ".join(cmd))
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=self._log or subprocess.DEVNULL, stderr=subprocess.STDOUT,
            env={**os.environ, **(self.env or {})}, start_new_session=True, preexec_fn=_die_with_parent,
        )

    def wait_healthy(self) -> float:
        t0 = time.monotonic()
        delay = 0.2
        while True:
            code = self.proc.poll()
            if code is not None:
                raise PipelineError(f"{self.name} exited with code {code} before it was healthy"
                                    f"{self._log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        took = time.monotonic() - t0
                        LOG.info("%s healthy at %s after %.1f s", self.name, self.url, took)
                        return took
            except (urllib.error.URLError, OSError, ValueError):
                pass
            if time.monotonic() - t0 > self.startup_timeout_s:
                raise PipelineError(f"{self.name} not healthy after {self.startup_timeout_s:.0f} s{self._log_tail()}")
            time.sleep(delay)
            delay = min(2.0, delay * 1.5)

    def _log_tail(self, n: int = 2000) -> str:
        if not self.log_path or not self.log_path.exists():
            return ""
        if self._log:
            self._log.flush()
        data = self.log_path.read_bytes()[-n:].decode("utf-8", "replace")
        return f"; last server log lines ({self.log_path}):\n{data}"

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            LOG.info("%s: stopping %s (pid %d)", self.name, self.url, self.proc.pid)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(self.stop_grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        with contextlib.suppress(ProcessLookupError):  # stragglers of the group
            os.killpg(self.proc.pid, signal.SIGKILL)
        if self._log:
            self._log.close()
            self._log = None
        self.proc = None


def device_groups(devices: list[str], instances: int) -> list[list[str]]:
    """Split the job's GPUs evenly over `instances` servers."""
    if instances <= 1:
        return [devices]
    if len(devices) % instances:
        raise PipelineError(f"{len(devices)} GPUs cannot be split evenly over {instances} sglang instances")
    k = len(devices) // instances
    return [devices[i * k:(i + 1) * k] for i in range(instances)]


@contextlib.contextmanager
def launched_servers(command: list[str], *, instances: int = 1, devices: list[str] | None = None,
                     log_dir: str | os.PathLike | None = None, startup_timeout_s: float = 1800.0,
                     retries: int = 2):
    """Start `instances` servers (each on its share of `devices`), yield their URLs, always stop them."""
    servers: list[ManagedServer] = []
    try:
        groups = device_groups(devices, instances) if devices else [None] * max(1, instances)
        for i, group in enumerate(groups):
            env = {"CUDA_VISIBLE_DEVICES": ",".join(group)} if group else None
            log_path = Path(log_dir) / f"server-{i}.log" if log_dir else None
            servers.append(ManagedServer(command, env=env, log_path=log_path, startup_timeout_s=startup_timeout_s,
                                         name=f"server {i}"))
        for server in servers:
            server.start()
        for server in servers:  # they start in parallel; wait for each
            for attempt in range(retries + 1):
                try:
                    server.wait_healthy()
                    break
                except PipelineError:
                    if attempt == retries or server.proc is None or server.proc.poll() is None:
                        raise
                    LOG.warning("%s died while starting (port taken?); starting it again", server.name)
                    server.stop()
                    server.start()
        yield [s.url for s in servers]
    finally:
        for server in servers:
            server.stop()
