"""The SGLang server launcher of the `sglang` backend: build and check the command, start, wait, always stop.

`ManagedServer` starts one server process (by default `python -m sglang.launch_server ...`; the command is
configurable, which is how the tests launch their SGLang-speaking stand-in through this same code path),
bound to 127.0.0.1 on a free port, waits for `GET /health` (SGLang answers 503 until its warm-up is done), and
always stops it: on success, on an exception, on SIGTERM/SIGINT (the caller turns those into exceptions), and,
if the job itself is killed with SIGKILL, through the kernel's parent-death signal. The server runs in its own
process group, so its workers go too. The flags are checked against SGLang's real flag list before anything
starts (`sglang_flags`).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from dflash_pipeline import settings
from dflash_pipeline.errors import PipelineError
from dflash_pipeline.generation import sglang_flags

LOG = logging.getLogger(__name__)
# launch flags whose value is a secret: never logged
_SECRET_FLAG = re.compile(r"^--[\w-]*(key|token|secret|password)[\w-]*$", re.IGNORECASE)

def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # runs in the child before exec
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: SIGTERM when the job dies, even by SIGKILL


# config `generate.sglang` key -> SGLang launch flag
CONFIG_FLAGS = [("reasoning_parser", "--reasoning-parser"), ("mem_fraction_static", "--mem-fraction-static"),
                ("max_running_requests", "--max-running-requests"), ("context_length", "--context-length"),
                ("tp_size", "--tp-size"), ("dp_size", "--dp-size"),
                ("mamba_radix_cache_strategy", "--mamba-radix-cache-strategy"),
                ("tool_call_parser", "--tool-call-parser")]  # tool calls parsed into message.tool_calls


def sglang_command(model_path: str, cfg: dict, trust_remote_code: bool = False) -> list[str]:
    """The launch command from config `generate.sglang` (host and port are added by the launcher), its flags
    checked against SGLang's real ones: a flag SGLang does not have is an error here, before any launch."""
    if cfg.get("mamba_scheduler_strategy"):
        raise PipelineError("generate.sglang.mamba_scheduler_strategy: SGLang 0.5.23 has no "
                            "--mamba-scheduler-strategy; use mamba_radix_cache_strategy (e.g. extra_buffer)")
    flags = ["--model-path", str(model_path)]
    for key, flag in CONFIG_FLAGS:
        if cfg.get(key) not in (None, ""):
            flags += [flag, str(cfg[key])]
    if trust_remote_code:
        flags.append("--trust-remote-code")
    flags += [str(a) for a in cfg.get("extra_args") or []]
    sglang_flags.check_launch_args(flags + ["--host", "127.0.0.1", "--port", "30000"])
    return list(cfg.get("launch_command") or [sys.executable, "-m", "sglang.launch_server"]) + flags


def requests_in_flight(cfg: dict) -> int:
    """Client requests in flight per server: `max_in_flight` when set, else what keeps every data-parallel
    replica full (SGLang's `max_running_requests` applies per DP replica, so a server runs up to
    dp_size x max_running_requests at once)."""
    if cfg.get("max_in_flight"):
        return int(cfg["max_in_flight"])
    return (int(settings.value(cfg, "generate.sglang.max_running_requests"))
            * int(settings.value(cfg, "generate.sglang.dp_size")))


def shown(command: list[str]) -> str:
    """The command as logged: values of secret flags (--api-key, ...) hidden."""
    out = []
    for i, arg in enumerate(command):
        out.append("***" if i and _SECRET_FLAG.match(str(command[i - 1])) else str(arg))
    return " ".join(out)


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
        LOG.info("%s: starting %s", self.name, shown(cmd))
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
                with urllib.request.urlopen(self.url + "/health", timeout=30) as resp:  # SGLang: up to 20 s
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


def device_groups(devices: list[str], instances: int, per_server: int = 1) -> list[list[str]]:
    """Split the job's GPUs evenly over `instances` servers, each needing `per_server` (tp_size x dp_size)."""
    if len(devices) % max(1, instances):
        raise PipelineError(f"{len(devices)} GPUs cannot be split evenly over {instances} sglang instances")
    k = len(devices) // max(1, instances)
    if k < per_server:
        raise PipelineError(f"each of {instances} sglang instance(s) gets {k} GPU(s) but tp_size x dp_size needs "
                            f"{per_server}: give the job {per_server * instances} GPUs (generate.gpus)")
    return [devices[i * k:(i + 1) * k] for i in range(max(1, instances))]


@contextlib.contextmanager
def launched_servers(command: list[str], *, instances: int = 1, devices: list[str] | None = None,
                     log_dir: str | os.PathLike | None = None, startup_timeout_s: float = 1800.0,
                     retries: int = 2, gpus_per_server: int = 1):
    """Start `instances` servers (each on its share of `devices`), yield their URLs, always stop them."""
    servers: list[ManagedServer] = []
    try:
        groups = device_groups(devices, instances, gpus_per_server) if devices else [None] * max(1, instances)
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
