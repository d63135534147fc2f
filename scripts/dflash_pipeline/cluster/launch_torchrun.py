"""`dflash-pipeline launch-torchrun -- CMD ...`: run CMD as a torch.distributed job, one or many nodes.

- One process (one node, at most one GPU): CMD runs as it is (the CPU demo).
- One node, P GPUs: `torchrun --standalone --nproc-per-node P --no-python CMD`.
- Inside a SLURM allocation of N > 1 nodes: one `torchrun` per node through
  `srun --nodes N --ntasks N --ntasks-per-node 1`, all meeting at a c10d rendezvous on the allocation's
  first node (`--rdzv-endpoint HOST:PORT --rdzv-id $SLURM_JOB_ID`), each starting P workers.

torchrun sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT for every worker; the training
stage reads those. `--dry-run` prints the command instead of running it.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import shutil
import subprocess
import sys

from dflash_pipeline.errors import PipelineError

log = logging.getLogger(__name__)


def expand_hostlist(nodelist: str) -> list[str]:
    """SLURM's compact host list (`gpu[01-03,07],login-1`) as host names, in order."""
    hosts: list[str] = []
    # split on commas that are not inside brackets
    parts, depth, cur = [], 0, ""
    for ch in nodelist:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if cur:
        parts.append(cur)
    for part in parts:
        m = re.fullmatch(r"([^\[\]]*)\[([^\]]+)\](.*)", part.strip())
        if not m:
            hosts.append(part.strip())
            continue
        prefix, ranges, suffix = m.groups()
        for item in ranges.split(","):
            if "-" in item:
                lo, hi = item.split("-", 1)
                width = len(lo)
                hosts.extend(f"{prefix}{i:0{width}d}{suffix}" for i in range(int(lo), int(hi) + 1))
            else:
                hosts.append(f"{prefix}{item}{suffix}")
    return [h for h in hosts if h]


def slurm_nodes(env=None) -> list[str]:
    env = os.environ if env is None else env
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    if not nodelist:
        return []
    return expand_hostlist(nodelist)


def slurm_job_info(job_id: str) -> dict[str, str]:
    """`scontrol show job -o ID` as a dict. Inside a Snakemake SLURM job step most SLURM_* variables are
    removed from the job's environment (only the job id is kept), so the allocation is asked for here."""
    if not shutil.which("scontrol"):
        return {}
    try:
        out = subprocess.run(["scontrol", "show", "job", "-o", str(job_id)], capture_output=True, text=True,
                             timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    info = {}
    for token in out.split():
        key, sep, value = token.partition("=")
        if sep:
            info[key] = value
    return info


def _with_allocation(env) -> dict:
    """env, completed from `scontrol` with the allocation's node count, node list and GPUs per node."""
    if not env.get("SLURM_JOB_ID") or env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES"):
        return env
    info = slurm_job_info(env["SLURM_JOB_ID"])
    env = dict(env)
    if info.get("NumNodes"):
        env["SLURM_JOB_NUM_NODES"] = info["NumNodes"].split("-")[0]
    if info.get("NodeList"):
        env["SLURM_JOB_NODELIST"] = info["NodeList"]
    m = re.search(r"gpu(?::[A-Za-z0-9_.]+)?[:=](\d+)", info.get("TresPerNode", ""))
    if m and not env.get("SLURM_GPUS_ON_NODE"):
        env["SLURM_GPUS_ON_NODE"] = m.group(1)
    return env


def train_resources(nodes: int, gpus_per_node: int) -> dict:
    """Snakemake resources for a training job of `nodes` x `gpus_per_node` GPUs.

    One node: `gpu` (counted locally by --resources gpu=N, `--gpus` on SLURM with the profile's gpu_model).
    Several nodes (SLURM): a per-node GRES (`--gres=gpu:N` is per node, `--gpus` would be a total), `nodes`,
    one task per node, and `mpi` so that the SLURM executor runs the command in the batch step instead of
    one `srun -n1` step: launch-torchrun then starts one torchrun per node with its own srun.
    """
    if nodes <= 1:
        return {"gpu": gpus_per_node, "nodes": 1}
    return {"nodes": nodes, "gres": f"gpu:{gpus_per_node}", "tasks": nodes, "mpi": "srun"}


def _gpus_on_node(env) -> int:
    for key in ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE"):
        value = env.get(key, "")
        m = re.search(r"(\d+)$", value)  # SLURM_GPUS_PER_NODE may be "h100:8"
        if m and int(m.group(1)) > 0:
            return int(m.group(1))
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    if cvd:
        return len([x for x in cvd.split(",") if x.strip()])
    return 1


def build_command(command: list[str], nproc: str = "auto", nnodes: str = "auto", rdzv_port: int | None = None,
                  env=None, python: str | None = None, max_restarts: int = 0) -> list[str]:
    """The launch command line for `command` under the current environment (see the module doc)."""
    env = _with_allocation(os.environ if env is None else env)
    python = python or sys.executable
    in_slurm = bool(env.get("SLURM_JOB_ID"))
    try:
        if nnodes != "auto":
            n_nodes = int(nnodes)
        elif in_slurm:
            n_nodes = int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or 1)
        else:
            n_nodes = 1
        n_proc = int(nproc) if nproc != "auto" else _gpus_on_node(env)
    except ValueError as exc:
        raise PipelineError(f"launch-torchrun: nnodes {nnodes!r} / nproc-per-node {nproc!r}: expected a whole "
                            f"number or auto ({exc})") from exc
    if n_nodes < 1 or n_proc < 1:
        raise PipelineError(f"launch-torchrun: nnodes={n_nodes} nproc-per-node={n_proc} must be >= 1")
    torchrun = [python, "-m", "torch.distributed.run"]
    if n_nodes == 1 and n_proc == 1:
        return list(command)
    if n_nodes == 1:
        return [*torchrun, "--standalone", "--nnodes", "1", "--nproc-per-node", str(n_proc),
                "--max-restarts", str(max_restarts), "--no-python", *command]
    if not in_slurm:
        raise PipelineError("launch-torchrun: more than one node needs a SLURM allocation (no $SLURM_JOB_ID)")
    hosts = slurm_nodes(env)
    if len(hosts) < n_nodes:
        raise PipelineError(f"launch-torchrun: {n_nodes} nodes wanted, the allocation lists {hosts}")
    job_id = env["SLURM_JOB_ID"]
    # a port derived from the job id, so that two jobs sharing a first node do not collide
    port = rdzv_port or 29500 + int(job_id) % 2000
    srun = ["srun", "--nodes", str(n_nodes), "--ntasks", str(n_nodes), "--ntasks-per-node", "1",
            "--kill-on-bad-exit=1"]
    return [*srun, *torchrun, "--nnodes", str(n_nodes), "--nproc-per-node", str(n_proc),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{hosts[0]}:{port}", "--rdzv-id", f"slurm-{job_id}",
            "--max-restarts", str(max_restarts), "--no-python", *command]


def add_arguments(parser) -> None:
    parser.add_argument("--nproc-per-node", default="auto",
                        help="workers per node (auto: the GPUs SLURM gave the node, or CUDA_VISIBLE_DEVICES, else 1)")
    parser.add_argument("--nnodes", default="auto", help="nodes (auto: $SLURM_JOB_NUM_NODES inside SLURM, else 1)")
    parser.add_argument("--rdzv-port", type=int, default=None, help="rendezvous port (default 29500 + job id %% 2000)")
    parser.add_argument("--max-restarts", type=int, default=0)
    parser.add_argument("--dry-run", action="store_true", help="print the command instead of running it")
    parser.add_argument("command", nargs="+", help="the command each worker runs (after --)")


def run(args) -> int:
    from dflash_pipeline.cluster.gpu_slots import command_after_dashes

    command = command_after_dashes(args.command, "launch-torchrun")
    if os.path.sep not in command[0]:
        # resolve console scripts such as dflash-pipeline now: srun on another node gets the absolute path
        command[0] = shutil.which(command[0]) or command[0]
    cmd = build_command(command, nproc=args.nproc_per_node, nnodes=args.nnodes, rdzv_port=args.rdzv_port,
                        max_restarts=args.max_restarts)
    line = " ".join(shlex.quote(c) for c in cmd)
    if args.dry_run:
        print(line)
        return 0
    log.info("launch: %s", line)
    sys.stdout.flush()
    sys.stderr.flush()
    return run_forwarding_stop_signals(cmd)


def run_forwarding_stop_signals(cmd: list[str]) -> int:
    """Run `cmd` and return its exit status; a SIGTERM/SIGINT sent to this launcher is passed on and the launcher
    waits, so the training stage can write its checkpoint and its exit status (143/130) becomes the job's. A
    signal the command also got directly (SLURM signals the whole step) arrives twice within seconds: the stage
    takes that as one request (drafter/stop_signals.py)."""
    import contextlib
    import signal

    from dflash_pipeline.drafter.stop_signals import STOP_SIGNALS

    proc = subprocess.Popen(cmd)

    def forward(signum, frame):
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in STOP_SIGNALS}
    try:
        return proc.wait()
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
