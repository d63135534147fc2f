"""Hidden-state extraction on CPU with the tiny target (and a tiny hybrid GDN model)."""

from __future__ import annotations

import os
import subprocess

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from conftest import BIN, REPO
from dflash_pipeline.errors import PipelineError
from dflash_pipeline.hidden_states.batching import token_budget_batches
from dflash_pipeline.hidden_states.capture import LayerCapture
from dflash_pipeline.hidden_states.extract import ExtractSettings, extract_shard
from dflash_pipeline.hidden_states.reader import HiddenStateShardReader
from dflash_pipeline.target import load_model


def load_target(path, device):
    return load_model(path, device)


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Tiny models run ~100x slower with 2 intra-op threads on a busy 2-core machine (spinning workers)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _token_shard(path, n=12, vocab=1000, seed=0):
    rng = np.random.default_rng(seed)
    rows = {"sample_id": [], "input_ids": [], "loss_mask": [], "length": [], "num_loss_tokens": [], "truncated": []}
    for i in range(n):
        t = int(rng.integers(3, 90))
        ids = rng.integers(0, vocab, t).astype(np.int32)
        mask = np.zeros(t, dtype=np.int8)
        mask[t // 2:] = 1
        rows["sample_id"].append(f"x-{i:04d}")
        rows["input_ids"].append(ids.tolist())
        rows["loss_mask"].append(mask.tolist())
        rows["length"].append(t)
        rows["num_loss_tokens"].append(int(mask.sum()))
        rows["truncated"].append(False)
    # one sample without supervised tokens: skipped
    rows["loss_mask"][3] = [0] * rows["length"][3]
    rows["num_loss_tokens"][3] = 0
    schema = pa.schema([("sample_id", pa.string()), ("input_ids", pa.list_(pa.int32())),
                        ("loss_mask", pa.list_(pa.int8())), ("length", pa.int32()),
                        ("num_loss_tokens", pa.int32()), ("truncated", pa.bool_())])
    pq.write_table(pa.table(rows, schema=schema), path)
    return rows


def _reference(model, ids, layer_ids):
    with torch.inference_mode():
        out = model(input_ids=torch.as_tensor(ids, dtype=torch.long)[None], output_hidden_states=True)
    return torch.stack([out.hidden_states[i + 1][0] for i in layer_ids], dim=1)


def test_hook_capture_equals_output_hidden_states(tiny_target):
    model = load_target(str(tiny_target), "cpu")
    x = torch.randint(0, 1000, (3, 40))
    cap = LayerCapture(model, [0, 2, 5])
    with torch.inference_mode():
        got = cap.run(x)
        ref = model(input_ids=x, output_hidden_states=True).hidden_states
    cap.remove()
    assert got.shape == (3, 40, 3, model.config.hidden_size)
    for k, i in enumerate([0, 2, 5]):
        assert torch.equal(got[:, :, k], ref[i + 1])
    with pytest.raises(PipelineError, match="out of range"):
        LayerCapture(model, [1, 8])


def test_token_budget_batches_sorted_and_bounded():
    lengths = [5, 100, 7, 64, 64, 3, 200, 9]
    batches = token_budget_batches(lengths, 256)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 256
    assert batches[0] == [6]  # longest first, alone
    for b in token_budget_batches([100, 95, 90, 70, 60, 10, 9], 10_000, max_padding=0.2):
        longest = max([100, 95, 90, 70, 60, 10, 9][i] for i in b)
        assert all([100, 95, 90, 70, 60, 10, 9][i] >= 0.8 * longest for i in b)


def test_extract_matches_reference_forward(tiny_target, tmp_path):
    rows = _token_shard(tmp_path / "t.parquet")
    out = tmp_path / "h.dfhs"
    settings = ExtractSettings(target_layer_ids=[1, 3, 5], dtype="float32", token_budget=200, device="cpu", flush_tokens=50)
    stats = extract_shard(str(tmp_path / "t.parquet"), str(tiny_target), str(out), settings,
                          stats_path=str(tmp_path / "h.stats.json"))
    r = HiddenStateShardReader(out)
    assert r.metadata["target_layer_ids"] == [1, 3, 5] and r.metadata["num_layers"] == 8
    assert r.metadata["hidden_size"] == 128 and r.metadata["dtype"] == "float32"
    assert sorted(r.sample_ids) == sorted(s for i, s in enumerate(rows["sample_id"]) if i != 3)
    assert stats["samples"] == 11 and stats["skipped_unsupervised"] == 1
    assert stats["tokens"] == sum(rows["length"]) - rows["length"][3]
    model = load_target(str(tiny_target), "cpu")
    for sid in r.sample_ids:
        i = rows["sample_id"].index(sid)
        got = r.read(r.index_of(sid))
        assert np.array_equal(got["input_ids"], rows["input_ids"][i])
        assert np.array_equal(got["loss_mask"], rows["loss_mask"][i])
        ref = _reference(model, rows["input_ids"][i], [1, 3, 5])
        # right padding without a mask changes nothing for the real tokens (batched fp32 matmuls may round)
        torch.testing.assert_close(got["hidden"], ref, rtol=1e-4, atol=1e-5)
    assert (tmp_path / "h.stats.json").exists()


def test_extract_default_layers_from_drafter_config(tiny_target, tmp_path):
    _token_shard(tmp_path / "t.parquet", n=5)
    out = tmp_path / "h.dfhs"
    extract_shard(str(tmp_path / "t.parquet"), str(tiny_target), str(out),
                  ExtractSettings(num_layers=3, device="cpu", codec="fp8"))
    assert HiddenStateShardReader(out).metadata["target_layer_ids"] == [1, 3, 5]
    with pytest.raises(PipelineError, match="out of range"):
        extract_shard(str(tmp_path / "t.parquet"), str(tiny_target), str(tmp_path / "bad.dfhs"),
                      ExtractSettings(target_layer_ids=[1, 9], device="cpu"))


def test_resume_after_kill(tiny_target, tmp_path, caplog, monkeypatch):
    _token_shard(tmp_path / "t.parquet", n=16)
    out = tmp_path / "h.dfhs"
    args = ["extract", "--tokens", str(tmp_path / "t.parquet"), "--model", str(tiny_target), "--out", str(out),
            "--target-layer-ids", "1", "5", "--token-budget", "100", "--flush-tokens", "60", "--device", "cpu",
            "--encode-threads", "1", "--stats", str(tmp_path / "h.stats.json")]
    # killed for real (SIGKILL, no cleanup) by a wrapper right after the second durable chunk
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([str(BIN / "python"), str(REPO / "tests" / "extract_kill_helper.py"), "2", *args],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == -9, proc.stderr
    assert not out.exists() and (tmp_path / "h.dfhs.partial").exists()
    from dflash_pipeline.cli import main

    monkeypatch.setenv("DFLASH_PROGRESS_INTERVAL_S", "0")  # a progress line after every batch
    with caplog.at_level("INFO", logger="dflash_pipeline.hidden_states.extract"):
        assert main(args) == 0  # the rerun, in process (one CLI start less)
    assert "resuming" in caplog.text
    progress = [r.getMessage() for r in caplog.records if r.getMessage().startswith("extract h.dfhs: ")]
    assert len(progress) >= 2 and all("elapsed" in p and "tokens/s, ETA" in p for p in progress)
    assert progress[-1].split(" tokens")[0].split(": ")[1].split("/")[0] == progress[-1].split("/")[1].split(" ")[0]
    r = HiddenStateShardReader(out)
    assert len(r) == 15 and len(set(r.sample_ids)) == 15
    import json  # the stats count the whole shard, the samples written before the kill included

    stats = json.loads((tmp_path / "h.stats.json").read_text())
    assert stats["samples"] == 15 and stats["tokens"] == sum(r.num_tokens)
    assert 0 < stats["resumed_samples"] and stats["this_run"]["samples"] == 15 - stats["resumed_samples"]
    r.verify_all()
    fresh = tmp_path / "fresh.dfhs"  # an uninterrupted run, in process (one CLI start less)
    extract_shard(str(tmp_path / "t.parquet"), str(tiny_target), str(fresh),
                  ExtractSettings(target_layer_ids=[1, 5], token_budget=100, flush_tokens=60, device="cpu", encode_threads=1))
    f = HiddenStateShardReader(fresh)
    for sid in f.sample_ids:
        a, b = r.read(r.index_of(sid)), f.read(f.index_of(sid))
        torch.testing.assert_close(a["hidden"].float(), b["hidden"].float(), rtol=1e-2, atol=1e-2)


class _Crash(Exception):
    pass


def _interrupted_extract(tokens, model_dir, out, monkeypatch, settings, model):
    """Extraction that dies after its first durable chunk, leaving the partial file and journal behind."""
    from dflash_pipeline.hidden_states.writer import HiddenStateShardWriter

    durable = HiddenStateShardWriter._sync

    def sync_then_crash(self, new, total):
        durable(self, new, total)
        raise _Crash

    with monkeypatch.context() as m:
        m.setattr(HiddenStateShardWriter, "_sync", sync_then_crash)
        with pytest.raises(_Crash):
            extract_shard(str(tokens), str(model_dir), str(out), settings, model=model)
    assert (out.parent / (out.name + ".partial")).exists()


def test_resume_never_keeps_samples_of_other_tokens_or_another_target(tiny_target, tmp_path, monkeypatch):
    """A token shard rewritten with the same ids (or a rebuilt target) after a kill: nothing old survives."""
    import shutil

    settings = ExtractSettings(target_layer_ids=[1, 5], token_budget=60, flush_tokens=40, device="cpu", encode_threads=1)
    model = load_model(tiny_target, "cpu")  # loaded once; the fingerprint is taken from the directory given
    tokens, out = tmp_path / "t.parquet", tmp_path / "h.dfhs"
    _token_shard(tokens, n=12, seed=0)
    _interrupted_extract(tokens, tiny_target, out, monkeypatch, settings, model)
    new = _token_shard(tokens, n=12, seed=1)  # same sample ids, other tokens
    stats = extract_shard(str(tokens), str(tiny_target), str(out), settings, model=model)
    assert stats["resumed_samples"] == 0
    r = HiddenStateShardReader(out)
    assert len(r) == 11
    for sid in r.sample_ids:
        assert np.array_equal(r.read(r.index_of(sid))["input_ids"], new["input_ids"][new["sample_id"].index(sid)])
    assert len(r.metadata["tokens_fingerprint"]) == 32 and r.metadata["target_fingerprint"]

    rebuilt = tmp_path / "target"  # the same target rebuilt in place (new weights file): no resume either
    shutil.copytree(tiny_target, rebuilt)
    out2 = tmp_path / "h2.dfhs"
    _interrupted_extract(tokens, rebuilt, out2, monkeypatch, settings, model)
    weights = next(rebuilt.glob("*.safetensors"))
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    assert extract_shard(str(tokens), str(rebuilt), str(out2), settings, model=model)["resumed_samples"] == 0
    _interrupted_extract(tokens, rebuilt, out2, monkeypatch, settings, model)  # unchanged inputs do resume
    assert extract_shard(str(tokens), str(rebuilt), str(out2), settings, model=model)["resumed_samples"] > 0


def _hybrid(kind):
    common = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2,
                  linear_key_head_dim=16, linear_value_head_dim=16, full_attention_interval=2)
    if kind == "qwen3_next":
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

        cfg = Qwen3NextConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                              shared_expert_intermediate_size=32, **common)
        return Qwen3NextForCausalLM(cfg)
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    return Qwen3_5ForCausalLM(Qwen3_5TextConfig(**common))


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5"])
def test_hybrid_gdn_model_capture(tmp_path, kind):
    torch.manual_seed(0)
    model = _hybrid(kind).eval()
    assert "linear_attention" in model.config.layer_types and "full_attention" in model.config.layer_types
    model.save_pretrained(tmp_path / "hybrid")
    model = load_target(str(tmp_path / "hybrid"), "cpu")
    x = torch.randint(0, 300, (2, 24))
    cap = LayerCapture(model, [0, 1, 2])
    with torch.inference_mode():
        got = cap.run(x)
        ref = model(input_ids=x, output_hidden_states=True).hidden_states
    cap.remove()
    for k, i in enumerate([0, 1, 2]):
        torch.testing.assert_close(got[:, :, k], ref[i + 1], rtol=0, atol=0)
    with pytest.raises(PipelineError, match="out of range"):
        LayerCapture(model, [4])


def test_bad_inputs_are_one_line_errors_before_the_target_loads(tmp_path, capsys):
    from dflash_pipeline.cli import main

    pq.write_table(pa.table({"sample_id": ["a"], "text": ["x"]}), tmp_path / "chat.parquet")
    (tmp_path / "junk.parquet").write_bytes(b"not parquet at all")
    base = ["extract", "--model", str(tmp_path / "no-model"), "--out", str(tmp_path / "h.dfhs"), "--device", "cpu"]
    schema = pa.schema([("sample_id", pa.string()), ("input_ids", pa.list_(pa.int32())),
                        ("loss_mask", pa.list_(pa.int8()))])
    pq.write_table(pa.table({"sample_id": ["a", "b", "a"], "input_ids": [[1], [2], [3]], "loss_mask": [[1]] * 3},
                            schema=schema), tmp_path / "twice.parquet")
    pq.write_table(pa.table({"sample_id": ["a"], "input_ids": [[1, 2]], "loss_mask": [[1]]}, schema=schema),
                   tmp_path / "ragged.parquet")
    unreadable = "cannot read the token shard"
    for tokens, why in [("chat.parquet", unreadable), ("junk.parquet", unreadable), ("missing.parquet", unreadable),
                        ("twice.parquet", "sample 'a' appears twice (row 2)"),
                        ("ragged.parquet", "sample 'a' has 2 input_ids but 1 loss_mask values")]:
        assert main([*base, "--tokens", str(tmp_path / tokens)]) == 2
        assert f"{tokens}: {why}" in capsys.readouterr().err
    _token_shard(tmp_path / "t.parquet", n=4)
    with pytest.raises(SystemExit) as exit_:  # argparse: a usage error
        main([*base, "--tokens", str(tmp_path / "t.parquet"), "--target-layer-ids", "1,x"])
    assert exit_.value.code == 2 and "--target-layer-ids: invalid int value: '1,x'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main([*base, "--tokens", str(tmp_path / "t.parquet"), "--num-layers", "three"])
    assert exit_.value.code == 2 and "--num-layers: invalid int value: 'three'" in capsys.readouterr().err
    assert main([*base, "--tokens", str(tmp_path / "t.parquet")]) == 2  # the target itself: load_model's error
    assert "no-model" in capsys.readouterr().err


def test_compile_auto_compiles_only_what_amortises_it():
    """compile=auto: never on CPU; on a GPU only for a shard with enough tokens to amortise the compilation (a
    640-sequence shard of the 135M target, 337K tokens, ran 2.8x slower compiled on the H200; 3.2M, 1.3x slower);
    true/false are obeyed as given."""
    from dflash_pipeline.hidden_states.compile_choice import COMPILE_MIN_TOKENS, should_compile

    assert not should_compile("auto", "cpu", 10 ** 12)
    assert not should_compile("auto", "cuda", 336_707) and not should_compile("auto", "cuda", 3_202_759)
    assert not should_compile("auto", "cuda", COMPILE_MIN_TOKENS - 1)
    assert should_compile("auto", "cuda:1", COMPILE_MIN_TOKENS)
    assert should_compile(True, "cpu", 1) and not should_compile(False, "cuda", 10 ** 12)


def test_group_job_keeps_finished_shards_and_redoes_the_rest(tiny_target, tmp_path):
    """One process extracts a group of shards (the target loaded once); a job that dies on its second shard
    keeps the first (complete, same tokens and settings) and the rerun extracts only the second."""
    from dflash_pipeline.hidden_states.extract import extract_shards

    a, b = tmp_path / "a.parquet", tmp_path / "b.parquet"
    _token_shard(a, n=6, seed=1)
    rows = _token_shard(b, n=6, seed=2)
    good_ids = list(rows["input_ids"][0])
    rows["input_ids"][0][0] = 10 ** 6  # outside the tiny target's vocabulary: the job fails on this shard
    pq.write_table(pa.table({k: v for k, v in rows.items()}, schema=pq.read_schema(b)), b)
    outs = [str(tmp_path / "g" / "a.dfhs"), str(tmp_path / "g" / "b.dfhs")]
    stats = [o.replace(".dfhs", ".stats.json") for o in outs]
    settings = ExtractSettings(target_layer_ids=[1, 3], device="cpu", token_budget=128)
    with pytest.raises(PipelineError, match="outside the target's embedding"):
        extract_shards([str(a), str(b)], str(tiny_target), outs, settings, stats_paths=stats)
    assert os.path.exists(outs[0]) and not os.path.exists(outs[1])
    first = os.stat(outs[0]).st_mtime_ns

    rows["input_ids"][0] = good_ids
    pq.write_table(pa.table(rows, schema=pq.read_schema(b)), b)
    done = extract_shards([str(a), str(b)], str(tiny_target), outs, settings, stats_paths=stats)
    assert os.stat(outs[0]).st_mtime_ns == first  # kept, not written again
    assert done[1]["job"] == {"shards": 2, "position": 1, "startup_s": 0.0} and done[1]["this_run"]["tokens"] > 0
    assert len(HiddenStateShardReader(outs[1])) == 5  # 6 samples, one without supervised tokens

    # a shard whose tokens changed under the same name is extracted again, not kept
    _token_shard(a, n=4, seed=3)
    again = extract_shards([str(a)], str(tiny_target), outs[:1], settings, stats_paths=stats[:1])
    assert again[0]["samples"] == 3 and len(HiddenStateShardReader(outs[0])) == 3
