"""Hostile inputs, round 2 (issue 21): each case ends in one line naming the file, the record or sample and the
reason, or in the right result with nothing lost."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from conftest import BIN, run_cli
from dflash_pipeline.data.ingest import ReadResult, iter_raw_records
from dflash_pipeline.errors import PipelineError


def _conversations(n: int, answer_prefix: str = "", pad: int = 600) -> str:
    return "".join(json.dumps({"conversations": [{"from": "human", "value": f"q{i} " + "w" * pad},
                                                 {"from": "gpt", "value": f"{answer_prefix}a{i}"}]}) + "\n"
                   for i in range(n))


def _one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    """The stage failed with exit code 2 and one `error:` line (no traceback) containing every needle."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


# ------------------------------------------------------------------------------ 1: a file changing under ingest
def test_raw_file_rewritten_between_reads_is_an_error_not_a_mix(tmp_path):
    """The reader has handed out records of version 1 when the file is rewritten in place (as `cp` does): the
    end of the read names the file instead of handing out version 2's records as the rest of the same file."""
    path = tmp_path / "d.jsonl"
    path.write_text(_conversations(6000))  # ~3.7 MB: read in 1 MiB chunks
    records = iter_raw_records(str(path), ReadResult(), 1 << 20)
    first = next(records)
    assert first.value["conversations"][1]["value"] == "a0"
    shutil.copyfile(tmp_path / "d.jsonl", tmp_path / "v1.jsonl")
    (tmp_path / "v2.jsonl").write_text(_conversations(6000, "V2 "))
    shutil.copyfile(tmp_path / "v2.jsonl", path)  # same inode, truncated and rewritten
    with pytest.raises(PipelineError, match=r"d\.jsonl: the file was rewritten .* while it was being read"):
        for _ in records:
            pass
    # replaced by another file (a rename over the path) while being read: the same
    records = iter_raw_records(str(path), ReadResult(), 1 << 20)
    next(records)
    os.replace(tmp_path / "v1.jsonl", path)
    with pytest.raises(PipelineError, match="replaced by another file"):
        list(records)


def _read_position(pid: int, path: Path) -> int | None:
    """Where process `pid` reads `path` now (its descriptor's offset), or None while it has not opened it."""
    fd_dir = Path(f"/proc/{pid}/fd")
    try:
        for fd in fd_dir.iterdir():
            if os.path.realpath(fd) == str(path):
                for line in (Path(f"/proc/{pid}/fdinfo") / fd.name).read_text().splitlines():
                    if line.startswith("pos:"):
                        return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return None


def test_ingest_cli_fails_when_the_input_is_rewritten_mid_read(tmp_path):
    """The issue's case through the real CLI: `cp v2 d.jsonl` while `ingest` is reading d.jsonl."""
    v1, v2, d = tmp_path / "v1.jsonl", tmp_path / "v2.jsonl", tmp_path / "d.jsonl"
    v1.write_text(_conversations(8000))  # ~5 MB, read in 1 MiB chunks
    v2.write_text(_conversations(8000, "V2 "))
    shutil.copyfile(v1, d)
    out = tmp_path / "out"
    proc = subprocess.Popen([str(BIN / "dflash-pipeline"), "ingest", "--input", str(d), "--out", str(out / "d.parquet"),
                             "--stats", str(out / "d.json"), "--quarantine", str(out / "q.jsonl")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while (pos := _read_position(proc.pid, d)) is None or pos == 0:
        assert proc.poll() is None and time.monotonic() < deadline, "ingest ended before it was seen reading"
        time.sleep(0.005)
    assert pos < d.stat().st_size, "ingest read the whole file before the rewrite: make the file larger"
    shutil.copyfile(v2, d)
    stdout, stderr = proc.communicate(timeout=120)
    _one_line_error(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr),
                    str(d), "rewritten", "nothing was written")
    assert not out.exists() or not any(p.name.endswith((".parquet", ".json", ".jsonl")) for p in out.iterdir())


# ------------------------------------------------------------------------------ 10: settings typed and bounded
def cli_main(capsys, *args) -> subprocess.CompletedProcess:
    """`dflash-pipeline ARGS` in this process (the CLI's own main; no interpreter start-up per case)."""
    from dflash_pipeline import cli

    rc = cli.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, rc, out, err)


def test_settings_and_options_are_typed_and_bounded_by_the_schema(tmp_path, capsys):
    raw = tmp_path / "a.jsonl"
    raw.write_text(_conversations(3, pad=5))
    io = ["--input", raw, "--out", tmp_path / "a.parquet", "--stats", tmp_path / "a.json",
          "--quarantine", tmp_path / "q.jsonl"]
    _one_line_error(cli_main(capsys, "ingest", *io, "--settings", '{"max_record_bytes": "abc"}'),
                    "max_record_bytes='abc'", "not of type 'integer'")
    _one_line_error(cli_main(capsys, "ingest", *io, "--max-record-bytes", "-1"),
                    "--max-record-bytes -1", "minimum of 1024", "ingest.max_record_bytes")
    _one_line_error(cli_main(capsys, "ingest", *io, "--settings", '{"max_record_bytes": 12.5}'),
                    "max_record_bytes=12.5")
    _one_line_error(cli_main(capsys, "tokenize", "--input", "x.parquet", "--model", "m", "--out", "t", "--audit",
                             "a", "--settings", '{"batch_size": 0}'), "batch_size=0", "minimum of 1")
    assert not (tmp_path / "a.json").exists()  # nothing ran, nothing counted
    proc = cli_main(capsys, "ingest", *io, "--max-record-bytes", "1024")
    stats = json.loads(proc.stdout)
    assert (stats["records_read"], stats["kept"], stats["quarantined"]) == (3, 3, 0)  # no phantom record


# ------------------------------------------------------------------------------ 3: one sample id, two .dfhs shards
def _hidden_shard(path: Path, ids: list[str], seed: int = 0, layer_ids=(1,), hidden: int = 128) -> None:
    import numpy as np
    import torch

    from dflash_pipeline.hidden_states.writer import write_shard

    g = torch.Generator().manual_seed(seed)
    samples = [{"sample_id": sid, "input_ids": np.arange(5 + i, dtype=np.int32) % 97,
                "loss_mask": np.ones(5 + i, dtype=np.uint8), "hidden": torch.randn(5 + i, len(layer_ids), hidden,
                                                                              generator=g)}
               for i, sid in enumerate(ids)]
    write_shard(path, samples, {"target_layer_ids": list(layer_ids), "hidden_size": hidden, "num_layers": 8,
                                "model_path": "m"}, codec="raw", dtype="float32")


def test_offline_training_refuses_a_sample_id_in_two_shards(tiny_target, tmp_path, capsys):
    from dflash_pipeline.target_layers import default_target_layer_ids

    layers = default_target_layer_ids(8, 1)
    _hidden_shard(tmp_path / "a.dfhs", ["s0", "s1", "s2"], layer_ids=layers)
    _hidden_shard(tmp_path / "b.dfhs", ["s3", "s1"], seed=1, layer_ids=layers)  # s1 again, other features
    base = ["train", "--mode", "offline", "--model", tiny_target, "--out", tmp_path / "out",
            "--checkpoint-dir", tmp_path / "ck", "--num-layers", "1", "--max-steps", "1"]
    _one_line_error(cli_main(capsys, *base, "--inputs", tmp_path / "a.dfhs", tmp_path / "b.dfhs"),
                    "sample 's1' appears in", "a.dfhs and in", "b.dfhs")
    _one_line_error(cli_main(capsys, *base, "--inputs", tmp_path / "a.dfhs", tmp_path / "a.dfhs"),
                    "sample 's0' appears twice in", "a.dfhs")
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------ 4: NFC and NFD are one sample
def test_nfc_and_nfd_spellings_are_one_sample(tmp_path):
    import unicodedata

    from dflash_pipeline.data.manifest import build_manifest

    text = "Qu'est-ce qu'un café crème à Zürich ? 한국어"
    nfd = unicodedata.normalize("NFD", text)
    assert nfd != text
    for name, spelling in (("a.jsonl", text), ("b.jsonl", nfd)):
        (tmp_path / name).write_text(json.dumps({"conversations": [{"from": "human", "value": spelling},
                                                                   {"from": "gpt", "value": "Oui."}]}) + "\n")
    from dflash_pipeline.data.ingest import ingest_file

    sids = []
    for name in ("a.jsonl", "b.jsonl"):
        stem = name.split(".")[0]
        ingest_file(str(tmp_path / name), str(tmp_path / f"{stem}.parquet"), str(tmp_path / f"{stem}.json"),
                    str(tmp_path / f"{stem}.q.jsonl"))
        row = pq.read_table(tmp_path / f"{stem}.parquet").to_pylist()[0]
        sids.append(row["sample_id"])
        assert row["messages"][0]["content"] == (text if stem == "a" else nfd)  # the text is kept as it came
    assert sids[0] == sids[1]


# ------------------------------------------------------------------------------ 5: an absurd drafter config
@pytest.mark.timeout(120)  # building a million layers (even on the meta device) took minutes before
def test_export_and_evaluate_check_the_layer_count_against_the_weights_first(tiny_target, tmp_path, capsys):
    import torch
    from safetensors.torch import save_file

    from dflash_pipeline import storage
    from dflash_pipeline.drafter.config import DrafterConfig
    from dflash_pipeline.drafter.export import load_exported
    from dflash_pipeline.drafter.model import DFlashDrafter
    from dflash_pipeline.target import read_config

    tc = read_config(tiny_target)  # its vocabulary rows: the drafter's head must match them
    cfg = DrafterConfig.from_target(tc, 2, [1, 4], 16, 1343, tc["vocab_size"])
    src = tmp_path / "drafter"
    src.mkdir()
    save_file(DFlashDrafter(cfg).engine_state_dict(), str(src / "drafter.safetensors"))
    storage.write_json(src / "drafter_config.json", dict(cfg.to_dict(), num_hidden_layers=1_000_000))
    _one_line_error(cli_main(capsys, "export", "--drafter", src, "--model", tiny_target, "--out", tmp_path / "o"),
                    "drafter.safetensors", "num_hidden_layers 1000000", "hold 2 layers")
    assert not (tmp_path / "o").exists()
    storage.write_json(src / "drafter_config.json", cfg.to_dict())
    assert cli_main(capsys, "export", "--drafter", src, "--model", tiny_target, "--out", tmp_path / "o").returncode == 0
    exported = json.loads((tmp_path / "o" / "config.json").read_text())
    storage.write_json(tmp_path / "o" / "config.json", dict(exported, num_hidden_layers=1_000_000))
    with pytest.raises(PipelineError, match=r"model\.safetensors: the config says num_hidden_layers 1000000"):
        load_exported(tmp_path / "o", dtype=torch.float32)  # what `evaluate` loads the drafter with
    # no wall-time assert (it failed under load): building a million layers exceeds the timeout above instead


# ------------------------------------------------------------------------------ 6: token ids outside the vocabulary
def test_extract_names_the_sample_with_a_token_outside_the_vocabulary(tiny_target, tmp_path, capsys):
    import pyarrow as pa

    schema = pa.schema([("sample_id", pa.string()), ("input_ids", pa.list_(pa.int32())),
                        ("loss_mask", pa.list_(pa.int8()))])
    rows = {"sample_id": ["ok", "big"], "input_ids": [[1, 2, 3], [4, 10**6, 5]], "loss_mask": [[0, 1, 1]] * 2}
    pq.write_table(pa.table(rows, schema=schema), tmp_path / "big.parquet")
    rows["input_ids"][1] = [4, -7, 5]
    pq.write_table(pa.table(rows, schema=schema), tmp_path / "neg.parquet")
    for name, sid, bad in (("big", "big", 10**6), ("neg", "big", -7)):
        out = tmp_path / f"{name}.dfhs"
        _one_line_error(cli_main(capsys, "extract", "--tokens", tmp_path / f"{name}.parquet", "--model", tiny_target,
                                 "--out", out, "--device", "cpu", "--target-layer-ids", "1"),
                        f"{name}.parquet: sample '{sid}': token id {bad} outside the target's embedding")
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(f"{name}.dfhs")]  # no partial file


def test_online_training_names_the_negative_token_id_not_the_largest():
    import numpy as np

    from dflash_pipeline.drafter.sources import check_token_range

    with pytest.raises(PipelineError, match=r"sample 's9': token id -3 outside the target's embedding \(0\.\.99\)"):
        check_token_range({"sample_id": "s9", "input_ids": np.array([5, -3, 42])}, 100)
    with pytest.raises(PipelineError, match="token id 100 outside"):
        check_token_range({"sample_id": "s9", "input_ids": np.array([5, 100, 42])}, 100)


# ------------------------------------------------------------------------------ 11: a .dfhs replaced under its path
def test_a_replaced_shard_is_read_again_not_served_from_the_cache(tmp_path):
    from dflash_pipeline.hidden_states.reader import HiddenStateShardReader

    path = tmp_path / "h.dfhs"
    _hidden_shard(path, ["a", "b", "c"], seed=0)
    first = HiddenStateShardReader(path, mmap=False)
    old = first.read(0)["hidden"].clone()
    for seed in range(1, 200):  # same ids and size, other values (the index's zstd size varies with its CRCs)
        _hidden_shard(tmp_path / "same-size.dfhs", ["a", "b", "c"], seed=seed)
        if (tmp_path / "same-size.dfhs").stat().st_size == path.stat().st_size:
            break
    assert (tmp_path / "same-size.dfhs").stat().st_size == path.stat().st_size
    os.replace(tmp_path / "same-size.dfhs", path)
    second = HiddenStateShardReader(path, mmap=False)
    new = second.read(0)["hidden"]
    assert not new.equal(old)
    _hidden_shard(tmp_path / "longer.dfhs", ["x", "y", "z", "w", "v"], seed=2)  # other size, other index
    os.replace(tmp_path / "longer.dfhs", path)
    third = HiddenStateShardReader(path)  # mapped this time
    assert third.sample_ids == ["x", "y", "z", "w", "v"] and third.verify_all() == 5
    assert first.read(0)["hidden"].equal(old)  # a reader opened before keeps reading its version
    for r in (first, second, third):
        r.close()


# ------------------------------------------------------------------------------ 9: a full disk, a read-only directory
def _in_mount_namespace(setup: str, *cmd) -> subprocess.CompletedProcess:
    """Run `cmd` after the shell commands `setup` (mounts) in a private mount namespace: real file systems
    (a tmpfs of 64 KiB, a read-only tmpfs), gone when the command ends, nothing mounted on this machine."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is not installed")
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "true"], capture_output=True)
    if probe.returncode != 0:
        if os.environ.get("CI"):
            pytest.fail(f"CI needs mount namespaces for the full-disk tests: {probe.stderr.decode()[:200]}")
        pytest.skip("no mount namespaces here (unprivileged user namespaces are disabled)")
    return subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", f'{setup} && exec "$@"',
                           "sh", *map(str, cmd)], capture_output=True, text=True)


def test_ingest_on_a_full_disk_or_a_read_only_directory_is_one_line(tmp_path):
    """ENOSPC for real: a 64 KiB tmpfs for the outputs of a 2 MB input (the last line used to be
    `Operation on closed file`, hiding it); EROFS: a read-only tmpfs. One line each, naming the output."""
    raw = tmp_path / "big.jsonl"
    raw.write_text(_conversations(3000))
    for where, option, expect in (("full", "size=64k", "No space left on device (ENOSPC)"),
                                  ("ro", "ro", "Read-only file system (EROFS)")):
        mnt = tmp_path / where
        mnt.mkdir()
        proc = _in_mount_namespace(f"mount -t tmpfs -o {option} tmpfs {mnt}", BIN / "dflash-pipeline", "ingest",
                                   "--input", raw, "--out", mnt / "d.parquet", "--stats", mnt / "d.json",
                                   "--quarantine", mnt / "q.jsonl")
        line = _one_line_error(proc, expect, str(mnt / ""), "rerun")
        assert "closed file" not in line


# ------------------------------------------------------------------------------ 7, 8: tokenize's inputs and template
def _conversation_shard(path: Path, texts: list[str]) -> list[str]:
    import pyarrow as pa

    from dflash_pipeline.data.conversations import SAMPLE_SCHEMA, sample_id

    rows = []
    for i, text in enumerate(texts):
        messages = [{"role": "user", "content": text, "reasoning_content": None},
                    {"role": "assistant", "content": f"Answer {i}.", "reasoning_content": None}]
        rows.append({"sample_id": sample_id(messages), "source": f"t#{i}", "source_id": None, "messages": messages})
    pq.write_table(pa.Table.from_pylist(rows, schema=SAMPLE_SCHEMA), path)
    return [r["sample_id"] for r in rows]


@pytest.fixture
def tokenizer_dir(tiny_target, tmp_path) -> Path:
    """The tiny target's tokenizer, with a chat template of our own to break."""
    out = tmp_path / "tok"
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json"):
        shutil.copy(tiny_target / name, out / name)
    return out


def test_a_template_failing_on_one_record_leaves_out_that_record_with_the_reason(tokenizer_dir, tmp_path, capsys):
    template = tokenizer_dir / "chat_template.jinja"
    template.write_text("{%- for m in messages %}{%- if 'BOOM' in m['content'] %}"
                        "{{ raise_exception('this template refuses BOOM') }}{%- endif %}{%- endfor %}"
                        + template.read_text())
    sids = _conversation_shard(tmp_path / "s.parquet", ["Hello?", "BOOM goes the record", "Bye?"])
    proc = cli_main(capsys, "tokenize", "--input", tmp_path / "s.parquet", "--model", tokenizer_dir,
                    "--out", tmp_path / "t.parquet", "--audit", tmp_path / "a.json")
    assert proc.returncode == 0, proc.stderr
    audit = json.loads((tmp_path / "a.json").read_text())
    assert audit["samples"] == 2 and audit["counts"]["template_error"] == 1
    assert audit["samples"] + audit["counts"]["template_error"] + audit["counts"]["control_tokens"] == 3
    [example] = audit["rejected_examples"]
    assert example["sample_id"] == sids[1] and "this template refuses BOOM" in example["reason"]
    assert pq.read_table(tmp_path / "t.parquet").column("sample_id").to_pylist() == [sids[0], sids[2]]

    template.unlink()  # no template at all: one line before any work
    _one_line_error(cli_main(capsys, "tokenize", "--input", tmp_path / "s.parquet", "--model", tokenizer_dir,
                             "--out", tmp_path / "t2.parquet", "--audit", tmp_path / "a2.json"),
                    str(tokenizer_dir), "no chat template")
    assert not (tmp_path / "t2.parquet").exists() and not (tmp_path / "a2.json").exists()


def test_tokenize_names_the_file_and_the_problem_of_a_wrong_schema(tokenizer_dir, tmp_path, capsys):
    import pyarrow as pa

    shard = tmp_path / "ok.parquet"
    _conversation_shard(shard, ["Hi?"])
    good = pq.read_table(shard).to_pylist()[0]
    cases = {
        "no-messages": (pa.table({"sample_id": ["a"], "text": ["hello"]}), "no column 'messages'"),
        "strings": (pa.table({"sample_id": ["a"], "messages": ["hello"]}), "column 'messages' is string"),
        "sharegpt": (pa.Table.from_pylist([{"sample_id": "a", "messages": [{"from": "human", "value": "hi"}]}]),
                     "ShareGPT from/value"),
        "null-role": (pa.Table.from_pylist([dict(good, messages=[dict(good["messages"][0], role=None),
                                                                  good["messages"][1]])],
                                           schema=pq.read_schema(shard)),
                      f"row 0 (sample {good['sample_id']!r}): message 0 has role None"),
        "conversations": (pa.table({"conversations": [[{"from": "human", "value": "hi"}]]}), "run `dflash-pipeline "
                                                                                            "ingest` on it first"),
    }
    for name, (table, why) in cases.items():
        pq.write_table(table, tmp_path / f"{name}.parquet")
    (tmp_path / "text.parquet").write_text('{"conversations": []}\n')
    cases["text"] = (None, "not a readable Parquet file")
    for name, (_, why) in cases.items():
        _one_line_error(cli_main(capsys, "tokenize", "--input", tmp_path / f"{name}.parquet", "--model", tokenizer_dir,
                                 "--out", tmp_path / "t.parquet", "--audit", tmp_path / "a.json"),
                        f"{name}.parquet", why)
    assert not (tmp_path / "t.parquet").exists()


# ------------------------------------------------------------------------------ 2: answers of another model
GEN_FAST = ["--backend", "servers", "--backoff-base", "0.02", "--backoff-max", "0.2", "--revive-after", "0.5",
            "--progress-interval", "0.5", "--max-new-tokens", "32"]


def test_generate_without_model_never_reuses_another_models_answers(tiny_target, tmp_path, capsys, caplog):
    """`generate --backend servers` without --model, against servers reporting weight_version "default"
    (SGLang's unless started with --weight-version): the model is identified by the model_path they report."""
    from generation_helpers import SGLangTestServer, read_summary, write_shard

    write_shard(tmp_path / "in.parquet", 4, seed=71)
    model = tmp_path / "served"  # the model directory the servers report, visible here
    shutil.copytree(tiny_target, model)
    out = tmp_path / "s-00000.parquet"
    gen = ["generate", "--input", tmp_path / "in.parquet", "--out", out, *GEN_FAST]
    with SGLangTestServer(model, engine="instant") as server:
        assert cli_main(capsys, *gen, "--servers", server.url).returncode == 0
        weights = model / "model.safetensors"
        weights.write_bytes(weights.read_bytes() + b"\0")  # another model served under the same path
        assert cli_main(capsys, *gen, "--servers", server.url).returncode == 0
        assert read_summary(out)["resumed_from_journal"] == 0  # (with the same weights it resumes: test_generation)

    # a model_path this machine cannot see, weight_version "default": nothing identifies the weights
    out2 = tmp_path / "s-00001.parquet"
    gen2 = ["generate", "--input", tmp_path / "in.parquet", "--out", out2, *GEN_FAST]
    with SGLangTestServer(Path("remote-org/remote-model"), engine="instant") as server:
        assert cli_main(capsys, *gen2, "--servers", server.url).returncode == 0
        assert "weights cannot be identified" in caplog.text
        _one_line_error(cli_main(capsys, *gen2, "--servers", server.url), "s-00001.jsonl: holds 4 answers, not "
                        "reused", "'remote-org/remote-model' is not a directory", "weight_version is 'default'")
    with SGLangTestServer(Path("remote-org/remote-model"), "--weight-version", "v7", engine="instant") as server:
        assert cli_main(capsys, *gen2, "--servers", server.url).returncode == 0  # identified by its version
        assert read_summary(out2)["resumed_from_journal"] == 0


def test_generate_names_an_input_that_is_not_an_ingested_shard(tmp_path, capsys):
    import pyarrow as pa

    pq.write_table(pa.Table.from_pylist([{"sample_id": "a", "source": "x", "source_id": None,
                                          "messages": [{"from": "human", "value": "hi"}]}]), tmp_path / "sg.parquet")
    (tmp_path / "text.parquet").write_text("not parquet\n")
    for name, why in (("sg", "ShareGPT from/value"), ("text", "not a readable Parquet file")):
        _one_line_error(cli_main(capsys, "generate", "--input", tmp_path / f"{name}.parquet", "--out",
                                 tmp_path / "o.parquet", *GEN_FAST, "--servers", "http://127.0.0.1:9"),
                        f"{name}.parquet", why)
