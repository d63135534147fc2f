"""The peers of the scale benchmark (benchmarks/recipe_at_scale.py) beyond the disk and across calls, on CPU.

The plan counts the disk's share and a share of memory-backed shm; peer-data writes to the disk until its share is
used, then into the shm folder (here a tmp folder: RAS_PEER_SHM_DIR) with links the peers' readers follow, resumes a
stopped call without half files, and peer-clean removes both parts. peer-train goes on from the peer's newest
checkpoint when its output belongs to the same run; the peers' trainers need a GPU, so their commands fail here
after the configuration that decides it is written.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import zipfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import real_target_side_by_side as sbs  # noqa: E402
import recipe_at_scale as ras  # noqa: E402
from test_recipe_at_scale_resume import write_kit  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# the device kit's (recipe_at_scale.py kit), else the ones `make setup` downloads
PEER_WHEELS = (REPO / ".device" / "scale" / "kit" / "whl-peers", REPO / ".venv" / "peer-wheels")


@pytest.fixture(autouse=True)
def shm_dir(tmp_path, monkeypatch) -> Path:
    """Every test's shm folder is its own tmp folder: nothing here writes to the machine's /dev/shm."""
    d = tmp_path / "shm"
    monkeypatch.setenv("RAS_PEER_SHM_DIR", str(d))
    return d


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_target):
    """A work directory with the token shards and our `paper@sub` run (the shape and recipe the peers copy)."""
    root = tmp_path_factory.mktemp("peers")
    write_kit(root / "kit")
    ras.main(["target", "prep", "generate", "tokens", "train", "--runs", "paper@sub", *opts(root, root / "w"),
              "--target-dir", str(tiny_target)])
    return root


def opts(root: Path, work: Path) -> list[str]:
    return ["--tiny", "--device", "cpu", "--work", str(work), "--out", str(root / "out"), "--kit", str(root / "kit")]


def work_copy(base: Path, tmp_path: Path, name: str = "w") -> tuple[ras.Work, callable]:
    w = ras.Work(tmp_path / name)
    shutil.copytree(base / "w", w.root, symlinks=True)

    def call(*stages: str, extra: tuple = ()) -> None:
        ras.main([*stages, *opts(base, w.root), *extra])

    return w, call


def token_counts(w: ras.Work) -> list[int]:
    import pyarrow.parquet as pq

    return [sum(pq.read_table(p, columns=["length"]).column("length").to_pylist()) for p in ras.run_inputs(w, False)]


def fake_free(monkeypatch, w: ras.Work, disk: int, shm: int = 10**12) -> None:
    """free_bytes as a machine with `disk` bytes free under the work directory and `shm` elsewhere."""
    monkeypatch.setattr(ras, "free_bytes", lambda p: disk if str(Path(p).absolute()).startswith(str(w.root)) else shm)


def wheel_modules(tmp_path: Path, request, name: str, *modules: str) -> list:
    """`modules` of the peer's wheel in the kit (unzipped here, not installed: its pinned dependencies are not
    wanted), or skip where the kit has none; gone from sys.modules and sys.path after the test."""
    import importlib

    wheels = sorted(w for d in PEER_WHEELS for w in d.glob(f"{name}-*.whl"))
    if not wheels:
        where = " or ".join(map(str, PEER_WHEELS))
        if os.environ.get("CI") == "true":  # `make setup` downloads them: in CI a missing wheel is a failure
            pytest.fail(f"no {name} wheel under {where}")
        pytest.skip(f"no {name} wheel under {where} (make setup or recipe_at_scale.py kit brings it)")
    dest = tmp_path / f"whl-{name}"
    zipfile.ZipFile(wheels[-1]).extractall(dest)

    def ours(m: str) -> bool:
        return m == name or m.startswith(name + ".")

    saved = {m: sys.modules.pop(m) for m in [m for m in sys.modules if ours(m)]}
    sys.path.insert(0, str(dest))

    def restore() -> None:
        sys.path.remove(str(dest))
        for m in [m for m in sys.modules if ours(m)]:
            del sys.modules[m]
        sys.modules.update(saved)

    request.addfinalizer(restore)
    return [importlib.import_module(m) for m in modules]


def test_room_is_the_disks_share_and_shm_beyond_the_ram_headroom():
    gb = 10**9
    # today's machine: 61 GB free on the disk, a 128 GiB shm, MemAvailable ~125 GiB
    room = ras.peer_room(61 * gb, 137 * gb, 134 * gb, None)
    assert room == {"disk_bytes": int(61 * gb * 0.85), "shm_bytes": 134 * gb - int(ras.PEER_RAM_HEADROOM)}
    assert ras.peer_room(61 * gb, 137 * gb, 134 * gb, 0) == {"disk_bytes": int(61 * gb * 0.85), "shm_bytes": 0}
    assert ras.peer_room(10 * gb, 30 * gb, 134 * gb, 50)["shm_bytes"] == 30 * gb  # never more than shm's free bytes
    assert ras.peer_room(10 * gb, 30 * gb, 134 * gb, 12.5)["shm_bytes"] == 12.5 * gb
    assert ras.peer_room(10 * gb, 100 * gb, 30 * gb, None)["shm_bytes"] == 0  # less RAM than the headroom
    split = ras.peer_split(100, {"disk_bytes": 60, "shm_bytes": 50})
    assert split == {"bytes": 100, "disk_bytes": 60, "shm_bytes": 40, "fits": True}
    assert not ras.peer_split(120, {"disk_bytes": 60, "shm_bytes": 50})["fits"]
    assert ras.peer_split(50, {"disk_bytes": 60, "shm_bytes": 0})["shm_bytes"] == 0
    # the real shards (tokens of the 16 token shards, stop 43) at speculators' 6,912 B a token: 5 on the disk alone
    counts = [1340831, 1296760, 1348803, 1348337, 1315554, 1325293, 1358760, 1249906, 1278986, 1286341, 1342182,
              1302343, 1261930, 1306136, 1296454, 418001]
    assert ras.peer_subset(counts, 6912, room["disk_bytes"]) == 5
    assert ras.peer_subset(counts, 6912, room["disk_bytes"] + room["shm_bytes"]) == 16
    less = ras.peer_room(61 * gb, 137 * gb, 120 * gb, None)  # 14 GB less RAM
    assert ras.peer_subset(counts, 6912, less["disk_bytes"] + less["shm_bytes"]) == 14


def test_plan_counts_the_shm_share_and_replaces_only_on_request(base, tmp_path, monkeypatch, shm_dir):
    import pyarrow.parquet as pq

    w, call = work_copy(base, tmp_path)
    counts = token_counts(w)
    assert len(counts) == 3 and len(ras.run_inputs(w, True)) == 2  # the @sub share: 2 of 3 shards
    hidden = json.loads((w.target / "config.json").read_text())["hidden_size"]
    per = ras.peer_bytes_per_token(hidden, ras.SCALE["num_layers"])["speculators"]
    disk = int(counts[0] * per / 0.85) + 1000  # the disk's share holds the first shard only
    fake_free(monkeypatch, w, disk)
    monkeypatch.setattr(ras, "mem_available", lambda: 10**12)
    call("peer-plan", extra=("--peer-shm-gb", "0"))
    plan = json.loads((w.results / "peer-plan.json").read_text())
    assert plan["shards"] == [f"{ras.shard_names(w)[0]}.parquet"] and plan["limited_by"] == "the room"
    assert plan["shm_bytes"] == 0 and plan["disk_bytes"] == int(disk * 0.85) and plan["request"] == "sub"
    (w.results / "peer-plan.json").unlink()
    # with shm: the @sub share caps it (the default), --peer-all takes all three
    call("peer-plan", extra=("--peer-shm-gb", "1"))
    plan = json.loads((w.results / "peer-plan.json").read_text())
    assert len(plan["shards"]) == 2 and plan["equal_to_sub"] and plan["limited_by"] == "the @sub share"
    assert plan["shm_bytes"] == 10**9 and plan["shm_dir"] == str(shm_dir)
    sp = plan["split"]["speculators"]
    assert sp["disk_bytes"] == plan["disk_bytes"] and sp["disk_bytes"] + sp["shm_bytes"] == plan["tokens"] * per
    rows = [pq.read_metadata(p).num_rows for p in ras.run_inputs(w, False)]
    assert plan["samples"] == sum(rows[:2]) and plan["of_samples"] == sum(rows)  # tiny: nothing held out
    call("peer-plan", extra=("--peer-shm-gb", "1"))  # written once: a call without a new request keeps it
    assert json.loads((w.results / "peer-plan.json").read_text()) == plan
    call("peer-plan", extra=("--peer-all", "--peer-shm-gb", "1"))
    every = json.loads((w.results / "peer-plan.json").read_text())
    assert len(every["shards"]) == 3 and every["equal_to_all"] and every["request"] == "all"
    assert json.loads((w.results / "peer-plan-sub.json").read_text()) == plan
    assert ras.ours_for_peers(every) == "paper"  # no second run of our run on all the data
    names = [ras.peer_run_name(ras.parse_args(["peer-train", "--peer", peer, "--specforge-batch", "1"]), w)
             for peer in ("speculators", "specforge")]
    assert names == ["speculators@all", "specforge-b1@all"]  # beside the @sub plan's `speculators`, `specforge-b1`
    assert every["samples"] == every["of_samples"] and every["limited_by"] == "nothing: all shards"
    call("peer-plan", extra=("--peer-shm-gb", "1"))  # no request: the plan stays the --peer-all one
    assert json.loads((w.results / "peer-plan.json").read_text())["request"] == "all"
    # a plan whose peer files are still there, or whose @peer runs were trained, is not replaced
    (w.peers / "peer_sf").mkdir(parents=True)
    with pytest.raises(SystemExit, match="peer-clean --peer specforge"):
        call("peer-plan", extra=("--peer-shards", "1"))
    (w.peers / "peer_sf").rmdir()
    w.update(runs={"speculators@peer": {"trained": True}})
    with pytest.raises(SystemExit, match="speculators@peer trained on the current plan"):
        call("peer-plan", extra=("--peer-shards", "1"))


def plan_with_spill(w: ras.Work, call, monkeypatch) -> dict:
    """The @sub plan on a disk whose share holds about half of SpecForge's files; the rest goes to shm."""
    hidden = json.loads((w.target / "config.json").read_text())["hidden_size"]
    sf = ras.peer_bytes_per_token(hidden, ras.SCALE["num_layers"])["specforge"]
    half = sum(token_counts(w)[:2]) * sf // 2
    with monkeypatch.context() as m:
        fake_free(m, w, int(half / 0.85))
        call("peer-plan", extra=("--peer-shm-gb", "1"))
    return json.loads((w.results / "peer-plan.json").read_text())


def test_peer_data_spills_into_shm_resumes_and_is_cleaned(base, tmp_path, monkeypatch, shm_dir, request):
    import torch

    w, call = work_copy(base, tmp_path)
    plan = plan_with_spill(w, call, monkeypatch)
    assert plan["split"]["specforge"]["shm_bytes"] > 0
    dest, shm = w.peers / "peer_sf", shm_dir / "specforge"
    # a call stopped mid-way: a .partial file left, no manifest
    stop_at, writes = 7, []
    write = ras.PeerFiles.write

    def stopping(self, rel, nbytes, save):
        if len(writes) == stop_at:
            def half_then_stop(path):
                save(path)
                raise KeyboardInterrupt
            return write(self, rel, nbytes, half_then_stop)
        writes.append(rel)
        return write(self, rel, nbytes, save)

    with monkeypatch.context() as m:
        m.setattr(ras.PeerFiles, "write", stopping)
        with pytest.raises(KeyboardInterrupt):
            call("peer-data", extra=("--peer", "specforge"))
    left = [p for d in (dest, shm) if d.exists() for p in d.rglob("*.partial")]
    assert len(left) == 1 and not (dest / "manifest.json").exists()
    assert len(list(dest.glob("sample_*.ckpt"))) == stop_at
    assert w.progress()["peers"]["specforge"]["data_samples_done"] == stop_at
    # the next call computes only the rest
    asked = []
    features = sbs.peer_features

    def spy(model_dir, device, samples, layer_ids, *args, **kw):
        asked.append(len(samples))
        return features(model_dir, device, samples, layer_ids, *args, **kw)

    monkeypatch.setattr(sbs, "peer_features", spy)
    call("peer-data", extra=("--peer", "specforge"))
    man = json.loads((w.results / "peer-data-specforge.json").read_text())
    n = man["samples"]
    assert asked == [n - stop_at] and man["calls"] == 2
    assert not [p for d in (dest, shm) for p in d.rglob("*.partial")]
    files = sorted(dest.glob("sample_*.ckpt"))
    links = [f for f in files if f.is_symlink()]
    assert len(files) == n and 0 < len(links) < n
    assert man["shm"]["samples"] == len(links) and man["disk"]["samples"] == n - len(links)
    assert all(Path(os.readlink(f)).parent == shm for f in links)
    assert sorted(p.name for p in shm.iterdir()) == sorted(f.name for f in links)
    assert man["disk"]["bytes"] <= plan["disk_bytes"] and man["shm"]["bytes"] > 0
    # the short samples first, on the disk; the long ones through links
    length = {f.name: len(torch.load(f, weights_only=True)["input_ids"]) for f in files}
    assert max(length[f.name] for f in files if not f.is_symlink()) <= min(length[f.name] for f in links)
    # SpecForge's own reader (its wheel, unzipped) lists every file, links included, and loads them
    reader, store = wheel_modules(tmp_path, request, "specforge", "specforge.runtime.data_plane.offline_reader",
                                  "specforge.runtime.data_plane.feature_store")
    listed = reader.list_feature_files(str(dest))
    assert [Path(p).name for p in listed] == [f.name for f in files]
    x = store.load_feature_file(str(links[0]))
    assert x["hidden_states"].shape[0] == len(x["input_ids"]) == length[links[0].name]
    # an emptied shm (its files gone): peer-train refuses, peer-data writes just those again
    shutil.rmtree(shm)
    with pytest.raises(SystemExit, match="peer-data --peer specforge first"):
        call("peer-train", extra=("--peer", "specforge"))
    asked.clear()
    call("peer-data", extra=("--peer", "specforge"))
    assert asked == [len(links)] and all(f.exists() for f in dest.glob("sample_*.ckpt"))
    assert json.loads((dest / "manifest.json").read_text())["calls"] == 3
    # peer-clean: both parts
    call("peer-clean", extra=("--peer", "specforge"))
    assert not dest.exists() and not shm.exists()


def test_speculators_reader_follows_the_links(tmp_path, request):
    """speculators' hidden-state files through PeerFiles into shm: hs_connectors' FileTransfer (what its ArrowDataset
    reads with --hidden-states-backend file) opens them by name through the links."""
    import torch
    from safetensors.torch import save_file

    (transfer,) = wheel_modules(tmp_path, request, "hs_connectors", "hs_connectors.transfer")
    dest, shm = tmp_path / "peer_spec", tmp_path / "shm" / "speculators"
    files = ras.PeerFiles(dest, shm, disk_cap=0, shm_cap=10**9)  # no disk share: all in shm
    tensors = {i: {"hidden_states": torch.randn(5 + i, 3, 8).to(torch.bfloat16), "token_ids": torch.arange(5 + i)}
               for i in range(3)}
    for i, t in tensors.items():
        files.write(ras.peer_file("speculators", i), 4096, lambda f: save_file(t, str(f)))
    assert all((dest / "hidden_states" / f"hs_{i}.safetensors").is_symlink() for i in tensors)
    ft = transfer.FileTransfer(dest / "hidden_states")
    for i, t in tensors.items():
        got = ft.get_cached(i)
        assert torch.equal(got["hidden_states"], t["hidden_states"]) and torch.equal(got["token_ids"], t["token_ids"])
    assert ft.get_cached(3) is None
    # tidy: a dangling link (its target gone) and an orphan shm file (no link) are dropped
    (shm / "hidden_states" / "hs_0.safetensors").unlink()
    (shm / "hidden_states" / "hs_9.safetensors").write_bytes(b"x")
    again = ras.PeerFiles(dest, shm, disk_cap=0, shm_cap=10**9)
    assert not (dest / "hidden_states" / "hs_0.safetensors").is_symlink()
    assert sorted(p.name for p in (shm / "hidden_states").iterdir()) == ["hs_1.safetensors", "hs_2.safetensors"]
    assert again.shm_used == sum(p.stat().st_size for p in (shm / "hidden_states").iterdir())
    with pytest.raises(SystemExit, match="no room"):
        ras.PeerFiles(dest, shm, disk_cap=0, shm_cap=0).write("x", 10, lambda f: None)


def test_peer_train_resumes_from_its_checkpoint_of_the_same_run(base, tmp_path, monkeypatch):
    import yaml

    w, call = work_copy(base, tmp_path)
    call("peer-plan", "peer-data", extra=("--peer", "specforge"))
    p, batch = w.peers, ras.SCALE["batch_size"]
    out = p / "sf_out"

    def train(b: int = batch, stop: str = "specforge.cli train", extra: tuple = ()) -> dict:
        with pytest.raises(SystemExit, match=stop):  # no GPU (nor SpecForge) here: its command fails
            call("peer-train", extra=("--peer", "specforge", "--specforge-batch", str(b), *extra))
        return yaml.safe_load((p / "sf.yaml").read_text())["training"]

    def checkpoint(step: int) -> Path:
        d = out / f"sbs-specforge-step{step}"
        d.mkdir(parents=True)
        for f in ("training_state.pt", "training_state_rank0.pt"):
            (d / f).write_bytes(b"state")
        return d

    every = ras.peer_checkpoint_steps("specforge", 60)
    assert every == round(60 * ras.PEER_STEPS_PER_S["specforge"])
    t = train()
    assert "resume_from" not in t and t["save_interval"] == every and t["max_checkpoints"] == 2
    owner = json.loads((p / "sf_out.owner.json").read_text())
    assert owner["run"] == "specforge" and owner["batch"] == batch
    # the call's SIGINT stopped it after two saves (one of them half written): the next call resumes the newest
    checkpoint(3)
    newest = checkpoint(7)
    (out / "sbs-specforge-step9").mkdir()
    (out / "sbs-specforge-step9" / "training_state_rank0.pt").write_bytes(b"half")
    assert sbs.specforge_resume_point(out) == {"step": 7, "dir": newest}
    (p / "sf_export").mkdir()
    (p / "sf_export" / "config.json").write_text("{}")  # a half converted drafter of the last call: made again
    t = train()
    assert t["resume_from"] == str(newest) and not (p / "sf_export").exists()
    calls = w.progress()["runs"]["specforge"]["peer_train"]["calls"]
    assert [c["from_step"] for c in calls] == [0, 7] and all("seconds" in c for c in calls)
    # --peer-fresh: over from the start
    t = train(extra=("--peer-fresh",))
    assert "resume_from" not in t and not out.exists()
    assert [c["from_step"] for c in w.progress()["runs"]["specforge"]["peer_train"]["calls"]] == [0]
    # another batch is another run: its output is not resumed but cleared
    t = train(1)
    assert "resume_from" not in t and not out.exists()
    assert json.loads((p / "sf_out.owner.json").read_text())["run"] == "specforge-b1"
    assert [c["from_step"] for c in w.progress()["runs"]["specforge-b1"]["peer_train"]["calls"]] == [0]
    # its checkpoint at the last step: exported without training
    steps = yaml.safe_load((p / "sf.yaml").read_text())["training"]["max_steps"]
    checkpoint(steps)
    commands, sh = [], sbs.sh

    def recording(cmd, *args, **kw):
        commands.append([str(c) for c in cmd])
        return sh(cmd, *args, **kw)

    monkeypatch.setattr(sbs, "sh", recording)
    t = train(1, stop="specforge.cli export")
    assert t["resume_from"].endswith(f"-step{steps}")
    assert [c[c.index("-m") + 2] for c in commands] == ["export"]  # no training
    assert commands[0][commands[0].index("--checkpoint") + 1] == str(out / f"sbs-specforge-step{steps}")
    assert json.loads((p / "logs" / "specforge_run.json").read_text())["resumed_from_step"] == steps


def test_speculators_resume_point_skips_a_checkpoint_left_mid_save(tmp_path):
    out = tmp_path / "spec_out"

    def save(epoch: int, state: dict | None, t0: int) -> Path:
        d = out / str(epoch)
        d.mkdir(parents=True, exist_ok=True)
        for k, name in enumerate(("model.safetensors", "optimizer_state_dict.pt", "scheduler_state_dict.pt")):
            (d / name).write_bytes(b"w")
            os.utime(d / name, ns=(t0 + k, t0 + k))
        if state is not None:
            (d / "training_state.json").write_text(json.dumps(state))
            os.utime(d / "training_state.json", ns=(t0 + 5, t0 + 5))
        return d

    assert sbs.speculators_resume_point(out) is None
    save(0, {"epoch": 0, "local_step": 0, "global_step": 900}, 10**18)  # epoch 0 ended
    d1 = save(1, {"epoch": 1, "local_step": 300, "global_step": 1200}, 2 * 10**18)  # mid-epoch 1
    (out / "interrupted").mkdir()  # its SIGINT save: no step, not resumed from
    (out / "epoch1_step300").symlink_to("1")
    point = sbs.speculators_resume_point(out)
    assert point == {"step": 1200, "epoch": 1, "local_step": 300, "finished": False, "dir": d1}
    assert not (out / "interrupted").exists()
    # the next save of epoch 1 was stopped after the weights: its state file is older than them
    os.utime(d1 / "model.safetensors", ns=(3 * 10**18, 3 * 10**18))
    point = sbs.speculators_resume_point(out)
    assert point["dir"] == out / "0" and point["finished"] and point["step"] == 900 and not d1.exists()


def test_speculators_checkpoint_interval_is_a_share_of_its_epoch(base, tmp_path, monkeypatch):
    """Its --checkpoint-freq: the steps of --peer-checkpoint-s over the epoch's packed rows (tokens / max_length)."""
    w, call = work_copy(base, tmp_path)
    call("peer-plan", extra=("--peer", "speculators"))
    p = ras.peer_layout(w, "cpu", "decay")
    (p / "peer_spec").mkdir()
    man = {"samples": 40_000, "tokens": 20_000_000}
    (p / "peer_spec" / "manifest.json").write_text(json.dumps(man))
    r = sbs.recipe(p)
    for every, resume in ((600, False), (0, True)):
        with pytest.raises(SystemExit, match="speculators.train"):
            sbs.stage_speculators(argparse.Namespace(work=str(p), out=str(p / "logs"), device="cpu",
                                                     checkpoint_steps=every, resume=resume))
        args = json.loads((p / "logs" / "speculators_args.json").read_text())
        if every:
            freq = float(args[args.index("--checkpoint-freq") + 1])
            assert freq == round(every / (man["tokens"] * 0.99 / r["max_length"]), 6) and 0 < freq < 1
        else:
            assert "--checkpoint-freq" not in args


def test_the_peers_loss_weighting_follows_peer_loss(base, tmp_path, request):
    """--peer-loss dpace: SpecForge's `dpace` loss type and speculators' dpace weighting (D-PACE alone, no gamma, at
    both peers' own smoothing 0.5, not the workflow's default 0.2), in runs of their own name; the default keeps the
    paper's decay at our gamma. SpecForge's own schema (its wheel, where the kit has it) accepts both training
    sections."""
    import yaml

    w, call = work_copy(base, tmp_path)
    call("peer-plan", "peer-data", extra=("--peer", "specforge"))
    sections = {}
    for loss, want in (("decay", {"loss_type": "dflash", "loss_decay_gamma": ras.TINY["gamma"]}),
                       ("dpace", {"loss_type": "dpace", "dpace_alpha": 0.5})):
        with pytest.raises(SystemExit, match="specforge.cli train"):  # no SpecForge here: its command fails
            call("peer-train", extra=("--peer", "specforge", "--peer-loss", loss))
        t = sections[loss] = yaml.safe_load((w.peers / "sf.yaml").read_text())["training"]
        assert {k: t.get(k) for k in want} == want
    assert "loss_decay_gamma" not in sections["dpace"]
    assert json.loads((w.peers / "sf_out.owner.json").read_text())["run"] == "specforge-dpace"
    r = dict(sbs.recipe(w.peers), loss_weighting="dpace")
    assert sbs.speculators_loss(r) == ["--per-position-loss-weight", "dpace", "--dpace-alpha", 0.5]
    assert sbs.speculators_loss(dict(r, loss_weighting="decay"))[:2] == ["--per-position-loss-weight",
                                                                         "fixed-exp-decay"]
    with pytest.raises(SystemExit, match="no per-position weighting"):
        sbs.speculators_loss(dict(r, loss_weighting="none"))
    (schema,) = wheel_modules(tmp_path, request, "specforge", "specforge.config.schema")
    for t in sections.values():
        checked = schema.TrainingConfig(**t)
        assert checked.loss_type == t["loss_type"]
