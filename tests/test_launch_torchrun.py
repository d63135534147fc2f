"""`launch-torchrun`: the command lines it builds, and a real two-worker rendezvous on this machine."""

from __future__ import annotations

import json
import os
import sys

from conftest import BIN, run_cli

from dflash_pipeline.cluster.launch_torchrun import build_command, expand_hostlist

CMD = ["/venv/bin/dflash-pipeline", "train", "--out", "ckpt"]


def test_hostlist_expansion():
    assert expand_hostlist("gpu[07-09,12],login-1") == ["gpu07", "gpu08", "gpu09", "gpu12", "login-1"]
    assert expand_hostlist("node1") == ["node1"]
    assert expand_hostlist("a[1-2]-ib,b3") == ["a1-ib", "a2-ib", "b3"]


def test_single_process_runs_the_command_as_is():
    assert build_command(CMD, env={}) == CMD
    assert build_command(CMD, env={"CUDA_VISIBLE_DEVICES": "3"}) == CMD


def test_one_node_many_gpus_is_standalone():
    cmd = build_command(CMD, env={"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, python="py")
    assert cmd[:3] == ["py", "-m", "torch.distributed.run"]
    assert "--standalone" in cmd and cmd[cmd.index("--nproc-per-node") + 1] == "4"
    assert cmd[-len(CMD):] == CMD and cmd[-len(CMD) - 1] == "--no-python"


def test_multi_node_inside_slurm_allocation():
    env = {"SLURM_JOB_ID": "4711", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "gpu[07-08]",
           "SLURM_GPUS_ON_NODE": "8", "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}
    cmd = build_command(CMD, env=env, python="py")
    # one torchrun per node via srun, each starting 8 workers, meeting on the first node
    assert cmd[:8] == ["srun", "--nodes", "2", "--ntasks", "2", "--ntasks-per-node", "1", "--kill-on-bad-exit=1"]
    opt = lambda name: cmd[cmd.index(name) + 1]  # noqa: E731
    assert opt("--nnodes") == "2" and opt("--nproc-per-node") == "8"
    assert opt("--rdzv-backend") == "c10d"
    assert opt("--rdzv-endpoint") == f"gpu07:{29500 + 4711 % 2000}"
    assert opt("--rdzv-id") == "slurm-4711"
    assert cmd[-len(CMD):] == CMD
    # SLURM_GPUS_PER_NODE may carry a type
    env2 = dict(env, SLURM_GPUS_ON_NODE="", SLURM_GPUS_PER_NODE="h100:4")
    cmd2 = build_command(CMD, env=env2, python="py", rdzv_port=12345)
    assert cmd2[cmd2.index("--nproc-per-node") + 1] == "4" and "gpu07:12345" in cmd2


def test_multi_node_without_slurm_is_an_error():
    proc = run_cli("launch-torchrun", "--nnodes", "2", "--dry-run", "--", "true", check=False,
                   env={k: v for k, v in os.environ.items() if not k.startswith("SLURM_")})
    assert proc.returncode == 2 and "SLURM" in proc.stderr


def test_real_two_worker_rendezvous(tmp_path):
    """Two CPU workers (gloo) started by the launcher find each other and all-reduce."""
    script = tmp_path / "worker.py"
    script.write_text(
        "import json, os, sys, torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "t = torch.tensor([dist.get_rank() + 1.0]); dist.all_reduce(t)\n"
        "json.dump({'rank': dist.get_rank(), 'world': dist.get_world_size(), 'sum': t.item(),"
        " 'local_rank': int(os.environ['LOCAL_RANK'])}, open(sys.argv[1] + f'.{dist.get_rank()}', 'w'))\n"
        "dist.destroy_process_group()\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["OMP_NUM_THREADS"] = "1"
    run_cli("launch-torchrun", "--nproc-per-node", "2", "--", str(BIN / "python"), script, tmp_path / "out",
            env=env, timeout=120)
    results = sorted((json.loads((tmp_path / f"out.{r}").read_text()) for r in range(2)), key=lambda d: d["rank"])
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["world"] == 2 and r["sum"] == 3.0 for r in results)
    assert [r["local_rank"] for r in results] == [0, 1]


def test_a_stop_signal_to_the_launcher_reaches_the_command_and_its_exit_status_is_the_jobs(tmp_path):
    """SIGTERM to the launcher alone (not its process group): the command gets it, finishes what it does on it, and
    the launcher exits with the command's status, not killed before it."""
    import signal
    import subprocess
    import time

    ready = tmp_path / "ready"
    script = tmp_path / "worker.py"
    script.write_text(
        "import pathlib, signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: (time.sleep(0.5), sys.exit(43)))\n"
        f"pathlib.Path({str(ready)!r}).write_text('1')\n"
        "time.sleep(60)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    proc = subprocess.Popen([str(BIN / "dflash-pipeline"), "launch-torchrun", "--nproc-per-node", "1", "--",
                             str(BIN / "python"), str(script)], env=env, start_new_session=True)
    deadline = time.monotonic() + 60
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ready.exists()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 43


def test_train_resources_one_and_many_nodes():
    from dflash_pipeline.cluster.launch_torchrun import train_resources

    assert train_resources(1, 8) == {"gpu": 8, "nodes": 1}
    # several nodes: a per-node GRES (not --gpus, a total), one launcher task per node, run in the batch step
    assert train_resources(4, 8) == {"nodes": 4, "gres": "gpu:8", "tasks": 4, "mpi": "srun"}


def test_bad_counts_are_clear_errors():
    import pytest

    from dflash_pipeline.errors import PipelineError

    with pytest.raises(PipelineError, match="nproc-per-node 'four'"):
        build_command(CMD, nproc="four", env={})
    with pytest.raises(PipelineError, match="nnodes '2x'"):
        build_command(CMD, nnodes="2x", env={"SLURM_JOB_ID": "1"})
