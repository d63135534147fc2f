"""Generation: the client against real HTTP servers (the SGLang-speaking test server), the hf backend with the
tiny target, exactly-once under kill -9, faults, dead servers, and the sglang launcher's code path."""

from __future__ import annotations

import functools
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from conftest import BIN, REPO, run_cli
from generation_helpers import (
    SERVER, SGLangTestServer, free_port, knob_env, read_completions, read_summary, write_shard,
)
from sglang_test_server import instant_answer
from workflow_runs import make_workdir, planned, snakemake, workflow_env

FAST = ["--backoff-base", "0.02", "--backoff-max", "0.2", "--revive-after", "0.5", "--progress-interval", "0.5",
        "--max-new-tokens", "64"]


def gen(inp, out, *args, check=True, **kw):
    return run_cli("generate", "--input", inp, "--out", out, *FAST, *args, check=check, **kw)


def answer_of(messages_before: list[dict], words: int = 12) -> tuple[str, str]:
    return instant_answer([{"role": m["role"], "content": m["content"]} for m in messages_before], words)


def assert_one_row_per_sample(out: Path, rows: list[dict]) -> list[dict]:
    got = read_completions(out)
    assert [r["sample_id"] for r in got] == [r["sample_id"] for r in rows]  # one row each, input order
    return got


def assert_answers_belong(got: list[dict]) -> None:
    """Every stored answer is the instant server's answer to *this* sample's conversation so far."""
    for row in got:
        assert row["status"] == "ok", row
        msgs = row["messages"]
        for i, m in enumerate(msgs):
            if m["role"] == "assistant":
                thinking, answer = answer_of(msgs[:i])
                assert m["content"] == answer
                assert m["reasoning_content"] == thinking


# ------------------------------------------------------------------------------------------------------
def test_hf_backend_regenerates_every_sample(tmp_path, tiny_target):
    rows = write_shard(tmp_path / "in.parquet", 24, seed=1)
    out = tmp_path / "out" / "shard-00000.parquet"
    gen(tmp_path / "in.parquet", out, "--backend", "hf", "--model", tiny_target, "--max-new-tokens", "16",
        "--temperature", "0.8", "--seed", "3", "--threads", "1", "--batch-size", "8", "--turns", "all")
    got = assert_one_row_per_sample(out, rows)
    end = im_end(tiny_target)
    for src, row in zip(rows, got):
        assert row["status"] == "ok" and row["failure_reason"] is None
        assert row["model"] == str(tiny_target)
        params = json.loads(row["sampling_params"])
        assert params["max_new_tokens"] == 16 and params["temperature"] == 0.8 and params["turns"] == "all"
        users = [m["content"] for m in src["messages"] if m["role"] == "user"]
        assert [m["content"] for m in row["messages"] if m["role"] == "user"] == users
        n_assist = sum(m["role"] == "assistant" for m in row["messages"])
        assert n_assist == row["generated_turns"] == sum(m["role"] == "assistant" for m in src["messages"])
        assert row["messages"][-1]["role"] == "assistant" and row["messages"][-1]["content"] != "OK."
        assert row["completion_tokens"] > 0 and row["prompt_tokens"] > 0
        # the target's own ids, one list per generated turn, the end token included when it stopped
        assert len(row["output_ids"]) == row["generated_turns"]
        assert sum(map(len, row["output_ids"])) == row["completion_tokens"]
        last = row["output_ids"][-1]
        assert (last[-1] == end) == (row["finish_reason"] == "stop")
    summary = read_summary(out)
    assert summary["samples"] == 24 and summary["ok"] == 24 and summary["this_run"]["requests"] >= 24


def im_end(model_dir) -> int:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir).convert_tokens_to_ids("<|im_end|>")


@functools.lru_cache(maxsize=1)
def _model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir).eval()


def greedy_continuation(model_dir, prompt_ids: list[int], n: int) -> list[int]:
    """What the target emits greedily after `prompt_ids`, through its end token."""
    import torch

    model = _model(model_dir)
    end = im_end(model_dir)
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False, eos_token_id=end,
                             pad_token_id=end)
    new = out[0, len(prompt_ids):].tolist()
    return new[: new.index(end) + 1] if end in new else new


def test_chat_with_model_engine_and_generate_api(tmp_path, tiny_target):
    """The test server backed by the tiny model, through both /v1/chat/completions and /generate; the stored
    ids are exactly the target's own greedy stream: prompt_ids + output_ids."""
    rows = write_shard(tmp_path / "in.parquet", 6, seed=2)
    with SGLangTestServer(tiny_target, "--reasoning-parser", "qwen3") as server:
        for api in ("chat", "generate"):
            out = tmp_path / api / "s-00000.parquet"
            gen(tmp_path / "in.parquet", out, "--backend", "servers", "--servers", server.url, "--api", api,
                "--model", tiny_target, "--max-new-tokens", "8", "--temperature", "0")
            got = assert_one_row_per_sample(out, rows)
            assert all(r["status"] == "ok" and r["model"] == str(tiny_target) for r in got)
            assert all(r["completion_tokens"] > 0 for r in got)
            assert all(r["finish_reason"] in ("stop", "length") for r in got)
            for r in got[:2]:
                ids = r["output_ids"][-1]
                assert ids and greedy_continuation(tiny_target, r["prompt_ids"], 8) == ids


def test_turns_all_continue_from_the_models_own_answers(tmp_path, tiny_target):
    multi = [[{"role": "system", "content": "Be brief.", "reasoning_content": None},
              {"role": "user", "content": f"Question {i}?", "reasoning_content": None},
              {"role": "assistant", "content": "OK.", "reasoning_content": None},
              {"role": "user", "content": "And then?", "reasoning_content": None},
              {"role": "assistant", "content": "OK.", "reasoning_content": None},
              {"role": "user", "content": "Last one", "reasoning_content": None}] for i in range(4)]
    rows = write_shard(tmp_path / "in.parquet", 4, seed=3, extra=multi)
    with SGLangTestServer(tiny_target, "--reasoning-parser", "qwen3", engine="instant") as server:
        for turns in ("first", "all"):
            out = tmp_path / turns / "s-00000.parquet"
            gen(tmp_path / "in.parquet", out, "--backend", "servers", "--servers", server.url, "--turns", turns)
            got = assert_one_row_per_sample(out, rows)
            assert_answers_belong(got)  # checks the thinking too: reasoning_content is stored separately
            by_id = {r["sample_id"]: r for r in got}
            for conv in multi:
                row = by_id[rows[[r["messages"] for r in rows].index(conv)]["sample_id"]]
                roles = [m["role"] for m in row["messages"]]
                if turns == "first":
                    assert roles == ["system", "user", "assistant"]
                else:  # 2 original assistant turns replaced + an answer to the trailing user turn
                    assert roles == ["system", "user", "assistant", "user", "assistant", "user", "assistant"]
                    assert row["generated_turns"] == 3
                    assert all(m["content"] != "OK." for m in row["messages"])


@pytest.mark.parametrize("policy", ["keep", "drop", "retry"])
def test_finish_reason_length_policy(tmp_path, tiny_target, policy):
    rows = write_shard(tmp_path / "in.parquet", 8, seed=4)
    out = tmp_path / "s-00000.parquet"
    with SGLangTestServer(tiny_target, "--reasoning-parser", "qwen3", engine="instant",
                          answer_words=12) as server:
        gen(tmp_path / "in.parquet", out, "--backend", "servers", "--servers", server.url, "--max-new-tokens", "5",
            "--on-length", policy, "--length-retry-max-new-tokens", "32")
    got = assert_one_row_per_sample(out, rows)
    summary = read_summary(out)
    assert summary["this_run"]["length"] == 8  # every first answer was cut: counted, whatever the policy
    if policy == "keep":
        assert all(r["status"] == "ok" and r["finish_reason"] == "length" for r in got)
        assert all(len(r["messages"][-1]["content"].split()) == 5 for r in got)
        assert summary["finish_reason_length"] == 8
    elif policy == "drop":
        assert all(r["status"] == "failed" and r["failure_reason"].startswith("finish_reason=length") for r in got)
        assert all(all(m["role"] != "assistant" for m in r["messages"]) for r in got)  # never training data
    else:
        assert all(r["status"] == "ok" and r["finish_reason"] == "stop" and r["attempts"] == 2 for r in got)
        assert_answers_belong(got)


def test_permanent_failures_recorded_once_and_empty_answers_counted(tmp_path, tiny_target):
    long = [[{"role": "user", "content": " ".join(["word"] * 80), "reasoning_content": None},
             {"role": "assistant", "content": "OK.", "reasoning_content": None}]]
    rows = write_shard(tmp_path / "in.parquet", 6, seed=5, extra=long)
    out = tmp_path / "s-00000.parquet"
    with SGLangTestServer(tiny_target, "--context-length", "40", engine="instant") as server:
        gen(tmp_path / "in.parquet", out, "--backend", "servers", "--servers", server.url)
        got = assert_one_row_per_sample(out, rows)
        bad = [r for r in got if r["status"] == "failed"]
        assert len(bad) == 1 and bad[0]["failure_reason"].startswith("prompt too long")
        assert bad[0]["attempts"] == 1  # not retried
        # a rerun does not send it again
        out.unlink()
        gen(tmp_path / "in.parquet", out, "--backend", "servers", "--servers", server.url)
        assert read_summary(out)["this_run"]["requests"] == 0
    out2 = tmp_path / "empty" / "s-00000.parquet"
    with SGLangTestServer(tiny_target, engine="instant", fault_rate=1.0, faults="empty") as server:
        gen(tmp_path / "in.parquet", out2, "--backend", "servers", "--servers", server.url, "--empty-retries", "1")
    got = assert_one_row_per_sample(out2, rows)
    assert all(r["status"] == "failed" and r["failure_reason"].startswith("empty response") for r in got)
    summary = read_summary(out2)
    assert summary["this_run"]["empty"] == 2 * len(rows)  # counted, retried once, then failed
    assert summary["failed"] == len(rows)


def test_a_server_that_rejects_everything_stops_the_run(tmp_path, tiny_target):
    rows = write_shard(tmp_path / "in.parquet", 40, seed=12)
    out = tmp_path / "s-00000.parquet"
    with SGLangTestServer(tiny_target, engine="instant", fault_rate=1.0, faults="400") as server:
        proc = gen(tmp_path / "in.parquet", out, "--backend", "servers", "--servers", server.url, check=False)
    assert proc.returncode == 2 and "rejects most requests" in proc.stderr and "does not exist" in proc.stderr
    assert not out.exists()  # no shard full of failures; the journal's rejections are retried by a rerun
    with SGLangTestServer(tiny_target, "--reasoning-parser", "qwen3", engine="instant") as server:
        gen(tmp_path / "in.parquet", out, "--backend", "servers", "--servers", server.url)
    assert_answers_belong(assert_one_row_per_sample(out, rows))


def test_twenty_percent_faults_all_complete(tmp_path, tiny_target):
    rows = write_shard(tmp_path / "in.parquet", 60, seed=6)
    out = tmp_path / "s-00000.parquet"
    stats = tmp_path / "stats.json"
    with SGLangTestServer(tiny_target, "--reasoning-parser", "qwen3", engine="instant", fault_rate=0.2,
                          faults="500,503,drop,truncate,delay,abort", fault_delay=3, stats_file=stats,
                          fault_seed=1) as server:
        gen(tmp_path / "in.parquet", out, "--backend", "servers", "--servers", server.url,
            "--request-timeout", "1", "--max-in-flight", "8", "--max-retries", "20")
    got = assert_one_row_per_sample(out, rows)
    assert_answers_belong(got)
    faults = json.loads(stats.read_text())["faults"]
    assert faults >= 5
    assert read_summary(out)["this_run"]["retries"] >= faults - 1


def test_dead_server_among_several(tmp_path, tiny_target):
    rows = write_shard(tmp_path / "in.parquet", 60, seed=7)
    out = tmp_path / "s-00000.parquet"
    never = f"http://user:tok3n@127.0.0.1:{free_port()}"  # nothing listens there; credentials never shown
    with SGLangTestServer(tiny_target, "--reasoning-parser", "qwen3", engine="instant", delay=0.01) as a, \
            SGLangTestServer(tiny_target, "--reasoning-parser", "qwen3", engine="instant", delay=0.01) as b, \
            SGLangTestServer(tiny_target, "--reasoning-parser", "qwen3", engine="instant", die_after=6) as dying:
        proc = gen(tmp_path / "in.parquet", out, "--backend", "servers", "--max-in-flight", "4",
                   "--servers", a.url, never, dying.url, b.url)
        assert dying.proc.wait(5) != 0  # it really died mid-run
    got = assert_one_row_per_sample(out, rows)
    assert_answers_belong(got)
    assert "taken out" in proc.stderr and never.replace("user:tok3n@", "***@") in proc.stderr
    assert "tok3n" not in proc.stderr


def _journal_lines(path: Path) -> int:
    return sum(1 for line in path.read_bytes().split(b"\n")[1:] if line.strip().endswith(b"}"))


def test_kill9_at_random_points_then_rerun_exactly_one_row_each(tmp_path, tiny_target):
    rows = write_shard(tmp_path / "in.parquet", 200, seed=8)
    out = tmp_path / "s-00000.parquet"
    journal = tmp_path / "journal" / "s-00000.jsonl"
    stats = tmp_path / "stats.json"
    rng = random.Random(0)
    cmd = [str(BIN / "dflash-pipeline"), "generate", "--input", str(tmp_path / "in.parquet"), "--out", str(out),
           *FAST, "--backend", "servers", "--max-in-flight", "4", "--flush-every", "4", "--flush-interval", "0.2"]
    with SGLangTestServer(tiny_target, "--reasoning-parser", "qwen3", engine="instant", delay=0.1,
                          stats_file=stats) as server:
        cmd += ["--servers", server.url]
        kills = 0
        for trial in range(4):
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(rng.uniform(1.0, 3.0))
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                kills += 1
            proc.wait()
            done_before = _journal_lines(journal) if journal.exists() else 0
            assert done_before <= len(rows)
        assert kills >= 2, "the runs finished before they could be killed: slow the server down"
        posts_before = json.loads(stats.read_text())["posts"]
        done_in_journal = len({json.loads(l)["sample_id"] for l in journal.read_bytes().split(b"\n")[1:]
                               if l.strip().endswith(b"}")})
        run_cli(*cmd[1:])
        posts_rerun = json.loads(stats.read_text())["posts"] - posts_before
    got = assert_one_row_per_sample(out, rows)
    assert_answers_belong(got)
    summary = read_summary(out)
    assert summary["resumed_from_journal"] == done_in_journal
    assert posts_rerun == len(rows) - done_in_journal  # the rerun sent exactly the samples not yet done
    assert posts_before - done_in_journal <= kills * (4 + 4)  # a kill loses at most in flight + one batch


def test_journal_torn_tail_and_s3_mirror(tmp_path, monkeypatch):
    from moto.server import ThreadedMotoServer

    from dflash_pipeline.generation.journal import Journal

    port = free_port()
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    moto.start()
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
        monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
        import boto3

        boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}").create_bucket(Bucket="gen-journal")
        settings = {"model": "m", "t": 0.6}
        path = tmp_path / "j" / "s.jsonl"
        j = Journal(path, "s", settings, flush_every=3, mirror="s3://gen-journal/run/journal/s", mirror_interval_s=0.1)
        for i in range(7):
            j.add({"sample_id": f"id{i}", "status": "ok", "messages": []})
        j.close()
        with open(path, "ab") as fh:
            fh.write(b'{"sample_id": "id7", "sta')  # torn by a kill in the middle of a write
        j = Journal(path, "s", settings)
        assert sorted(j.done) == [f"id{i}" for i in range(7)]
        j.add({"sample_id": "id8", "status": "ok", "messages": []})
        j.close()
        assert sorted(Journal(path, "s", settings).done) == [f"id{i}" for i in range(7)] + ["id8"]
        # a lost node: the local journal is gone, the mirror brings back everything it had
        path.unlink()
        j = Journal(path, "s", settings, mirror="s3://gen-journal/run/journal/s")
        assert sorted(j.done) == [f"id{i}" for i in range(7)]
        j.close()
        # other settings never reuse the mirror's records
        other = tmp_path / "k" / "s.jsonl"
        assert Journal(other, "s", {"model": "other"}, mirror="s3://gen-journal/run/journal/s").done == {}
    finally:
        moto.stop()


def test_sglang_backend_launches_and_always_stops_its_server(tmp_path, tiny_target):
    """The sglang backend's launcher, with the SGLang stand-in as the launch command (same code path, flags
    parsed strictly by both); test knobs reach the server through its environment."""
    rows = write_shard(tmp_path / "in.parquet", 20, seed=9)
    out = tmp_path / "s-00000.parquet"
    stats = tmp_path / "stats.json"
    env = {**os.environ, **knob_env(engine="instant", delay=0.3, stats_file=stats, startup_delay=0.5),
           "DFLASH_GENERATE_API_KEY": "s3cret-token"}  # the launcher passes it as --api-key, the client sends it
    cfg = {"launch_command": [sys.executable, str(SERVER)], "reasoning_parser": "qwen3", "mem_fraction_static": 0.8,
           "context_length": 4096, "instances": 2, "max_in_flight": 2, "startup_timeout_s": 60,
           "mamba_radix_cache_strategy": "extra_buffer"}
    args = ["--backend", "sglang", "--model", str(tiny_target), "--sglang-json", json.dumps(cfg),
            "--server-log-dir", str(tmp_path / "logs"), "--devices", "0,1"]
    cmd = [str(BIN / "dflash-pipeline"), "generate", "--input", str(tmp_path / "in.parquet"), "--out", str(out),
           *FAST, *args]
    # 1. SIGTERM in the middle: the servers go down with the job
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 60
    while not stats.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    pid = json.loads(stats.read_text())["pid"]
    proc.send_signal(signal.SIGTERM)
    err = proc.communicate(timeout=60)[1]
    assert proc.returncode != 0 and not out.exists()
    time.sleep(0.5)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    logs = sorted((tmp_path / "logs").glob("server-*.log"))
    assert len(logs) == 2  # two instances, one log each
    assert "--mem-fraction-static 0.8" in err and "--reasoning-parser qwen3" in err
    assert "--mamba-radix-cache-strategy extra_buffer" in err
    assert "--api-key ***" in err and "s3cret-token" not in err  # a secret flag's value is never logged
    # 2. the rerun completes from the journal and stops its servers on success
    stats.unlink()
    done = run_cli(*cmd[1:], env=env)
    got = assert_one_row_per_sample(out, rows)
    assert_answers_belong(got)
    pid = json.loads(stats.read_text())["pid"]
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert "healthy" in done.stderr
    # 3. a server that cannot start: a clear error with its log, and nothing left running
    bad = dict(cfg, launch_command=[sys.executable, "-c", "import sys; print('boom: no GPU'); sys.exit(3)"])
    proc = run_cli("generate", "--input", tmp_path / "in.parquet", "--out", tmp_path / "bad.parquet", *FAST,
                   *args[:4], "--sglang-json", json.dumps(bad), "--server-log-dir", tmp_path / "badlogs",
                   check=False)
    assert proc.returncode == 2 and "exited with code 3" in proc.stderr and "boom: no GPU" in proc.stderr


@pytest.mark.parametrize("extra, named", [
    (["--mamba-scheduler-strategy", "extra_buffer"], "--mamba-scheduler-strategy is not a launch flag of SGLang "
                                                     "0.5.23 (did you mean --mamba-radix-cache-strategy?)"),
    (["--dp-size", "two"], "--dp-size 'two': not a number"),
    (["--mamba-radix-cache-strategy", "lazy"], "accepts one of auto, no_buffer, extra_buffer, extra_buffer_lazy"),
])
def test_sglang_flags_are_checked_before_launching(tmp_path, tiny_target, extra, named):
    """A flag SGLang 0.5.23 does not have (or a value it refuses) fails at once, naming it, before any server
    starts; the stand-in itself refuses unknown flags as launch_server does (argparse, exit status 2)."""
    write_shard(tmp_path / "in.parquet", 2, seed=9)
    cfg = {"launch_command": [sys.executable, str(SERVER)], "extra_args": extra}
    proc = run_cli("generate", "--input", tmp_path / "in.parquet", "--out", tmp_path / "o.parquet", "--backend",
                   "sglang", "--model", tiny_target, "--sglang-json", json.dumps(cfg), "--server-log-dir",
                   tmp_path / "logs", check=False)
    assert proc.returncode == 2 and named in proc.stderr, proc.stderr
    assert not (tmp_path / "logs").exists()  # nothing was launched
    server = subprocess.run([sys.executable, str(SERVER), "--model-path", str(tiny_target), *extra],
                            capture_output=True, text=True, timeout=60)
    assert server.returncode == 2 and ("unrecognized arguments" in server.stderr or "invalid" in server.stderr)


def test_several_shards_share_one_engine(tmp_path, tiny_target):
    shards = [write_shard(tmp_path / f"in{i}.parquet", 10 + i, seed=20 + i) for i in range(3)]
    outs = [tmp_path / "out" / f"src-{i:05d}.parquet" for i in range(3)]
    with SGLangTestServer(tiny_target, "--reasoning-parser", "qwen3", engine="instant") as server:
        run_cli("generate", "--input", *[tmp_path / f"in{i}.parquet" for i in range(3)], "--out", *outs, *FAST,
                "--backend", "servers", "--servers", server.url)
        for rows, out in zip(shards, outs):
            assert_answers_belong(assert_one_row_per_sample(out, rows))
            assert read_summary(out)["samples"] == len(rows)
        # other sampling settings: the old journal is set aside, never mixed in
        run_cli("generate", "--input", tmp_path / "in0.parquet", "--out", outs[0], *FAST, "--backend", "servers",
                "--servers", server.url, "--max-new-tokens", "7")
        assert read_summary(outs[0])["resumed_from_journal"] == 0
        assert list((outs[0].parent / "journal").glob("src-00000.jsonl.stale-*"))
        assert all(len(r["messages"][-1]["content"].split()) == 7 for r in read_completions(outs[0]))


def test_outputs_on_s3_mirror_the_journal_and_a_fresh_node_resumes(tmp_path, tiny_target):
    from moto.server import ThreadedMotoServer

    port = free_port()
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    moto.start()
    env = {**os.environ, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "test",
           "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}
    try:
        import boto3

        s3 = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-east-1",
                          aws_access_key_id="test", aws_secret_access_key="test")
        s3.create_bucket(Bucket="gen-out")
        rows = write_shard(tmp_path / "in.parquet", 30, seed=11)
        out = "s3://gen-out/results/completions/src-00000.parquet"
        with SGLangTestServer(tiny_target, "--reasoning-parser", "qwen3", engine="instant") as server:
            common = ["--backend", "servers", "--servers", server.url, "--mirror-interval", "0.2"]
            run_cli("generate", "--input", tmp_path / "in.parquet", "--out", out, *FAST, *common,
                    "--journal-dir", tmp_path / "node1", env=env)
            keys = [o["Key"] for o in s3.list_objects_v2(Bucket="gen-out")["Contents"]]
            assert "results/completions/src-00000.parquet" in keys
            assert "results/completions/src-00000.summary.json" in keys
            assert any(k.startswith("results/completions/journal/src-00000/part-") for k in keys)
            # a fresh node (no local journal) restores it from the mirror and generates nothing again
            s3.delete_object(Bucket="gen-out", Key="results/completions/src-00000.parquet")
            done = run_cli("generate", "--input", tmp_path / "in.parquet", "--out", out, *FAST, *common,
                           "--journal-dir", tmp_path / "node2", env=env)
            assert "restoring 30 journal records" in done.stderr
        body = s3.get_object(Bucket="gen-out", Key="results/completions/src-00000.summary.json")["Body"].read()
        summary = json.loads(body)
        assert summary["resumed_from_journal"] == 30 and summary["this_run"]["requests"] == 0
        table = pq.read_table(pa_buffer(s3.get_object(Bucket="gen-out", Key="results/completions/src-00000.parquet")))
        assert table.column("sample_id").to_pylist() == [r["sample_id"] for r in rows]
    finally:
        moto.stop()


def pa_buffer(obj):
    import pyarrow as pa

    return pa.BufferReader(obj["Body"].read())


def test_workflow_plans_one_generation_job_per_group_of_shards(tmp_path, tiny_target):
    """The real Snakefile with generate.shards_per_job = 2 plans one generation job per two shards (the job
    that runs several shards through one engine is tested above; the full run is the demo's)."""
    work = make_workdir(tmp_path / "wf", model=tiny_target)
    (work / "group.yaml").write_text("ingest:\n  shard_size: 12\ngenerate:\n  shards_per_job: 2\n")
    configs = ("tiny.yaml", "group.yaml")
    snakemake(work, "results/ingest/manifest.json", configfiles=configs)
    shards = [s["shard"] for s in json.loads((work / "results/ingest/manifest.json").read_text())["shards"]]
    groups = {s.rsplit("-", 1)[0] + "-g" + f"{int(s.rsplit('-', 1)[1]) // 2:05d}" for s in shards}
    assert len(groups) < len(shards)
    proc = snakemake(work, "-n", *[f"results/completions/{s}.parquet" for s in shards], configfiles=configs)
    out = proc.stdout + proc.stderr
    plan = planned(proc)
    assert plan["generate"] == len(groups) and plan["completions_from_group"] == len(shards), plan
    for g in groups:
        assert f"results/completions/groups/{g}" in out
    _killed_group_job_leaves_no_group_directory(work, configs, sorted(shards)[:2])


def _killed_group_job_leaves_no_group_directory(work, configs, members):
    """SIGKILL Snakemake and a generate job (no cleanup) once the job has written its first shard: the
    group's directory must not exist (on the H200 a killed group's half-filled directory was taken for
    complete by the next run), and the rerun completes every shard of the group."""
    group = members[0].rsplit("-", 1)[0] + "-g00000"
    partial = work / f"results/completions/groups/{group}.partial"
    targets = [f"results/completions/{s}.parquet" for s in members]
    cmd = [str(BIN / "snakemake"), *targets, "--profile", "profiles/local", "--cores", "1", "--configfile", *configs]
    proc = subprocess.Popen(cmd, cwd=work, env=workflow_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    final = work / f"results/completions/groups/{group}"
    written = lambda: list(partial.glob("*.parquet")) + list(final.glob("*.parquet"))  # noqa: E731
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None and not written():
        time.sleep(0.05)
    assert proc.poll() is None, "the group job ended before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert written(), "killed before the group's first shard was written"
    assert not final.exists(), f"a killed group job left {sorted(p.name for p in final.iterdir())}"
    snakemake(work, "--unlock", configfiles=configs)
    snakemake(work, *targets, configfiles=configs)
    assert all((work / t).exists() for t in targets)
    assert not partial.exists()


# ------------------------------------------------------------------------------------------------------
# the SGLang 0.5.23 contract: aborts, context overflow, seeds, errors, identity (issue 12), hostile inputs (14)
# ------------------------------------------------------------------------------------------------------
def test_abort_with_http_200_is_a_transient_failure_with_its_reason(tmp_path, tiny_target):
    rows = write_shard(tmp_path / "in.parquet", 4, seed=30)
    out = tmp_path / "s-00000.parquet"
    with SGLangTestServer(tiny_target, engine="instant", fault_rate=1.0, faults="abort") as server:
        for api in ("chat", "generate"):
            gen(tmp_path / "in.parquet", out, "--backend", "servers", "--servers", server.url, "--api", api,
                "--model", tiny_target, "--max-retries", "2")
            got = assert_one_row_per_sample(out, rows)
            assert all(r["status"] == "failed" and r["attempts"] == 3 for r in got)  # retried, then given up
            assert all("finish_reason=abort" in r["failure_reason"] for r in got)
            assert all(all(m["role"] != "assistant" for m in r["messages"]) for r in got)
            if api == "generate":  # SGLang's abort message travels with the reason
                assert all("Abort in waiting queue" in r["failure_reason"] for r in got)
            summary = read_summary(out)
            assert summary["this_run"]["aborted"] == 3 * len(rows)
            assert not summary["this_run"]["failed_permanent"]  # a rerun retries them
            out.unlink()


def test_context_overflow_caps_the_budget_and_keeps_earlier_turns(tmp_path, tiny_target):
    """The stand-in rejects prompt + max_new_tokens > context with SGLang's 400; the client asks again within
    the context (chat: from the error's numbers), and a later turn that cannot fit ends the conversation."""
    words = lambda n: " ".join(["word"] * n)  # noqa: E731 (instant engine: a token is a word)
    msg = lambda role, text: {"role": role, "content": text, "reasoning_content": None}  # noqa: E731
    fits = [[msg("user", words(20)), msg("assistant", "OK.")]]
    later_too_long = [[msg("user", words(10)), msg("assistant", "OK."), msg("user", words(40)), msg("assistant", "OK.")]]
    rows = write_shard(tmp_path / "in.parquet", 0, seed=31, extra=fits + later_too_long)
    out = tmp_path / "s-00000.parquet"
    stats = tmp_path / "stats.json"
    with SGLangTestServer(tiny_target, "--reasoning-parser", "qwen3", "--context-length", "40", engine="instant",
                          answer_words=30, stats_file=stats) as server:
        gen(tmp_path / "in.parquet", out, "--backend", "servers", "--servers", server.url, "--turns", "all",
            "--max-new-tokens", "64", "--max-in-flight", "1")
    one, two = assert_one_row_per_sample(out, rows)
    assert one["status"] == "ok" and one["finish_reason"] == "length"
    assert len(one["messages"][-1]["content"].split()) == 40 - 20  # capped to the context left
    assert two["status"] == "ok" and two["generated_turns"] == 1  # turn 2 (50 prompt words) cannot fit: kept 1
    assert [m["role"] for m in two["messages"]] == ["user", "assistant"]
    assert read_summary(out)["this_run"]["truncated"] == 1
    budgets = json.loads(stats.read_text())["budgets"]
    assert budgets[:2] == [64, 20]  # the 400, then the same request within the context


def test_generate_api_caps_before_sending_and_records_seeds(tmp_path, tiny_target):
    """/generate: the prompt ids are known here, so the budget is capped before sending (the context comes from
    /v1/models max_model_len); every request carries its sample's seed, recorded in sampling_params."""
    from dflash_pipeline.generation.client import sample_seed

    rows = write_shard(tmp_path / "in.parquet", 6, seed=32)
    out = tmp_path / "s-00000.parquet"
    stats = tmp_path / "stats.json"
    with SGLangTestServer(tiny_target, "--context-length", "100", engine="instant", stats_file=stats) as server:
        gen(tmp_path / "in.parquet", out, "--backend", "servers", "--servers", server.url, "--api", "generate",
            "--model", tiny_target, "--max-new-tokens", "5000", "--seed", "7")
    got = assert_one_row_per_sample(out, rows)
    sent = json.loads(stats.read_text())
    assert len(sent["budgets"]) == len(rows)  # one request each: no 400 round trip
    assert all(b == 100 - len(r["prompt_ids"]) for b, r in zip(sorted(sent["budgets"]), sorted(
        got, key=lambda r: 100 - len(r["prompt_ids"]))))
    seeds = [json.loads(r["sampling_params"])["seed"] for r in got]
    assert seeds == [sample_seed(7, r["sample_id"]) for r in got] and len(set(seeds)) == len(rows)
    assert sorted(sent["seeds"]) == sorted(seeds)
    assert all(r["output_ids"] and r["output_ids"][-1][-1] == 2 for r in got)  # the stand-in's end id


def test_generate_errors_and_credentials_never_stored(tmp_path, tiny_target):
    """/generate's {"error": {"message"}} body is read (the reason names it); a server URL with user:token@
    appears nowhere: not in failure_reason, the journal or the log."""
    rows = write_shard(tmp_path / "in.parquet", 20, seed=33)
    out = tmp_path / "s-00000.parquet"
    with SGLangTestServer(tiny_target, engine="instant", fault_rate=1.0, faults="400") as server:
        proc = gen(tmp_path / "in.parquet", out, "--backend", "servers", "--api", "generate", "--model", tiny_target,
                   "--servers", server.url, check=False)
    assert proc.returncode == 2 and "The model `nonexistent` does not exist." in proc.stderr
    with SGLangTestServer(tiny_target, engine="instant", fault_rate=1.0, faults="500") as server:
        url = server.url.replace("http://", "http://alice:s3cr3t@")
        proc = gen(tmp_path / "in.parquet", out, "--backend", "servers", "--servers", url, "--max-retries", "1")
    got = assert_one_row_per_sample(out, rows)
    assert all(r["status"] == "failed" and "http://***@127.0.0.1" in r["failure_reason"] for r in got)
    journal = (tmp_path / "journal" / "s-00000.jsonl").read_text()
    assert "s3cr3t" not in journal and "s3cr3t" not in proc.stderr and "s3cr3t" not in out.read_bytes().decode("latin-1")


def test_journal_is_set_aside_when_the_weights_change(tmp_path, tiny_target):
    """Same path, other weights (a rebuilt target: new weight files) or another weight_version on the server:
    the old answers are never reused."""
    import shutil

    model = tmp_path / "target"
    shutil.copytree(tiny_target, model)
    rows = write_shard(tmp_path / "in.parquet", 5, seed=34)
    out = tmp_path / "s-00000.parquet"
    common = ["--backend", "servers", "--model", model]
    with SGLangTestServer(model, engine="instant") as server:
        gen(tmp_path / "in.parquet", out, *common, "--servers", server.url)
        weights = model / "model.safetensors"
        weights.write_bytes(weights.read_bytes() + b"\0")  # retrained / rebuilt in the same directory
        gen(tmp_path / "in.parquet", out, *common, "--servers", server.url)
        assert read_summary(out)["resumed_from_journal"] == 0
    with SGLangTestServer(model, "--weight-version", "v2", engine="instant") as server:
        gen(tmp_path / "in.parquet", out, *common, "--servers", server.url)
        assert read_summary(out)["resumed_from_journal"] == 0
    assert len(list((tmp_path / "journal").glob("s-00000.jsonl.stale-*"))) >= 1


def test_bad_journal_lines_are_quarantined_and_the_run_goes_on(tmp_path, tiny_target):
    rows = write_shard(tmp_path / "in.parquet", 10, seed=35)
    out = tmp_path / "s-00000.parquet"
    journal = tmp_path / "journal" / "s-00000.jsonl"
    with SGLangTestServer(tiny_target, "--reasoning-parser", "qwen3", engine="instant") as server:
        gen(tmp_path / "in.parquet", out, "--backend", "servers", "--servers", server.url)
        lines = journal.read_bytes().split(b"\n")
        header, records = lines[0], [l for l in lines[1:] if l]
        bad = [b"\x00garbage{{", b'{"status": "ok", "messages": []}', b"[1, 2, 3]", header,
               json.dumps({"sample_id": rows[0]["sample_id"], "status": "ok"}).encode()]  # an older record format
        kept = records[5:]
        journal.write_bytes(b"\n".join([header] + bad[:3] + kept[:2] + bad[3:] + kept[2:]) + b"\n")
        out.unlink()
        proc = gen(tmp_path / "in.parquet", out, "--backend", "servers", "--servers", server.url)
        assert_answers_belong(assert_one_row_per_sample(out, rows))
        assert read_summary(out)["resumed_from_journal"] == 5  # the 5 valid records; the rest generated again
        quarantine = [json.loads(q) for q in
                      (tmp_path / "journal" / "s-00000.quarantine.jsonl").read_text().splitlines()]
        assert [q["reason"] for q in quarantine] == ["not JSON", "no sample_id", "a JSON list, not an object",
                                                     "a second header", "no messages list"]
        assert "5 bad journal line(s) quarantined" in proc.stderr
        again = gen(tmp_path / "in.parquet", out, "--backend", "servers", "--servers", server.url)
    assert read_summary(out)["resumed_from_journal"] == 10 and "quarantined" not in again.stderr  # clean now


def test_client_waits_through_warm_up_and_falls_back_to_get_model_info(tmp_path, tiny_target):
    """/health answers 503 during warm-up: the run waits for it (within --all-down-timeout) instead of failing;
    a server without /model_info is identified through /get_model_info."""
    rows = write_shard(tmp_path / "in.parquet", 3, seed=36)
    out = tmp_path / "s-00000.parquet"
    server = SGLangTestServer(tiny_target, "--reasoning-parser", "qwen3", "--served-model-name", "served-name",
                              engine="instant", startup_delay=4, without_model_info=1)
    try:
        proc = gen(tmp_path / "in.parquet", out, "--backend", "servers", "--servers", server.url,
                   "--all-down-timeout", "60")
    finally:
        server.stop()
    got = assert_one_row_per_sample(out, rows)
    assert_answers_belong(got)
    assert all(r["model"] == str(tiny_target) for r in got)  # model_path from /get_model_info
    assert "weight_version default" in proc.stderr


def test_api_key_from_the_environment_only(tmp_path, tiny_target):
    """A server started with --api-key answers 401 without it; the key comes from DFLASH_GENERATE_API_KEY (never
    a command line or the config) and is nowhere in the log, the journal or the shard."""
    rows = write_shard(tmp_path / "in.parquet", 20, seed=37)
    out = tmp_path / "s-00000.parquet"
    key = "sk-test-0123456789"
    with SGLangTestServer(tiny_target, "--reasoning-parser", "qwen3", "--api-key", key, engine="instant") as server:
        proc = gen(tmp_path / "in.parquet", out, "--backend", "servers", "--servers", server.url, check=False)
        assert proc.returncode == 2 and "HTTP 401" in proc.stderr and "Unauthorized" in proc.stderr
        proc = gen(tmp_path / "in.parquet", out, "--backend", "servers", "--servers", server.url,
                   env={**os.environ, "DFLASH_GENERATE_API_KEY": key})
    assert_answers_belong(assert_one_row_per_sample(out, rows))
    stored = (tmp_path / "journal" / "s-00000.jsonl").read_text() + out.read_bytes().decode("latin-1")
    assert key not in proc.stderr and key not in stored


def test_in_flight_follows_dp_replicas():
    from dflash_pipeline.generation.servers import requests_in_flight

    assert requests_in_flight({"max_running_requests": 64, "dp_size": 4}) == 256  # per DP replica
    assert requests_in_flight({"max_running_requests": 64, "dp_size": 4, "max_in_flight": 8}) == 8


def test_hf_sampling_is_seeded_per_sample_and_samples_the_right_distribution(tiny_target):
    """The hf engine's sampling: a sample's tokens depend on its seed only (not on the batch it is in),
    different seeds differ, and the first token's frequencies over many seeds follow the target's
    temperature / top-k / top-p distribution (total variation distance)."""
    import asyncio

    import torch

    from dflash_pipeline.generation.client import SamplingParams
    from dflash_pipeline.generation.engines import HFEngine

    prompts = [[{"role": "user", "content": f"Question {i}: {'why ' * i}?"}] for i in range(6)]
    params = [SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=100 + i) for i in range(6)]

    async def run(batch_size, prompts, params, budget):
        engine = HFEngine(str(tiny_target), batch_size=batch_size, threads=1, max_wait_s=0.2)
        await engine.start()
        try:
            results = await asyncio.gather(*(engine.complete(m, p, budget) for m, p in zip(prompts, params)))
        finally:
            await engine.close()
        return engine, [r.output_ids for r in results]

    _, together = asyncio.run(run(6, prompts, params, 12))
    _, alone = asyncio.run(run(1, prompts, params, 12))
    assert together == alone and len({tuple(ids) for ids in together}) == 6
    n = 600
    engine, firsts = asyncio.run(run(n, prompts[:1] * n, [SamplingParams(temperature=0.8, top_p=0.9, top_k=20,
                                                                         seed=s) for s in range(n)], 1))
    ids = torch.tensor([engine.render(prompts[0], True)])
    with torch.inference_mode():
        logits = engine.model(ids).logits[0, -1] / 0.8
    top = torch.softmax(logits, -1).topk(20)
    q = top.values / top.values.sum()  # top-k, then top-p over the renormalized top-k (transformers' order)
    keep = (q.cumsum(0) - q) < 0.9
    want = q[keep] / q[keep].sum()
    counts = torch.bincount(torch.tensor([f[0] for f in firsts]), minlength=logits.numel()).double()
    assert counts.sum() == counts[top.indices[keep]].sum()  # nothing outside top-k / top-p is ever drawn
    observed, expected = counts[top.indices[keep]], want.double() * n
    chi2 = (((observed - expected) ** 2) / expected).sum().item()
    df = int(keep.sum()) - 1
    assert chi2 < df + 4.5 * (2 * df) ** 0.5  # far beyond the 99.9% quantile of chi-square(df) would fail


def test_hf_length_sorted_batches_bound_the_cache_and_keep_every_request():
    from dflash_pipeline.generation.engines import length_sorted_batches

    items = [([0] * n, b, f"r{i}") for i, (n, b) in enumerate([(50, 10), (5, 10), (300, 20), (20, 40), (7, 10)])]
    batches = length_sorted_batches(items, 200)
    assert sorted(it[2] for b in batches for it in b) == sorted(it[2] for it in items)  # each exactly once
    for b in batches:
        lengths = [len(it[0]) for it in b]
        assert lengths == sorted(lengths)
        assert len(b) == 1 or len(b) * (max(lengths) + max(it[1] for it in b)) <= 200
    assert [len(it[0]) for it in batches[0]] == [5, 7, 20]  # 3 x (20 + 40) = 180; a fourth row would not fit
    assert length_sorted_batches(items, None) == [sorted(items, key=lambda it: len(it[0]))]


def test_counter_uniform_is_a_function_of_seed_step_and_token():
    """The hf sampling noise: a row's uniforms depend on its seed and step only (not on the rows beside it),
    lie in (0, 1), differ across seeds and steps, and look uniform."""
    import torch

    from dflash_pipeline.generation.engines import counter_uniform

    alone = counter_uniform(torch.tensor([7]), 3, 5000)
    beside = counter_uniform(torch.tensor([1, 7, 2 ** 62]), 3, 5000)
    assert torch.equal(alone[0], beside[1])
    assert not torch.equal(beside[0], beside[1]) and not torch.equal(alone, counter_uniform(torch.tensor([7]), 4, 5000))
    u = counter_uniform(torch.arange(64), 0, 4096).flatten()
    assert 0 < float(u.min()) and float(u.max()) < 1
    ks = (u.sort().values - torch.linspace(0, 1, u.numel(), dtype=torch.float64)).abs().max()
    assert float(ks) < 1.95 / u.numel() ** 0.5 * 1.5  # Kolmogorov-Smirnov, far inside a 0.1% test


def test_hf_wide_length_sorted_batches_answer_as_one_row_at_a_time(tiny_target):
    """max_batch_tokens cuts the waiting requests into length-sorted batches; a batch runs to its largest budget
    and each row is cut to its own: greedy answers equal those of one request at a time."""
    import asyncio

    from dflash_pipeline.generation.client import SamplingParams
    from dflash_pipeline.generation.engines import HFEngine

    prompts = [[{"role": "user", "content": "why " * (1 + 7 * i % 11)}] for i in range(7)]
    budgets = [3, 9, 5, 9, 2, 7, 4]
    params = SamplingParams(temperature=0.0, top_p=1.0, top_k=0, seed=0)

    async def run(**kw):
        engine = HFEngine(str(tiny_target), threads=1, max_wait_s=0.2, **kw)
        await engine.start()
        try:
            return await asyncio.gather(*(engine.complete(m, params, b) for m, b in zip(prompts, budgets)))
        finally:
            await engine.close()

    wide = asyncio.run(run(batch_size=7, max_batch_tokens=160))
    single = asyncio.run(run(batch_size=1))
    assert [r.output_ids for r in wide] == [r.output_ids for r in single]
    assert all(r.completion_tokens <= b for r, b in zip(wide, budgets))
    assert [r.finish_reason for r in wide] == [r.finish_reason for r in single]
