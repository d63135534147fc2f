"""`with-gpus`: concurrent jobs get distinct GPUs, a killed job frees its GPUs, and it works under Snakemake."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import textwrap
import time
from pathlib import Path

from conftest import BIN, run_cli

# the command each fake GPU job runs: record which devices it got and when, then hold them a while
RECORD = (
    'import json, os, sys, time; t0 = time.time(); time.sleep(float(sys.argv[2])); '
    'json.dump({"cvd": os.environ["CUDA_VISIBLE_DEVICES"], "t0": t0, "t1": time.time()}, open(sys.argv[1], "w"))'
)


def _env(lock_dir: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k != "CUDA_VISIBLE_DEVICES"}
    env["DFLASH_GPU_LOCK_DIR"] = str(lock_dir)
    env.update(extra)
    return env


def _with_gpus(args, env, **kw):
    return subprocess.Popen([str(BIN / "dflash-pipeline"), "with-gpus", *args], env=env, **kw)


def test_concurrent_jobs_get_distinct_gpus(tmp_path):
    env = _env(tmp_path / "locks", DFLASH_GPU_POOL="0,1,2,3")
    procs = [
        _with_gpus(["--n", "2", "--", str(BIN / "python"), "-c", RECORD, str(tmp_path / f"job{i}.json"), "1.5"], env)
        for i in range(4)
    ]
    assert all(p.wait(timeout=60) == 0 for p in procs)
    jobs = [json.loads((tmp_path / f"job{i}.json").read_text()) for i in range(4)]
    for job in jobs:
        ids = job["cvd"].split(",")
        assert len(ids) == 2 and len(set(ids)) == 2 and set(ids) <= {"0", "1", "2", "3"}
    # any two jobs that ran at the same time hold disjoint devices
    overlapping = 0
    for i in range(4):
        for j in range(i + 1, 4):
            a, b = jobs[i], jobs[j]
            if a["t0"] < b["t1"] and b["t0"] < a["t1"]:
                overlapping += 1
                assert not set(a["cvd"].split(",")) & set(b["cvd"].split(",")), (a, b)
    assert overlapping >= 1  # two jobs did run at once: 4 GPUs, 2 each
    # and no more than two at once: the third and fourth waited for free GPUs
    starts = sorted(j["t0"] for j in jobs)
    ends = sorted(j["t1"] for j in jobs)
    assert starts[2] >= ends[0] - 0.05


def test_killed_job_frees_its_gpus_and_children_keep_them(tmp_path):
    env = _env(tmp_path / "locks", DFLASH_GPU_POOL="5")
    holder = _with_gpus(["--n", "1", "--", "sleep", "60"], env, start_new_session=True)
    time.sleep(1.0)
    busy = _with_gpus(["--n", "1", "--timeout", "0.5", "--", "true"], env, stderr=subprocess.PIPE, text=True)
    _, err = busy.communicate(timeout=30)
    assert busy.returncode == 2 and "no 1 free GPU" in err
    holder.send_signal(signal.SIGKILL)  # a crashed job: no cleanup code runs
    holder.wait(timeout=10)
    proc = run_cli("with-gpus", "--n", "1", "--timeout", "5", "--", "sh", "-c", "echo $CUDA_VISIBLE_DEVICES", env=env)
    assert proc.stdout.strip() == "5"
    # a background child of the command keeps the GPU: the lock lives as long as any process holding it
    run_cli("with-gpus", "--n", "1", "--", "sh", "-c", "sleep 3 >/dev/null 2>&1 &", env=env)
    blocked = run_cli("with-gpus", "--n", "1", "--timeout", "0.5", "--", "true", env=env, check=False)
    assert blocked.returncode == 2


def test_zero_gpus_slurm_and_errors(tmp_path):
    env = _env(tmp_path / "locks", DFLASH_GPU_POOL="0,1")
    show = ["sh", "-c", 'echo "[${CUDA_VISIBLE_DEVICES-unset}]"']
    assert run_cli("with-gpus", "--n", "0", "--", *show, env=env).stdout.strip() == "[]"
    # inside a SLURM job the scheduler chose the devices: left as they are
    slurm_env = dict(env, SLURM_JOB_ID="42", CUDA_VISIBLE_DEVICES="3")
    assert run_cli("with-gpus", "--n", "1", "--", *show, env=slurm_env).stdout.strip() == "[3]"
    too_many = run_cli("with-gpus", "--n", "3", "--", "true", env=env, check=False)
    assert too_many.returncode == 2 and "pool has 2" in too_many.stderr
    # no GPU anywhere: an error, unless the rule allows its CPU fallback
    bare = _env(tmp_path / "locks", CUDA_VISIBLE_DEVICES="", PATH="/usr/bin:/bin")
    assert run_cli("with-gpus", "--n", "1", "--timeout", "0", "--", "true", env=bare, check=False).returncode == 2
    assert run_cli("with-gpus", "--n", "1", "--cpu-fallback", "--", *show, env=bare).stdout.strip() == "[]"


def test_snakemake_local_gpu_jobs_never_share_a_device(tmp_path):
    """Four GPU jobs under `--resources gpu=2`: Snakemake counts, with-gpus assigns."""
    (tmp_path / "record.py").write_text(RECORD)
    (tmp_path / "Snakefile").write_text(textwrap.dedent(f"""
        rule all:
            input: expand("out/{{i}}.json", i=range(4))

        rule gpu_job:
            output: "out/{{i}}.json"
            resources: gpu=1
            shell: "{BIN}/dflash-pipeline with-gpus --n {{resources.gpu}} -- {BIN}/python record.py {{output}} 1.0"
    """))
    env = _env(tmp_path / "locks", DFLASH_GPU_POOL="0,1")
    proc = subprocess.run(
        [str(BIN / "snakemake"), "all", "--cores", "4", "--resources", "gpu=2"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stderr
    jobs = [json.loads((tmp_path / f"out/{i}.json").read_text()) for i in range(4)]
    assert {j["cvd"] for j in jobs} == {"0", "1"}
    for i in range(4):
        for j in range(i + 1, 4):
            a, b = jobs[i], jobs[j]
            if a["t0"] < b["t1"] and b["t0"] < a["t1"]:
                assert a["cvd"] != b["cvd"]


def test_planted_symlink_lock_file_is_refused_and_its_target_untouched(tmp_path):
    lock_dir = tmp_path / "locks"
    lock_dir.mkdir(mode=0o700)
    victim = tmp_path / "precious.txt"
    victim.write_text("do not truncate me\n")
    (lock_dir / "gpu-0.lock").symlink_to(victim)
    proc = run_cli("with-gpus", "--n", "1", "--pool", "0", "--lock-dir", lock_dir, "--", "true", check=False,
                   env=_env(lock_dir))
    assert proc.returncode == 2 and "symbolic link" in proc.stderr and "gpu-0.lock" in proc.stderr
    assert victim.read_text() == "do not truncate me\n"


def test_lock_dir_is_private_and_owned(tmp_path):
    fresh = tmp_path / "new-locks"
    run_cli("with-gpus", "--n", "1", "--pool", "0", "--lock-dir", fresh, "--", "true", env=_env(fresh))
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o700
    assert stat.S_IMODE((fresh / "gpu-0.lock").stat().st_mode) == 0o600
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    proc = run_cli("with-gpus", "--n", "1", "--pool", "0", "--lock-dir", shared, "--", "true", check=False,
                   env=_env(shared))
    assert proc.returncode == 2 and "writable by others" in proc.stderr
    # a dir planted by another user (as root: one chowned away; otherwise /tmp, which root owns)
    if os.getuid() == 0:
        foreign = tmp_path / "foreign"
        foreign.mkdir(mode=0o700)
        os.chown(foreign, 4321, 4321)
    else:
        foreign = Path("/tmp")
    proc = run_cli("with-gpus", "--n", "1", "--pool", "0", "--lock-dir", foreign, "--", "true", check=False,
                   env=_env(foreign))
    assert proc.returncode == 2 and "belongs to uid" in proc.stderr
