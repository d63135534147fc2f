"""The scale benchmark (benchmarks/recipe_at_scale.py) continues across GPU calls that end and start cold.

One uninterrupted run against one cut in three calls, with the tiny target on CPU: call 1 generates one shard and
packs the bundle; the work directory is wiped (a cold machine); call 2 unpacks it, generates the other shards,
trains until it is stopped at a checkpoint save (the call's end), packs; wiped again; call 3 unpacks and finishes.
The regenerated ids and token shards must equal the uninterrupted run's byte for byte, no shard may be generated
twice, training must resume at the bundled step and, with the optimizer in the bundle, end bit-identical; with the
weights-only bundle (bf16, no optimizer moments: what fits at the real scale) it resumes at the same step.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import random
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import recipe_at_scale as ras  # noqa: E402

STOP_AT = 8  # the checkpoint save at which call 2 ends (step 6's checkpoint is the last one written)


@pytest.fixture(autouse=True)
def shm_dir(tmp_path, monkeypatch):
    """The peers' shm folder is a tmp folder: nothing here writes to the machine's /dev/shm."""
    monkeypatch.setenv("RAS_PEER_SHM_DIR", str(tmp_path / "shm"))


class CallEnded(Exception):
    """The GPU call's time is up (raised instead of writing a checkpoint)."""


@contextlib.contextmanager
def call_ends_at_save(step: int):
    """Training stops when it reaches the checkpoint save of `step`, before writing it."""
    from dflash_pipeline.drafter.checkpoints import CheckpointStore

    save = CheckpointStore.save

    def save_or_stop(self, done, *args, **kwargs):
        if done >= step:
            raise CallEnded(done)
        return save(self, done, *args, **kwargs)

    CheckpointStore.save = save_or_stop
    try:
        yield
    finally:
        CheckpointStore.save = save


def write_kit(kit: Path) -> None:
    """ShareGPT-style conversations of 1-4 user turns (cut to 3 by the kit's rule) and two MT-Bench questions."""
    rnd = random.Random(0)
    words = "the cat sat on a mat and then we add two numbers to get the sum of three apples".split()
    recs = []
    for i in range(20):
        conv = []
        for _ in range(rnd.randint(1, 4)):
            conv += [{"from": "human", "value": " ".join(rnd.choices(words, k=rnd.randint(3, 12))) + "?"},
                     {"from": "gpt", "value": "an original answer"}]
        recs.append({"id": f"c{i}", "conversations": conv})
    (kit / "data").mkdir(parents=True)
    with gzip.open(kit / "data" / "sharegpt_turns.jsonl.gz", "wt") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in ras.turn_records(recs, 3, 400))
    (kit / "data" / "mt_bench_question.jsonl").write_text("".join(
        json.dumps({"question_id": q, "category": c, "turns": [t]}) + "\n"
        for q, c, t in [(81, "writing", "write a story about a cat"), (82, "math", "add two numbers")]))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_target):
    root = tmp_path_factory.mktemp("scale")
    write_kit(root / "kit")

    def call(work: str, out: str, *stages: str, extra: tuple = ()):
        ras.main([*stages, "--tiny", "--device", "cpu", "--work", str(root / work), "--out", str(root / out),
                  "--kit", str(root / "kit"), "--target-dir", str(tiny_target), *extra])

    def cold(work: str) -> None:
        shutil.rmtree(root / work)

    # uninterrupted; its token shards built in one process, the other machines' in one process a shard
    call("a", "a-out", "target", "prep", "generate", "tokens", "train", extra=("--token-workers", "1"))
    # call 1: one shard of three, then the bundle
    call("b", "b1", "target", "prep", "generate", "pack", extra=("--max-shards", "1"))
    cold("b")
    # call 2: the rest of generation, training stopped at a checkpoint save; bundles with and without the optimizer
    call("b", "b2-in", "gather", extra=("--in", str(root / "b1")))
    after_gather = sorted(p.name for p in (root / "b").rglob("*") if p.is_file())
    with call_ends_at_save(STOP_AT), pytest.raises(CallEnded):
        call("b", "b2-in", "target", "prep", "generate", "tokens", "train")
    completions_call2 = sorted(p.name for p in (root / "b" / "completions").glob("*.parquet"))
    call("b", "b2", "pack")
    call("b", "b2w", "pack", extra=("--bundle-optimizer", "never"))
    cold("b")
    # call 3: resume from the full bundle; and on another machine from the weights-only one
    call("b", "b3", "gather", "target", "prep", "generate", "tokens", "train", extra=("--in", str(root / "b2")))
    call("c", "c3", "gather", "target", "prep", "tokens", extra=("--in", str(root / "b2w")))
    import torch

    restored = {p.name: torch.load(p, map_location="cpu", weights_only=True)
                for p in (ras.Work(root / "c").train / "paper" / "ckpt").glob("step-*.pt")}
    call("c", "c3", "train")
    return {"root": root, "after_gather": after_gather, "completions_call2": completions_call2, "restored": restored}


def test_generation_resumes_at_the_next_shard_with_identical_ids(runs):
    root = runs["root"]
    a, b = ras.Work(root / "a"), ras.Work(root / "b")
    shards = ras.shard_names(a)
    assert len(shards) == 3
    # the bundle of call 1 held the first shard's regen file only; call 2 generated the other two, call 3 none
    assert [n for n in runs["after_gather"] if n.endswith(".npz.zst")] == [f"{shards[0]}.npz.zst"]
    assert runs["completions_call2"] == [f"{s}.parquet" for s in shards[1:]]
    assert not (b.completions).exists()
    for s in shards:
        assert (a.regen / f"{s}.npz.zst").read_bytes() == (b.regen / f"{s}.npz.zst").read_bytes()
        assert (a.tokens / f"{s}.parquet").read_bytes() == (b.tokens / f"{s}.parquet").read_bytes()
        meta, samples = ras.read_regen(b.regen / f"{s}.npz.zst")
        assert meta["rebuild_mismatches"] == 0 and samples  # answers and last prompts rebuilt from the ids
    # every generated turn is one training sample (multi-turn conversations give several)
    n_turns = sum(len(x) for s in shards for x in ras.read_regen(a.regen / f"{s}.npz.zst")[1])
    assert b.progress()["tokens"]["samples"] == n_turns > 20


def test_a_committed_state_starts_a_cold_machine_and_yields_to_a_carried_bundle(runs, tmp_path, capsys):
    """`gather --state` (the bundle committed with the repository): a cold machine unpacks it, with call 1's
    regen file; a machine that is also carried a newer bundle takes that one; a machine already past it is left
    as it is."""
    root = runs["root"]
    kit = ["--kit", str(tmp_path / "no-kit")]
    shard0 = ras.shard_names(ras.Work(root / "a"))[0]
    ras.main(["gather", "--work", str(tmp_path / "cold"), "--state", str(root / "b1"), *kit])
    cold = ras.Work(tmp_path / "cold")
    assert cold.progress()["bundle_seq"] == 1
    assert [p.name for p in cold.regen.iterdir()] == [f"{shard0}.npz.zst"]
    assert (cold.regen / f"{shard0}.npz.zst").read_bytes() == (root / "a" / "regen" / f"{shard0}.npz.zst").read_bytes()
    ras.main(["gather", "--work", str(tmp_path / "both"), "--in", str(root / "b2"), "--state", str(root / "b1"), *kit])
    assert "committed state 1: bundle 2 is carried; not unpacked" in capsys.readouterr().out
    assert ras.Work(tmp_path / "both").progress()["bundle_seq"] == 2
    (cold.regen / f"{shard0}.npz.zst").unlink()  # a warm machine's later call: its state is not unpacked again
    ras.main(["gather", "--work", str(tmp_path / "cold"), "--state", str(root / "b1"), *kit])
    assert not any(cold.regen.iterdir())
    with pytest.raises(SystemExit, match="no bundle.tar.zst.set.json"):
        ras.main(["gather", "--work", str(tmp_path / "x"), "--state", str(tmp_path), *kit])
    # the device script's CPU dry run (--tiny) leaves the committed state, the real kit's, alone
    ras.main(["gather", "--tiny", "--work", str(tmp_path / "tiny"), "--state", str(root / "b1"), *kit])
    assert not ras.Work(tmp_path / "tiny").regen.exists()


def test_regenerated_ids_of_another_kits_shards_are_refused_by_name(runs, tmp_path):
    """A regen file that does not belong to the shard of its name (a state committed or carried from another kit)
    stops the token rebuild with the file and the sample, instead of pairing its ids with other conversations."""
    a = ras.Work(runs["root"] / "a")
    s0, s1 = ras.shard_names(a)[:2]
    w = ras.Work(tmp_path / "w")
    shutil.copytree(a.shards, w.shards)
    (w.root / "target").symlink_to(a.target)
    w.regen.mkdir()
    shutil.copyfile(a.regen / f"{s0}.npz.zst", w.regen / f"{s1}.npz.zst")
    with pytest.raises(SystemExit, match=rf"{s1}\.npz\.zst: sample \S+ is not in .*{s1}\.parquet"):
        ras.main(["tokens", "--tiny", "--device", "cpu", "--work", str(w.root), "--kit", str(tmp_path / "kit")])
    assert not w.tokens.exists() or not any(w.tokens.glob("*.parquet"))


def test_training_resumes_at_the_bundled_step_and_ends_identical(runs):
    import torch
    from safetensors.torch import load_file

    root = runs["root"]
    a, b = ras.Work(root / "a"), ras.Work(root / "b")
    sa, sb = (json.loads((w.train / "paper" / "drafter" / "summary.json").read_text()) for w in (a, b))
    assert sa["resumed_from_step"] == 0 and sb["resumed_from_step"] == STOP_AT - 2
    assert sb["steps"] == sa["steps"] == 20
    steps = [json.loads(x)["step"] for x in (b.train / "paper" / "drafter" / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 21))  # no step twice, none missing
    wa, wb = (load_file(str(w.train / "paper" / "drafter" / "drafter.safetensors")) for w in (a, b))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    man = json.loads((root / "b2" / "bundle.tar.zst.set.json").read_text())
    assert man["runs"]["paper"]["kind"] == "full" and man["seq"] == 2


def test_weights_only_bundle_resumes_at_the_same_step(runs):
    import torch

    root = runs["root"]
    c = ras.Work(root / "c")
    man = json.loads((root / "b2w" / "bundle.tar.zst.set.json").read_text())
    assert man["runs"]["paper"]["kind"].startswith("weights-bf16")
    ((name, state),) = runs["restored"].items()
    assert name == f"step-{STOP_AT - 2:08d}.pt" and state["step"] == STOP_AT - 2
    assert state["optimizer"]["state"] == {}  # moments dropped, param groups (lr, betas) kept
    w = next(v for v in state["model"].values() if v.is_floating_point())
    assert w.dtype == torch.float32 and torch.equal(w, w.to(torch.bfloat16).float())
    summary = json.loads((c.train / "paper" / "drafter" / "summary.json").read_text())
    assert summary["resumed_from_step"] == STOP_AT - 2 and summary["steps"] == 20


def test_sharegpt_records_are_salvaged_from_a_cut_array(tmp_path):
    """The packaged ShareGPT file is a JSON array cut mid-record: every whole record before the cut is read, the
    cut one is not; first_turn_records keeps the first exchange of those that open with a short human turn."""
    from real_target_side_by_side import first_turn_records

    def conv(*turns):
        return [{"from": who, "value": text} for who, text in turns]

    recs = [{"id": "a", "conversations": conv(("human", "hi?"), ("gpt", "hello"), ("human", "more"))},
            {"id": "b", "conversations": conv(("gpt", "an answer first"), ("human", "then"))},
            {"id": "c", "conversations": conv(("human", "a long question " * 4), ("gpt", "ok"))},
            {"id": "d", "conversations": conv(("human", "why?"), ("gpt", "because"))}]
    text = "[\n" + ",\n".join(json.dumps(r) for r in recs)
    path = tmp_path / "sg.json"
    path.write_text(text[: text.rindex('"because"')])  # cut inside the last record
    assert [r["id"] for r in ras.read_sharegpt(path)] == ["a", "b", "c"]
    assert [r["id"] for r in ras.read_sharegpt(path, 2)] == ["a", "b"]
    path.write_text(text + "\n]")
    assert [r["id"] for r in first_turn_records(str(path), 10, max_chars=20)] == ["a", "d"]
    assert first_turn_records(str(path), 1)[0]["conversations"] == recs[0]["conversations"][:2]


def test_peer_subset_is_the_largest_prefix_that_fits():
    per = ras.peer_bytes_per_token(576, 5)
    assert per == {"specforge": 5760, "speculators": 6912}
    assert ras.peer_subset([100, 100, 100], 10, room_bytes=3000) == 3
    assert ras.peer_subset([100, 100, 100], 10, room_bytes=2999) == 2
    assert ras.peer_subset([100, 100, 100], 10, room_bytes=999) == 0


def test_one_peers_files_at_a_time_from_ours_samples(runs, tiny_target):
    """SpecForge's files for the peer subset, from the samples our `paper@sub` run trained on; the other peer's
    data is refused while they are on disk, and peer-clean removes them."""
    import torch

    root = runs["root"]
    a = ras.Work(root / "a")

    def call(*stages, extra=()):
        ras.main([*stages, "--tiny", "--device", "cpu", "--work", str(a.root), "--out", str(root / "a-out"),
                  "--kit", str(root / "kit"), "--target-dir", str(tiny_target), *extra])

    call("peer-plan", "train", extra=("--runs", "paper@sub"))
    plan = json.loads((a.results / "peer-plan.json").read_text())
    assert plan["shards"] == [f"{s}.parquet" for s in ras.shard_names(a)[:2]] and plan["equal_to_sub"]
    call("peer-data", extra=("--peer", "specforge"))
    files = sorted((a.peers / "peer_sf").glob("sample_*.ckpt"))
    man = json.loads((a.results / "peer-data-specforge.json").read_text())
    summary = json.loads((a.train / "paper@sub" / "drafter" / "summary.json").read_text())
    assert len(files) == man["samples"] == summary["samples"]  # the samples ours trained on
    x = torch.load(files[0], weights_only=True)
    n_ids = len(man["recipe"]["target_layer_ids"])
    hidden = json.loads((tiny_target / "config.json").read_text())["hidden_size"]
    assert x["hidden_states"].shape == (len(x["input_ids"]), n_ids * hidden)
    assert x["hidden_states"].dtype == torch.bfloat16
    # SpecForge at our batch (its knob: ours) or at its default 1, under two names; max_steps (also its cosine
    # horizon) is the optimizer steps the data gives. No GPU here: its trainer stops after the config is written.
    import yaml

    def sf_args(batch):
        return ras.parse_args(["peer-train", "--peer", "specforge", "--specforge-batch", str(batch)])

    assert [ras.peer_run_name(sf_args(b), a) for b in (0, ras.SCALE["batch_size"], 1)] == \
        ["specforge", "specforge", "specforge-b1"]
    epochs = ras.run_spec("paper@sub")[0]["epochs"]
    for batch, steps in ((1, man["samples"]), (0, man["samples"] // ras.SCALE["batch_size"])):
        with pytest.raises(SystemExit, match="specforge.cli train"):
            call("peer-train", extra=("--peer", "specforge", "--specforge-batch", str(batch)))
        training = yaml.safe_load((a.peers / "sf.yaml").read_text())["training"]
        assert training["batch_size"] == (batch or ras.SCALE["batch_size"])
        assert training["max_steps"] == int(epochs * steps)
    with pytest.raises(SystemExit, match="peer-clean"):
        call("peer-data", extra=("--peer", "speculators"))
    call("peer-clean", extra=("--peer", "specforge"))
    assert not (a.peers / "peer_sf").exists()
    # a cold machine, or a run never trained (--peer-all compares with `paper` on all the data, which the
    # device never ran: 2026-12-07 it stopped the peers there): no run files, no state; the same shape, rebuilt
    cold = ras.Work(root / "cold")
    shutil.copytree(a.root, cold.root, symlinks=True)
    for d in (cold.train / "paper@sub", cold.drafters / "paper@sub", cold.peers):
        shutil.rmtree(d)
    progress = cold.progress()
    del progress["runs"]["paper@sub"]
    cold.progress_path.write_text(json.dumps(progress))
    p = ras.peer_layout(cold, "cpu", "decay")
    for got, want in ((p / "wf/results/train/drafter/drafter_config.json",
                       a.train / "paper@sub/drafter/drafter_config.json"),
                      (p / "wf/results/drafter/config.json", a.drafters / "paper@sub/config.json")):
        assert json.loads(got.read_text()) == json.loads(want.read_text())
    assert not (cold.drafters / "paper@sub").exists()  # evaluate must not take the rebuilt shape for a drafter
    # --peer-shards caps the subset below the @sub share: ours is then trained again on exactly those shards
    b = ras.Work(root / "capped")
    shutil.copytree(a.root, b.root, symlinks=True)
    (b.results / "peer-plan.json").unlink()
    ras.main(["peer-plan", "--tiny", "--device", "cpu", "--work", str(b.root), "--out", str(root / "capped-out"),
              "--kit", str(root / "kit"), "--target-dir", str(tiny_target), "--peer-shards", "1"])
    capped = json.loads((b.results / "peer-plan.json").read_text())
    assert capped["shards"] == plan["shards"][:1] and not capped["equal_to_sub"]
    assert ras.ours_for_peers(capped) == "paper@peer" and ras.ours_for_peers(plan) == "paper@sub"


def test_runs_side_by_side_equal_runs_one_after_another(runs, tiny_target):
    """--parallel 2: two runs trained at once, each in its own process, end with the weights they get one after
    the other; both are recorded as exported (progress.json written by both processes under a lock) and their
    results say that they shared the device."""
    import torch
    from safetensors.torch import load_file

    root = runs["root"]
    pair = "batch-4@sub,no-weighting@sub"
    works = {}
    for name, extra in (("seq", ()), ("par", ("--parallel", "2"))):
        w = works[name] = ras.Work(root / f"side-{name}")
        shutil.copytree(root / "a", w.root, symlinks=True)
        ras.main(["train", "--tiny", "--device", "cpu", "--work", str(w.root), "--out", str(root / f"side-{name}-out"),
                  "--kit", str(root / "kit"), "--target-dir", str(tiny_target), "--runs", pair, *extra])
    for run in pair.split(","):
        ws, wp = (load_file(str(works[k].train / run / "drafter" / "drafter.safetensors")) for k in ("seq", "par"))
        assert ws.keys() == wp.keys() and all(torch.equal(ws[k], wp[k]) for k in ws), run
        assert works["par"].progress()["runs"][run]["exported"] is True
        assert json.loads((works["par"].results / f"train-{run}.json").read_text())["side_by_side"] == 2
        assert "side_by_side" not in json.loads((works["seq"].results / f"train-{run}.json").read_text())
        assert (works["par"].root / "logs" / f"train-{run}.log").stat().st_size > 0


def test_carry_plans_calls_within_the_limit(tmp_path, monkeypatch):
    """`carry --cold --peers`: call 1 takes the kit's data and wheels and what else fits, the GGUF parts and the
    bundle go in order into the next calls, the peers' wheels into the first call with room; every call stays
    under the limit and each payload file lands in its call's folder."""
    mib = 2**20
    monkeypatch.setattr(ras, "CARRY_LIMIT", 10 * mib)
    monkeypatch.setattr(ras, "tree_bytes", lambda repo: 0)  # + carry's 1 MiB of slack
    kit = tmp_path / "scale" / "kit"
    for rel, size in {"data/turns.gz": 1, "whl/a.whl": 1, "gguf/m.gguf.part00": 6, "gguf/m.gguf.part01": 6,
                      "whl-peers/p.whl": 3}.items():
        (kit / rel).parent.mkdir(parents=True, exist_ok=True)
        (kit / rel).write_bytes(b"\0" * (size * mib))
    (kit / "gguf" / "m.gguf.set.json").write_text("{}")
    back = tmp_path / "back"
    back.mkdir()
    (back / "bundle.tar.zst.part00").write_bytes(b"\0" * mib)
    (back / "bundle.tar.zst.set.json").write_text("{}")
    plan = ras.stage_carry(ras.parse_args(["carry", "--kit", str(kit), "--cold", "--peers", "--in", str(back)]))
    assert plan == [[".device/scale/kit/data", ".device/scale/kit/whl", "m.gguf.set.json", "m.gguf.part00"],
                    ["m.gguf.part01", "bundle.tar.zst.set.json", "bundle.tar.zst.part00"],
                    [".device/scale/kit/whl-peers"]]
    assert sorted(p.name for p in (tmp_path / "scale" / "in-2").iterdir()) == sorted(plan[1])
    assert not any((tmp_path / "scale" / "in-3").iterdir())
    monkeypatch.setattr(ras, "CARRY_LIMIT", 6 * mib)  # a part larger than a call can carry: refused
    with pytest.raises(SystemExit, match="does not fit one call"):
        ras.stage_carry(ras.parse_args(["carry", "--kit", str(kit), "--cold"]))


def test_a_call_with_part_of_a_bundle_starts_nothing_over(tmp_path, capsys):
    """A bundle too large for one call arrives over two: the call that brings its manifest and first part (a warm
    machine's state still the old one) skips every stage that reads or extends the run's state instead of
    generating or training from the start; the call that brings the rest joins and unpacks it, and they run."""
    import hashlib

    blob = bytes(range(256)) * 40
    parts = [blob[:6000], blob[6000:]]
    man = {"set": "bundle.tar.zst", "seq": 7, "size": len(blob), "sha256": hashlib.sha256(blob).hexdigest(),
           "parts": [{"name": f"bundle.tar.zst.part{i:02d}", "size": len(b), "sha256": hashlib.sha256(b).hexdigest()}
                     for i, b in enumerate(parts)]}
    first, rest = tmp_path / "in-2", tmp_path / "in-3"
    for d, names in ((first, [0]), (rest, [1])):
        d.mkdir()
        for i in names:
            (d / man["parts"][i]["name"]).write_bytes(parts[i])
    (first / "bundle.tar.zst.set.json").write_text(json.dumps(man))
    work = tmp_path / "work"
    args = ["--tiny", "--device", "cpu", "--work", str(work), "--kit", str(tmp_path / "kit")]
    ras.main(["gather", "--in", str(first), *args])
    w = ras.Work(work)
    assert ras.bundle_pending(w) == "bundle 7 is not unpacked yet (1 of 2 parts here)"
    capsys.readouterr()
    ras.main(["generate", "tokens", "train", "peer-train", *args])  # would fail on this empty machine if they ran
    out = capsys.readouterr().out
    assert all(f"stage {s}: skipped: bundle 7 is not unpacked yet" in out for s in ("generate", "train", "peer-train"))
    assert not w.completions.exists() and not w.train.exists()
    for f in rest.iterdir():  # the next call's gather: the set is whole and joined (unpacking is the tests' above)
        shutil.copyfile(f, w.incoming / f.name)
    assert ras.join_sets(w.incoming, w.root) == ["bundle.tar.zst"] and (w.root / "bundle.tar.zst").read_bytes() == blob
    assert ras.bundle_pending(w) == ""


def test_run_names_combine_variants_left_to_right():
    s, data = ras.run_spec("batch-4+epochs-3@sub")
    assert (s["batch_size"], s["epochs"], s["lr"], data) == (4, 3.0, ras.SCALE["lr"], "sub")
    assert ras.run_spec("paper")[0]["batch_size"] == ras.SCALE["batch_size"] and ras.run_spec("paper")[1] == "all"
    assert ras.run_spec("lr-1.2e-3+lr-2.4e-3@peer")[0]["lr"] == 2.4e-3
    # the layout is part of a run's settings: padded as the first runs trained, `packed` the layout's own variant
    assert ras.run_spec("paper@sub")[0]["layout"] == "padded" and ras.run_spec("packed@sub")[0]["layout"] == "packed"
    # SpecForge's AdamW beta2 reaches the train command; every other run passes the package default, 0.95
    for run, beta2 in (("batch-4+adam-beta2-0.999@sub", 0.999), ("paper", 0.95)):
        cmd = [str(x) for x in ras.train_command(ras.Work("/w"), ras.run_spec(run)[0], [], Path("/d"), "cpu")]
        assert cmd[cmd.index("--adam-beta2") + 1] == str(beta2)
    cmd = ras.train_command(ras.Work("/w"), ras.run_spec("batch-4+init-last@sub")[0], [], Path("/d"), "cpu")
    assert cmd[cmd.index("--layer-init") + 1] == "target-last"
    # the noise run: the same recipe from another seed; every other run keeps seed 0 (and D-PACE's alpha 0.5, the
    # normalization by the weights' sum)
    for run, flag, value in (("batch-4+dpace-gamma4+seed-1@sub", "--seed", "1"),
                             ("batch-4+dpace-gamma4@sub", "--seed", "0"),
                             ("batch-4+dpace-gamma4+alpha-0.2@sub", "--dpace-alpha", "0.2"),
                             ("batch-4+dpace-gamma4@sub", "--dpace-alpha", "0.5"),
                             ("batch-4+dpace-alone+norm-samples@sub", "--loss-normalization", "samples"),
                             ("paper", "--loss-normalization", "weights")):
        cmd = [str(x) for x in ras.train_command(ras.Work("/w"), ras.run_spec(run)[0], [], Path("/d"), "cpu")]
        assert cmd[cmd.index(flag) + 1] == value
    for bad in ("batch-4+nope", "paper@half", "+paper"):
        with pytest.raises(SystemExit, match="unknown run"):
            ras.run_spec(bad)
