"""The train stage on CPU: exact resume after a hard kill, offline == online features, DDP over gloo."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import BIN
from dflash_pipeline.cli import main as cli_main
from token_fixtures import write_greedy_token_shard
from train_kill_helpers import killed_train_run, signalled_train_run


def run_in_process(*args) -> int:
    """The CLI in this process (no interpreter start and torch import per run)."""
    return cli_main([str(a) for a in args])


@pytest.fixture(scope="module")
def token_shards(tiny_target, tmp_path_factory) -> list[Path]:
    out = tmp_path_factory.mktemp("tokens")
    paths = []
    for s in range(2):
        p = out / f"greedy-{s:05d}.parquet"
        write_greedy_token_shard(str(tiny_target), str(p), 24, prompt_len=16, new_tokens=24, seed=s, prefix=f"g{s}")
        paths.append(p)
    return paths


def _train_args(tiny_target, inputs, out, ckpt, mode="online", **extra):
    args = ["train", "--mode", mode, "--inputs", *map(str, inputs), "--model", str(tiny_target), "--out", str(out),
            "--checkpoint-dir", str(ckpt), "--num-layers", "1", "--block-size", "8", "--num-anchors", "8",
            "--batch-size", "4", "--max-steps", "7", "--lr", "3e-3", "--checkpoint-every", "3", "--log-every", "2",
            "--holdout-fraction", "0.1", "--max-length", "64"]
    for k, v in extra.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    return args


def test_killed_and_resumed_run_ends_with_identical_weights(tiny_target, token_shards, tmp_path, capsys):
    ref = tmp_path / "ref"
    assert run_in_process(*_train_args(tiny_target, token_shards, ref / "out", ref / "ckpt")) == 0
    killed = tmp_path / "killed"
    args = _train_args(tiny_target, token_shards, killed / "out", killed / "ckpt")
    proc = killed_train_run(6, args)  # SIGKILL at the checkpoint save of step 6: nothing cleaned up
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert not (killed / "out").exists()
    assert sorted(p.name for p in (killed / "ckpt").glob("step-*.pt")) == ["step-00000003.pt"]
    logged = [json.loads(ln)["step"] for ln in (killed / "ckpt" / "metrics.jsonl").read_text().splitlines()]
    assert logged == [2, 4, 6]  # steps 4 and 6 were logged and then lost with the process
    assert run_in_process(*args) == 0
    a = load_file(str(ref / "out" / "drafter.safetensors"))
    b = load_file(str(killed / "out" / "drafter.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # the metrics log has each step once, as an uninterrupted run's
    steps = [json.loads(ln)["step"] for ln in (killed / "out" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [2, 4, 6, 7]
    rec = json.loads((killed / "out" / "metrics.jsonl").read_text().splitlines()[-1])
    assert rec["acc_per_position"][0] is None and len(rec["loss_per_position"]) == 8
    assert (killed / "out" / "per_position.png").stat().st_size > 1000
    summary = json.loads((killed / "out" / "summary.json").read_text())
    assert summary["resumed_from_step"] == 3 and summary["steps"] == 7
    # held-out acceptance (default every 50 steps and at the end): in the last record and the summary
    assert 1.0 <= rec["heldout_tau"] <= 8 and rec["heldout_blocks"] > 0 and rec["heldout_reach_per_position"][0] == 1
    assert summary["heldout_acceptance"]["last_tau"] == rec["heldout_tau"]
    # checkpoints of other settings (a config change reruns the rule) are set aside, never resumed from
    assert run_in_process(*_train_args(tiny_target, token_shards, killed / "out2", killed / "ckpt", lr="1e-3")) == 0
    assert json.loads((killed / "out2" / "summary.json").read_text())["resumed_from_step"] == 0
    assert len(list((killed / "ckpt").glob("stale-*/step-*.pt"))) == 2


@pytest.mark.parametrize("signame,inherit_ignored", [("TERM", False), ("INT", True)])
def test_a_stop_signal_ends_training_at_a_checkpoint_of_that_step(tiny_target, token_shards, tmp_path, signame,
                                                                   inherit_ignored):
    """SIGTERM (SLURM's time limit, a pod eviction) or SIGINT (inherited ignored, as in a background job of a
    non-interactive shell) during step 5 of 7: the step finishes, its checkpoint is written (not only step 3's),
    the job exits 128 + the signal without outputs, and the rerun resumes at step 5 and ends as an uninterrupted
    run."""
    ref = tmp_path / "ref"
    assert run_in_process(*_train_args(tiny_target, token_shards, ref / "out", ref / "ckpt")) == 0
    run = tmp_path / "stopped"
    args = _train_args(tiny_target, token_shards, run / "out", run / "ckpt")
    proc = signalled_train_run(5, signame, args, inherit_sigint_ignored=inherit_ignored)
    signum = {"TERM": 15, "INT": 2}[signame]
    assert proc.returncode == 128 + signum, proc.stderr[-2000:]
    assert f"stopped by SIG{signame} after step 5, its checkpoint written" in proc.stderr
    assert not (run / "out").exists()
    assert "step-00000005.pt" in [p.name for p in (run / "ckpt").glob("step-*.pt")]
    assert run_in_process(*args) == 0
    assert json.loads((run / "out" / "summary.json").read_text())["resumed_from_step"] == 5
    a, b = load_file(str(ref / "out" / "drafter.safetensors")), load_file(str(run / "out" / "drafter.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_signal_delivered_twice_is_one_request_and_a_later_second_one_aborts(monkeypatch):
    """SLURM signals every process of the step while torchrun forwards the same signal to its workers: a second
    delivery within DUPLICATE_S keeps the pending checkpoint; one after that aborts (Ctrl-C twice); on exit the
    previous handlers are back. The window is widened here so that a loaded machine's pause between the two
    deliveries cannot turn the first case into the second."""
    import signal as sig

    from dflash_pipeline.drafter import stop_signals
    from dflash_pipeline.drafter.stop_signals import StopSignals

    monkeypatch.setattr(stop_signals, "DUPLICATE_S", 3600.0)
    before = sig.getsignal(sig.SIGTERM)
    with StopSignals() as stop:
        os.kill(os.getpid(), sig.SIGTERM)
        os.kill(os.getpid(), sig.SIGTERM)  # the same request, twice
        assert stop.signum == sig.SIGTERM
        stop._first -= stop_signals.DUPLICATE_S  # noqa: SLF001 - as if the first came DUPLICATE_S ago
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), sig.SIGINT)
    assert sig.getsignal(sig.SIGTERM) is before


def test_offline_training_from_hidden_state_shards_matches_online(tiny_target, token_shards, tmp_path, capsys):
    """Features stored by the shard writer (fp32) give the same first-step loss as on-the-fly features."""
    import pyarrow.parquet as pq
    from transformers import AutoModelForCausalLM

    from dflash_pipeline.drafter.features import target_features
    from dflash_pipeline.hidden_states.writer import write_shard

    target = AutoModelForCausalLM.from_pretrained(tiny_target).eval()
    from dflash_pipeline.target_layers import default_target_layer_ids

    layer_ids = default_target_layer_ids(8, 1)  # what the train stage picks for a 1-layer drafter
    hidden_paths = []
    for p in token_shards:
        t = pq.read_table(p).to_pylist()
        samples = []
        for row in t:
            ids = torch.tensor([row["input_ids"]])
            f = target_features(target, ids, torch.tensor([ids.shape[1]]), layer_ids)[0]
            samples.append({"sample_id": row["sample_id"], "input_ids": row["input_ids"],
                            "loss_mask": row["loss_mask"], "hidden": f.view(f.shape[0], 1, -1)})
        out = tmp_path / (p.stem + ".dfhs")
        write_shard(out, samples, {"target_layer_ids": layer_ids, "hidden_size": 128, "num_layers": 8,
                                   "model_path": str(tiny_target)}, codec="raw", dtype="float32")
        hidden_paths.append(out)
    common = dict(max_steps=2, log_every=1)
    assert run_in_process(*_train_args(tiny_target, token_shards, tmp_path / "on", tmp_path / "on-ck", **common)) == 0
    assert run_in_process(*_train_args(tiny_target, hidden_paths, tmp_path / "off", tmp_path / "off-ck",
                                       mode="offline", **common)) == 0
    on = [json.loads(ln) for ln in (tmp_path / "on" / "metrics.jsonl").read_text().splitlines()]
    off = [json.loads(ln) for ln in (tmp_path / "off" / "metrics.jsonl").read_text().splitlines()]
    assert abs(on[0]["loss"] - off[0]["loss"]) < 1e-4 * abs(on[0]["loss"])
    assert on[0]["count_per_position"] == off[0]["count_per_position"]
    # the packed layout (the GPU's default offline: all samples of a batch in one row) trains the same, and the
    # log carries trained positions/s, model TFLOP/s and MFU against the peak given
    assert run_in_process(*_train_args(tiny_target, hidden_paths, tmp_path / "pk", tmp_path / "pk-ck", mode="offline",
                                       layout="packed", peak_tflops="0.001", **common)) == 0
    packed = [json.loads(ln) for ln in (tmp_path / "pk" / "metrics.jsonl").read_text().splitlines()]
    for a, b in zip(off, packed):
        assert abs(a["loss"] - b["loss"]) < 1e-5 * abs(a["loss"]) and a["count_per_position"] == b["count_per_position"]
    assert off[0]["mfu"] is None and packed[0]["mfu"] == pytest.approx(packed[0]["tflops"] / 1e-3)
    assert packed[0]["positions_per_s"] > packed[0]["tokens_per_s"] > 0
    # shards extracted at other layers are refused (wrong ids load fine and then accept nothing)
    rc = run_in_process(*_train_args(tiny_target, hidden_paths, tmp_path / "bad", tmp_path / "bad-ck", mode="offline",
                                     target_layer_ids="2", **common))
    assert rc == 2 and f"extracted at target layers {layer_ids}" in capsys.readouterr().err


def test_held_out_acceptance_logged_and_a_stalled_run_says_so(tiny_target, token_shards, tmp_path, caplog):
    """Acceptance every step: a record per step with the held-out tau; with a learning rate too small to move
    the weights the curve is flat, and the run warns and its summary says acceptance stopped improving."""
    import logging

    caplog.set_level(logging.WARNING, logger="dflash_pipeline.drafter.train")
    args = _train_args(tiny_target, token_shards, tmp_path / "out", tmp_path / "ck", max_steps=4, lr="1e-12",
                       log_every=4, acceptance_every=1, acceptance_patience=2, acceptance_samples=4)
    assert run_in_process(*args) == 0
    recs = [json.loads(ln) for ln in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3, 4] and all(r["heldout_tau"] >= 1.0 for r in recs)
    assert [r["heldout_stopped_improving"] for r in recs] == [False, False, True, True]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())["heldout_acceptance"]
    assert summary["stopped_improving"] and summary["best_step"] == 1 and summary["measurements"] == 4
    assert "held-out acceptance has not improved for 2 measurements" in caplog.text


def test_ddp_two_processes_gloo(tiny_target, token_shards, tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node", "2",
           "--no-python", str(BIN / "dflash-pipeline"),
           *_train_args(tiny_target, token_shards, tmp_path / "out", tmp_path / "ck", batch_size=2, max_steps=3)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "world 2" in proc.stderr and "global batch 4" in proc.stderr
    assert (tmp_path / "out" / "drafter.safetensors").exists()
    steps = [json.loads(ln)["step"] for ln in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [2, 3]  # logged once (rank 0), with counts summed over both ranks


def test_checkpoints_mirrored_to_s3_resume_on_a_new_machine(tiny_target, token_shards, tmp_path, monkeypatch):
    """A job killed on one node resumes on another from the S3 mirror and ends bit-identical."""
    import socket

    import boto3
    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    moto.start()
    try:
        env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "test",
               "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        s3 = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"])
        s3.create_bucket(Bucket="ckpt")
        mirror = ["--checkpoint-mirror", "s3://ckpt/run/train/checkpoints"]
        ref = tmp_path / "ref"
        assert run_in_process(*_train_args(tiny_target, token_shards, ref / "out", ref / "ckpt")) == 0
        first = _train_args(tiny_target, token_shards, tmp_path / "a" / "out", tmp_path / "a" / "ckpt")
        proc = killed_train_run(6, [*first, *mirror], env={**os.environ, **env})
        assert proc.returncode == -9, proc.stderr[-2000:]
        keys = [o["Key"] for o in s3.list_objects_v2(Bucket="ckpt", Prefix="run/")["Contents"]]
        assert keys == ["run/train/checkpoints/step-00000003.pt"]
        # a damaged newer checkpoint in the mirror (an upload cut short): fetched, named, the older one used
        s3.put_object(Bucket="ckpt", Key="run/train/checkpoints/step-00000004.pt", Body=b"PK\x03\x04 cut short")
        # another machine: empty local checkpoint directory, same mirror
        second = _train_args(tiny_target, token_shards, tmp_path / "b" / "out", tmp_path / "b" / "ckpt")
        assert run_in_process(*second, *mirror) == 0
        summary = json.loads((tmp_path / "b" / "out" / "summary.json").read_text())
        assert summary["resumed_from_step"] == 3
        assert (tmp_path / "b" / "ckpt" / "step-00000004.pt.damaged").exists()
        a = load_file(str(ref / "out" / "drafter.safetensors"))
        b = load_file(str(tmp_path / "b" / "out" / "drafter.safetensors"))
        assert all(torch.equal(a[k], b[k]) for k in a)
        keys = sorted(o["Key"] for o in s3.list_objects_v2(Bucket="ckpt", Prefix="run/")["Contents"])
        assert keys == ["run/train/checkpoints/step-00000006.pt", "run/train/checkpoints/step-00000007.pt"]
    finally:
        moto.stop()


def test_damaged_newest_checkpoint_falls_back_to_the_older_one_and_new_data_restarts(tiny_target, token_shards, tmp_path, caplog):
    """A truncated newest checkpoint (node lost while copying it) is named, set aside, and the run resumes
    from the older one, ending with the weights of an uninterrupted run; a retry does not trip on it again."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    shards = [tmp_path / p.name for p in token_shards]
    for src, dst in zip(token_shards, shards):
        dst.write_bytes(src.read_bytes())
    ckpt = tmp_path / "ckpt"
    common = dict(max_steps=4, checkpoint_every=2)
    assert run_in_process(*_train_args(tiny_target, shards, tmp_path / "ref", ckpt, **common)) == 0
    newest = ckpt / "step-00000004.pt"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    with caplog.at_level("WARNING"):
        assert run_in_process(*_train_args(tiny_target, shards, tmp_path / "again", ckpt, **common)) == 0
    assert f"{newest}: unreadable checkpoint" in caplog.text
    assert (ckpt / "step-00000004.pt.damaged").exists()
    assert json.loads((tmp_path / "again" / "summary.json").read_text())["resumed_from_step"] == 2
    a = load_file(str(tmp_path / "ref" / "drafter.safetensors"))
    b = load_file(str(tmp_path / "again" / "drafter.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    # a shard rewritten with the same sample ids but other tokens: the checkpoints are not resumed from
    table = pq.read_table(shards[0]).to_pylist()
    table[0]["input_ids"] = table[0]["input_ids"][::-1]
    pq.write_table(pa.Table.from_pylist(table, schema=pq.read_schema(shards[0])), shards[0])
    assert run_in_process(*_train_args(tiny_target, shards, tmp_path / "new-data", ckpt, **common)) == 0
    assert json.loads((tmp_path / "new-data" / "summary.json").read_text())["resumed_from_step"] == 0
    assert list(ckpt.glob("stale-*/step-00000004.pt"))


@pytest.mark.parametrize("labels", ["data", "target", "distill"])
def test_online_training_in_the_packed_layout_matches_the_padded(tiny_target, token_shards, tmp_path, labels):
    """`--layout packed` online (the GPU's auto layout with compile): the same steps' losses as the padded layout
    to float precision, under the default D-PACE weighting; with target labels and with the target's
    distributions (distill) too."""
    losses = {}
    for layout in ("padded", "packed"):
        out = tmp_path / layout
        assert run_in_process(*_train_args(tiny_target, token_shards, out / "out", out / "ckpt", layout=layout,
                                           labels=labels, acceptance_every=0)) == 0
        recs = [json.loads(ln) for ln in (out / "out" / "metrics.jsonl").read_text().splitlines()]
        losses[layout] = [r["loss"] for r in recs]
    assert len(losses["packed"]) == len(losses["padded"]) == 4
    assert losses["packed"] == pytest.approx(losses["padded"], rel=1e-4)


def test_target_and_distill_labels_need_the_target_beside_the_drafter(tiny_target, token_shards, tmp_path, capsys):
    """`--labels target|distill` read the target's predictions while it trains: offline shards hold none, so
    both stop before any work."""
    for labels in ("target", "distill"):
        rc = run_in_process(*_train_args(tiny_target, token_shards, tmp_path / labels, tmp_path / f"{labels}-ck",
                                         mode="offline", labels=labels))
        assert rc != 0 and f"train.labels: {labels} needs train.mode: online" in capsys.readouterr().err
        assert not (tmp_path / f"{labels}-ck").exists()
