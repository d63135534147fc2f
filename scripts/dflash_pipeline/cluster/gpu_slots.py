"""`dflash-pipeline with-gpus --n N -- CMD ...`: give a job N distinct GPUs, then exec CMD.

Snakemake's local executor counts `--resources gpu=N` but does not say *which* GPUs a job may use, so two
GPU jobs running at once would both land on device 0. This helper takes N free GPU ids from a pool,
holds one lock file per GPU (an `flock` on `<lock-dir>/gpu-<id>.lock`) and execs CMD with
`CUDA_VISIBLE_DEVICES` set to them. The lock file descriptors are inherited across exec, so the GPUs stay
taken until CMD and every child it forked have exited, however they exit (a killed job frees its GPUs:
the kernel drops the locks with the last descriptor; no stale lock files to clean up).

The lock dir's name is predictable, so it is created with mode 0700 and must belong to this user and be
writable by no one else; lock files are opened with O_NOFOLLOW and must be regular files: a link planted
there by someone else is an error, never a file this job truncates.

The pool, first match wins: `--pool`, `$DFLASH_GPU_POOL`, `$CUDA_VISIBLE_DEVICES` (ids or UUIDs), or the
GPUs that `nvidia-smi -L` lists. Inside a SLURM job (`$SLURM_JOB_ID`) the scheduler has already
assigned the devices: the command runs unchanged. With `--n 0` the command runs with no GPU visible.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import shutil
import stat
import subprocess
import sys
import time

from dflash_pipeline.errors import PipelineError

log = logging.getLogger(__name__)

DEFAULT_LOCK_DIR_ENV = "DFLASH_GPU_LOCK_DIR"
POOL_ENV = "DFLASH_GPU_POOL"


def default_lock_dir() -> str:
    return os.environ.get(DEFAULT_LOCK_DIR_ENV) or os.path.join("/tmp", f"dflash-gpu-locks-{os.getuid()}")


def _split_ids(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def detect_pool(explicit: str | None = None) -> tuple[list[str], str]:
    """The GPU ids a job may choose from, and where they came from."""
    if explicit:
        return _split_ids(explicit), "--pool"
    if os.environ.get(POOL_ENV):
        return _split_ids(os.environ[POOL_ENV]), POOL_ENV
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        return _split_ids(os.environ["CUDA_VISIBLE_DEVICES"]), "CUDA_VISIBLE_DEVICES"
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.TimeoutExpired):
            out = ""
        ids = [m.group(1) for m in re.finditer(r"^GPU (\d+):", out, flags=re.M)]
        return ids, "nvidia-smi"
    return [], "none found"


def _lock_name(gpu_id: str) -> str:
    return "gpu-" + re.sub(r"[^A-Za-z0-9_.-]", "_", gpu_id) + ".lock"


def _open_lock_file(lock_dir: str, gpu_id: str) -> int:
    """The lock file's descriptor; never follows a symbolic link and never opens anything but a regular file
    of this user (O_NONBLOCK: a planted FIFO cannot hang the open)."""
    path = os.path.join(lock_dir, _lock_name(gpu_id))
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise PipelineError(f"with-gpus: lock file {path} is a symbolic link; refusing to follow it "
                                "(remove it, or choose another --lock-dir)") from exc
        raise PipelineError(f"with-gpus: cannot open lock file {path}: {exc.strerror}") from exc
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
        os.close(fd)
        raise PipelineError(f"with-gpus: lock file {path} is not a regular file of this user; refusing to use it")
    return fd


def _try_lock(lock_dir: str, gpu_id: str) -> int | None:
    fd = _open_lock_file(lock_dir, gpu_id)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            return None
        raise PipelineError(f"with-gpus: cannot lock {os.path.join(lock_dir, _lock_name(gpu_id))}: "
                            f"{exc.strerror} (is the lock dir on a file system without flock?)") from exc
    # who holds it, for a human looking at the lock dir (the lock itself is the flock, not this text)
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def ensure_lock_dir(lock_dir: str) -> None:
    """Create the lock dir (0700), or check that an existing one is this user's and writable by no one else."""
    try:
        os.makedirs(lock_dir, mode=0o700, exist_ok=True)
        st = os.lstat(lock_dir)
    except OSError as exc:
        raise PipelineError(f"with-gpus: cannot create lock dir {lock_dir}: {exc.strerror}") from exc
    if not stat.S_ISDIR(st.st_mode):
        raise PipelineError(f"with-gpus: lock dir {lock_dir} is not a directory (a symbolic link?); refusing it")
    if st.st_uid != os.getuid():
        raise PipelineError(f"with-gpus: lock dir {lock_dir} belongs to uid {st.st_uid}, not to this user "
                            f"({os.getuid()}); refusing it (choose another --lock-dir)")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise PipelineError(f"with-gpus: lock dir {lock_dir} is writable by others "
                            f"(mode {stat.S_IMODE(st.st_mode):o}); refusing it (chmod 700 {lock_dir})")


def acquire(n: int, pool: list[str], lock_dir: str, timeout: float | None = None,
            poll: float = 0.5) -> tuple[list[str], list[int]]:
    """Take `n` distinct GPUs from `pool` (all or nothing), waiting up to `timeout` seconds (None: forever).

    Returns the ids and the open, locked file descriptors (close them to free the GPUs).
    """
    if n > len(pool):
        raise PipelineError(f"with-gpus: {n} GPU(s) wanted but the pool has {len(pool)}: {pool}")
    ensure_lock_dir(lock_dir)
    deadline = None if timeout is None else time.monotonic() + timeout
    waited = False
    while True:
        ids: list[str] = []
        fds: list[int] = []
        for gpu_id in pool:
            fd = _try_lock(lock_dir, gpu_id)
            if fd is not None:
                ids.append(gpu_id)
                fds.append(fd)
                if len(ids) == n:
                    return ids, fds
        for fd in fds:  # not enough: give back what we took so that no two jobs each hold half
            os.close(fd)
        if deadline is not None and time.monotonic() >= deadline:
            raise PipelineError(f"with-gpus: no {n} free GPU(s) in {pool} after {timeout:.0f} s (locks in {lock_dir})")
        if not waited:
            log.info("waiting for %d free GPU(s) of %s", n, pool)
            waited = True
        time.sleep(poll)


def add_arguments(parser) -> None:
    parser.add_argument("--n", type=int, required=True, help="number of GPUs the command needs (0: none)")
    parser.add_argument("--pool", default=None, help="comma-separated GPU ids to choose from (default: detect)")
    parser.add_argument("--lock-dir", default=None,
                        help=f"directory of per-GPU lock files, this user's, mode 0700 "
                             f"(default ${DEFAULT_LOCK_DIR_ENV} or /tmp/dflash-gpu-locks-UID)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds to wait for free GPUs (default: forever)")
    parser.add_argument("--cpu-fallback", action="store_true",
                        help="when the machine has no GPU at all, run the command on CPU instead of failing")
    parser.add_argument("command", nargs="+", help="the command to run (put it after --)")


def command_after_dashes(command: list[str], stage: str) -> list[str]:
    """The wrapped command of `STAGE [options] -- CMD ...` (argparse may keep the `--`); an empty one is an error."""
    command = list(command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise PipelineError(f"{stage}: no command given")
    return command


def run(args) -> int:
    command = command_after_dashes(args.command, "with-gpus")
    env = os.environ.copy()
    if args.n < 0:
        raise PipelineError("with-gpus: --n must be >= 0")
    if os.environ.get("SLURM_JOB_ID") and not args.pool:
        # the scheduler assigned this job its GPUs (--gpus / --gres) and set CUDA_VISIBLE_DEVICES itself
        log.info("inside SLURM job %s: CUDA_VISIBLE_DEVICES=%s as assigned", os.environ["SLURM_JOB_ID"],
                 os.environ.get("CUDA_VISIBLE_DEVICES", ""))
    elif args.n == 0:
        env["CUDA_VISIBLE_DEVICES"] = ""
    else:
        pool, source = detect_pool(args.pool)
        if not pool and args.cpu_fallback:
            log.warning("with-gpus: no GPU on this machine (%s); running on CPU", source)
            env["CUDA_VISIBLE_DEVICES"] = ""
        else:
            lock_dir = args.lock_dir or default_lock_dir()
            ids, fds = acquire(args.n, pool, lock_dir, timeout=args.timeout)
            for fd in fds:
                os.set_inheritable(fd, True)  # the locks live as long as the command and its children
            env["CUDA_VISIBLE_DEVICES"] = ",".join(ids)
            log.info("GPUs %s (pool %s from %s)", env["CUDA_VISIBLE_DEVICES"], pool, source)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(command[0], command, env)
    except OSError as exc:
        raise PipelineError(f"with-gpus: cannot run {command[0]!r}: {exc}") from exc
    return 1  # not reached
