"""Regenerating tool-calling conversations: the chat requests carry the sample's tools and its earlier calls and
results in OpenAI's form, the SGLang stand-in answers calls in SGLang 0.5.23's shape (launched through the sglang
backend with --tool-call-parser), calls are stored parsed; `turns: all` keeps the original tool results and cuts
the conversation where the target calls other tools; malformed arguments fail with their reason; the hf backend
refuses tool samples in one line where the template has no tool layout. End to end: an OpenAI and a ShareGPT
(LLaMA-Factory) tool-calling record go through ingest -> generate (stand-in SGLang; hf) -> tokenize -> extract ->
offline train, the masks checked against the template's rendering."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import run_cli
from generation_helpers import SERVER, SGLangTestServer, read_completions, read_summary, write_shard
from dflash_pipeline.data.conversations import SAMPLE_SCHEMA, sample_id
from dflash_pipeline.errors import PipelineError
from dflash_pipeline.generation import servers, sglang_flags
from dflash_pipeline.generation.client import chat_messages
from dflash_pipeline.generation.tool_calls import ToolCallError, parse_tool_calls
from sglang_test_server import instant_answer

FAST = ["--backoff-base", "0.02", "--backoff-max", "0.2", "--revive-after", "0.5", "--progress-interval", "0.5",
        "--max-new-tokens", "64"]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}},
         {"type": "function", "function": {"name": "search_web", "description": "Search the web",
                                           "parameters": {"type": "object",
                                                          "properties": {"query": {"type": "string"}}}}}]
CALL_ID = re.compile(r"^call_[0-9a-f]{24}$")  # SGLang 0.5.23: f"call_{uuid.uuid4().hex[:24]}"


def msg(role, content, **tool) -> dict:
    return {"role": role, "content": content, "reasoning_content": None, "tool_calls": None, "tool_call_id": None,
            "name": None, **tool}


def call(name: str, args: dict, cid: str = "c1") -> str:
    return json.dumps([{"id": cid, "type": "function", "function": {"name": name, "arguments": args}}])


def conversation(asks: str, called: str | None, final: str = "It is sunny.") -> list[dict]:
    """user -> assistant (calls `called`, or answers) -> tool result -> assistant, as ingest stores it."""
    if called is None:
        return [msg("user", asks), msg("assistant", "I can answer that myself."), msg("user", "Thanks!"),
                msg("assistant", "You are welcome.")]
    return [msg("user", asks), msg("assistant", "", tool_calls=call(called, {"city": "Paris"})),
            msg("tool", '{"result": "sunny, 21 C"}', tool_call_id="c1", name=called), msg("assistant", final)]


def write_samples(path, conversations: list[list[dict]], chat_only: int = 3) -> list[dict]:
    rows = write_shard(path, chat_only, seed=5)
    rows = [{**r, "messages": [{**msg(m["role"], m["content"]), **m} for m in r["messages"]], "tools": None}
            for r in rows]
    for messages in conversations:
        text = json.dumps(TOOLS)
        rows.append({"sample_id": sample_id(messages, text), "source": "test", "source_id": None,
                     "messages": messages, "tools": text})
    pq.write_table(pa.Table.from_pylist(rows, schema=SAMPLE_SCHEMA), path)
    return rows


def sglang_generate(tmp_path, inp, out, *extra, parser: str | None = "qwen25", env_knobs: dict | None = None,
                    check=True):
    """`generate --backend sglang` with the stand-in as the launch command (the real launcher's code path)."""
    cfg = {"launch_command": [sys.executable, str(SERVER)], "reasoning_parser": "qwen3", "startup_timeout_s": 60,
           "tool_call_parser": parser}
    env = {**os.environ, "DFLASH_TEST_SERVER_ENGINE": "instant",
           **{f"DFLASH_TEST_SERVER_{k.upper()}": str(v) for k, v in (env_knobs or {}).items()}}
    return run_cli("generate", "--input", inp, "--out", out, *FAST, "--backend", "sglang", "--model",
                   tmp_path / "no-model", "--sglang-json", json.dumps(cfg), "--server-log-dir", tmp_path / "logs",
                   *extra, env=env, check=check)


def by_first_user(rows: list[dict]) -> dict:
    return {r["messages"][0]["content"]: r for r in rows}


def assert_chat_only_unchanged(rows: list[dict]) -> None:
    """Chat-only samples are answered exactly as before tool calling existed: no tools, no calls."""
    for row in rows:
        if row["tools"] is None:
            assert row["status"] == "ok" and row["cut_reason"] is None
            for i, m in enumerate(row["messages"]):
                assert m["tool_calls"] is None and m["tool_call_id"] is None
                if m["role"] == "assistant":
                    prior = [{"role": x["role"], "content": x["content"]} for x in row["messages"][:i]]
                    assert (m["reasoning_content"], m["content"]) == instant_answer(prior, 12)


# ------------------------------------------------------------------------------------------------------
def test_requests_carry_tools_and_calls_come_back_parsed(tmp_path):
    """turns: all on `user -> call -> result -> answer`: the target's call (SGLang's shape, arguments JSON
    text) is stored with its arguments as an object; the original tool result follows it, renamed to the
    call's id; the final answer is generated on the call and the result (the request carried both)."""
    (tmp_path / "no-model").mkdir()
    rows = write_samples(tmp_path / "in.parquet", [conversation("What is the weather? Use get_weather.",
                                                                "get_weather")])
    out = tmp_path / "out" / "s-00000.parquet"
    done = sglang_generate(tmp_path, tmp_path / "in.parquet", out, "--turns", "all")
    assert "--tool-call-parser qwen25" in done.stderr
    got = read_completions(out)
    assert [r["sample_id"] for r in got] == [r["sample_id"] for r in rows]
    assert_chat_only_unchanged(got)
    row = by_first_user(got)["What is the weather? Use get_weather."]
    assert row["status"] == "ok" and row["cut_reason"] is None and row["generated_turns"] == 2
    assert json.loads(row["tools"]) == TOOLS
    user, called, result, answer = row["messages"]
    calls = json.loads(called["tool_calls"])
    assert len(calls) == 1 and CALL_ID.match(calls[0]["id"]) and calls[0]["type"] == "function"
    assert calls[0]["function"]["name"] == "get_weather"
    key = re.match(r"city-(\w+)$", calls[0]["function"]["arguments"]["city"]).group(1)  # an object, not text
    assert called["content"] == "" and called["reasoning_content"] == f"thinking about {key}"
    assert result == msg("tool", '{"result": "sunny, 21 C"}', tool_call_id=calls[0]["id"], name="get_weather")
    # the final answer is the stand-in's answer to exactly this conversation (so the request held the result)
    sent = [{"role": m["role"], "content": m["content"]} for m in (user, called, result)]
    assert (answer["reasoning_content"], answer["content"]) == instant_answer(sent, 12)
    assert answer["tool_calls"] is None and row["finish_reason"] == "stop"
    assert len(row["output_ids"]) == 2 and row["output_ids"][0][-1] == 2  # the call's ids, through the end token
    assert read_summary(out)["ok"] == len(rows)


def test_turns_all_cuts_where_the_target_calls_another_tool_or_none(tmp_path):
    (tmp_path / "no-model").mkdir()
    other = conversation("Find it with search_web please.", "get_weather")     # target: search_web
    none_ = conversation("What is the weather like?", "get_weather")           # target: answers in text
    extra = conversation("Could you run get_weather for me?", None)            # target: calls where none was
    rows = write_samples(tmp_path / "in.parquet", [other, none_, extra])
    for turns in ("all", "first"):
        out = tmp_path / turns / "s-00000.parquet"
        sglang_generate(tmp_path, tmp_path / "in.parquet", out, "--turns", turns)
        got = by_first_user(read_completions(out))
        assert_chat_only_unchanged(list(got.values()))
        a, b, c = (got[conv[0]["content"]] for conv in (other, none_, extra))
        assert all(r["status"] == "ok" and r["generated_turns"] == 1 for r in (a, b, c))
        assert [m["role"] for m in a["messages"]] == ["user", "assistant"]  # nothing after the cut turn
        assert [x["function"]["name"] for x in json.loads(a["messages"][1]["tool_calls"])] == ["search_web"]
        assert b["messages"][1]["tool_calls"] is None and b["messages"][1]["content"]
        if turns == "first":  # nothing follows the first turn anyway: no cut to record
            assert a["cut_reason"] is b["cut_reason"] is c["cut_reason"] is None
            continue
        assert a["cut_reason"] == "turn 1: the target called search_web where the original called get_weather"
        assert b["cut_reason"] == "turn 1: the target called no tool where the original called get_weather"
        assert c["cut_reason"] == "turn 1: the target called get_weather where the original called no tool"
        assert read_summary(out)["this_run"]["cut"] == 3


@pytest.mark.parametrize("arguments, reason", [
    ("text", "arguments are not JSON"),
    ("string", "arguments are not a JSON object (a str)"),
])
def test_unstorable_arguments_fail_the_sample_with_the_reason(tmp_path, arguments, reason):
    (tmp_path / "no-model").mkdir()
    rows = write_samples(tmp_path / "in.parquet", [conversation("Use get_weather now.", "get_weather")])
    out = tmp_path / "s-00000.parquet"
    sglang_generate(tmp_path, tmp_path / "in.parquet", out, env_knobs={"tool_arguments": arguments})
    got = read_completions(out)
    assert_chat_only_unchanged(got)
    row = by_first_user(got)["Use get_weather now."]
    assert row["status"] == "failed" and reason in row["failure_reason"], row["failure_reason"]
    assert row["messages"] == [msg("user", "Use get_weather now.")] and row["output_ids"] is None
    summary = read_summary(out)
    assert summary["failed"] == 1 and summary["failure_reasons"] == {"tool call not stored": 1}
    assert summary["ok"] == len(rows) - 1


def test_servers_without_a_tool_call_parser_refuse_tool_samples(tmp_path):
    (tmp_path / "no-model").mkdir()
    write_samples(tmp_path / "in.parquet", [conversation("Use get_weather now.", "get_weather")])
    out = tmp_path / "s-00000.parquet"
    done = sglang_generate(tmp_path, tmp_path / "in.parquet", out, parser=None)
    assert not re.search(r"starting .*--tool-call-parser", done.stderr)  # the launch line
    got = read_completions(out)
    assert_chat_only_unchanged(got)
    row = by_first_user(got)["Use get_weather now."]
    assert row["status"] == "failed"
    assert row["failure_reason"] == ("the servers run without --tool-call-parser, so the target's calls would stay "
                                     "unparsed text: set generate.sglang.tool_call_parser (e.g. qwen25)")


CHAT_ONLY_TEMPLATE = ("{%- for m in messages -%}{{- '<|im_start|>' + m.role + '\\n' + (m.content or '') + "
                      "'<|im_end|>\\n' -}}{%- endfor -%}{%- if add_generation_prompt -%}"
                      "{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")


def test_hf_backend_refuses_tool_samples_in_one_line(tmp_path, tiny_target):
    """A target whose template has no <tool_call> layout (SmolLM2-like): its tool samples fail with one line."""
    model = tmp_path / "chat-only-target"
    shutil.copytree(tiny_target, model)
    (model / "chat_template.jinja").write_text(CHAT_ONLY_TEMPLATE)
    rows = write_samples(tmp_path / "in.parquet", [conversation("Use get_weather now.", "get_weather")])
    tool_id = rows[-1]["sample_id"]
    out = tmp_path / "s-00000.parquet"
    done = run_cli("generate", "--input", tmp_path / "in.parquet", "--out", out, *FAST, "--backend", "hf",
                   "--model", model, "--max-new-tokens", "4")
    got = {r["sample_id"]: r for r in read_completions(out)}
    assert all(r["status"] == "ok" for sid, r in got.items() if sid != tool_id)
    reason = got[tool_id]["failure_reason"]
    assert reason == (f"tools_unsupported: sample {tool_id} has tools or tool calls, which the hf backend cannot "
                      "regenerate (it reads calls only in Qwen's <tool_call> layout, and the target's chat template "
                      "has none); regenerate it with generate.backend: sglang (chat API) and "
                      "generate.sglang.tool_call_parser set for the target (e.g. qwen25)")
    warned = [line for line in done.stderr.splitlines() if "WARNING" in line and "tools_unsupported" in line]
    assert "\n" not in reason and len(warned) == 1 and reason in warned[0]  # one line, logged once
    assert read_summary(out)["failure_reasons"] == {"tools_unsupported": 1}


@pytest.mark.parametrize("engine", ["generate", "slots"])
def test_hf_backend_renders_tools_through_a_qwen_template(tmp_path, tiny_target, engine):
    """The tiny target's template has Qwen's layout: the prompt carries the tools; its (random) answer calls
    nothing where the original called get_weather, so turns: all ends the conversation there."""
    from transformers import AutoTokenizer

    rows = write_samples(tmp_path / "in.parquet", [conversation("Use get_weather now.", "get_weather")], chat_only=1)
    out = tmp_path / "s-00000.parquet"
    run_cli("generate", "--input", tmp_path / "in.parquet", "--out", out, *FAST, "--backend", "hf", "--model",
            tiny_target, "--engine", engine, "--batch-size", "4", "--max-new-tokens", "6", "--temperature", "0",
            "--turns", "all")
    row = {r["sample_id"]: r for r in read_completions(out)}[rows[-1]["sample_id"]]
    assert row["status"] == "ok" and [m["role"] for m in row["messages"]] == ["user", "assistant"]
    assert row["cut_reason"] == "turn 1: the target called no tool where the original called get_weather"
    tok = AutoTokenizer.from_pretrained(tiny_target)
    assert tok.decode(row["prompt_ids"]) == tok.apply_chat_template(
        [{"role": "user", "content": "Use get_weather now."}], tools=TOOLS, tokenize=False, add_generation_prompt=True)


def test_qwen_calls_are_parsed_as_sglangs_qwen25_parser_splits_them():
    from dflash_pipeline.generation.client import Completion, PermanentError
    from dflash_pipeline.generation.engines import with_tool_calls

    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "search_web", "arguments": {"query": "rain"}}\n</tool_call>')
    done = with_tool_calls(Completion(content=text, reasoning=None, finish_reason="stop"), TOOLS)
    assert done.content == "Let me check."
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in done.tool_calls] == [
        ("get_weather", {"city": "Paris"}), ("search_web", {"query": "rain"})]
    assert all(CALL_ID.match(c["id"]) for c in done.tool_calls)
    cut = with_tool_calls(Completion(content='Hm.\n<tool_call>\n{"name": "get_w', reasoning=None,
                                     finish_reason="length"), TOOLS)
    assert (cut.content, cut.tool_calls) == ("Hm.", None)  # a call cut by the budget: the text alone
    plain = with_tool_calls(Completion(content="<tool_call> is a tag", reasoning=None, finish_reason="stop"), None)
    assert plain.content == "<tool_call> is a tag" and plain.tool_calls is None  # no tools: nothing parsed
    with pytest.raises(PermanentError, match="tool call not stored: tool call 0: the <tool_call> block is not JSON"):
        with_tool_calls(Completion(content="<tool_call>\n{name: f}\n</tool_call>", reasoning=None,
                                   finish_reason="stop"), TOOLS)


# ------------------------------------------------------------------------------------------------------
def test_tool_call_parser_is_checked_against_sglangs_names(tmp_path, tiny_target):
    assert sglang_flags.choices("--tool-call-parser")[:1] == ["auto"]
    assert {"qwen", "qwen25", "qwen3_coder", "llama3", "hermes"} <= set(sglang_flags.choices("--tool-call-parser"))
    assert servers.sglang_command("m", {"tool_call_parser": "qwen25"})[-2:] == ["--tool-call-parser", "qwen25"]
    assert "--tool-call-parser" not in servers.sglang_command("m", {"tool_call_parser": None})
    with pytest.raises(PipelineError, match=r"--tool-call-parser 'qwen3': SGLang 0.5.23 accepts one of auto, "):
        servers.sglang_command("m", {"tool_call_parser": "qwen3"})  # qwen3 is a reasoning parser's name
    server = subprocess.run([sys.executable, str(SERVER), "--model-path", str(tiny_target), "--tool-call-parser",
                             "qwen3"], capture_output=True, text=True, timeout=60)
    assert server.returncode == 2 and "invalid choice: 'qwen3'" in server.stderr


def test_messages_on_the_wire_and_calls_parsed_back():
    stored = [msg("system", "S"), msg("user", "U"), msg("assistant", "", tool_calls=call("f", {"a": [1, "é"]})),
              msg("tool", "R", tool_call_id="c1", name="f")]
    assert chat_messages(stored) == [
        {"role": "system", "content": "S"}, {"role": "user", "content": "U"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": [1, "é"]}'}}]},
        {"role": "tool", "content": "R", "tool_call_id": "c1", "name": "f"}]
    assert chat_messages([{"role": "user", "content": "U", "reasoning_content": None}]) == [
        {"role": "user", "content": "U"}]  # chat-only: exactly as before
    sglang = [{"id": "call_0123456789abcdef01234567", "index": 0, "type": "function",
               "function": {"name": "f", "arguments": '{"x": 1}'}}]
    assert parse_tool_calls(sglang) == [{"id": "call_0123456789abcdef01234567", "type": "function",
                                         "function": {"name": "f", "arguments": {"x": 1}}}]
    assert parse_tool_calls(None) is None and parse_tool_calls([]) is None
    for bad, why in (([{"function": {"name": "f", "arguments": "{x"}}], "arguments are not JSON"),
                     ([{"function": {"name": "f", "arguments": "[1]"}}], "not a JSON object (a list)"),
                     ([{"function": {"arguments": "{}"}}], "has no function name")):
        with pytest.raises(ToolCallError, match=re.escape(why)):
            parse_tool_calls(bad)


# ------------------------------------------------------------------------------------------------------
# Both raw shapes end to end: ingest -> generate (stand-in SGLang; hf) -> tokenize -> extract -> train.
OPENAI_RECORD = {"id": "w1", "tools": TOOLS, "messages": [
    {"role": "user", "content": "Please use get_weather for Paris."},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_x", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_x", "content": '{"temp_c": 21}'},
    {"role": "assistant", "content": "It is 21 C in Paris."}]}
SHAREGPT_RECORD = {"id": "s1", "tools": json.dumps([TOOLS[0]["function"]]), "conversations": [  # LLaMA-Factory
    {"from": "human", "value": "How warm is it in Rome? Ask get_weather."},
    {"from": "function_call", "value": '{"name": "get_weather", "arguments": {"city": "Rome"}}'},
    {"from": "observation", "value": '{"temp_c": 25}'},
    {"from": "gpt", "value": "It is 25 C in Rome."}]}
CHAT_RECORD = {"id": "c1", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}
RESULTS = {"w1": '{"temp_c": 21}', "s1": '{"temp_c": 25}'}  # each tool record's original tool result
LEGS = ("first", "all", "hf")  # the stand-in SGLang with --turns first / all; the hf backend (turns: first)


def _ingested(root, records) -> str:
    """Raw records (both tool shapes and a chat one in one JSONL) through ingest and the manifest's writer."""
    from dflash_pipeline.data.ingest import ingest_file
    from dflash_pipeline.data.manifest import write_shard as write_manifest_shard

    raw = root / "raw.jsonl"
    raw.write_text("".join(json.dumps(r) + "\n" for r in records))
    stats = ingest_file(str(raw), str(root / "r.parquet"), str(root / "s.json"), str(root / "q.jsonl"))
    assert stats["kept"] == len(records) and stats["tool_calls"]["samples"] == 2, stats
    spec = {"shard": 0, "rows": [0, stats["kept"]], "drop": [], "samples": stats["kept"]}
    write_manifest_shard(str(root / "r.parquet"), spec, str(root / "shard.parquet"))
    return str(root / "shard.parquet")


@pytest.fixture(scope="module")
def regenerated(tiny_target, tmp_path_factory):
    """The three records through ingest, then each leg of LEGS (generate, tokenize) into root/<leg>/: the
    completions c-00000.parquet, the token shard t.parquet and its audit (returned per leg)."""
    from dflash_pipeline.data.tokenize import ShardTokenizer

    root = tmp_path_factory.mktemp("tool-pipeline")
    shard = _ingested(root, [OPENAI_RECORD, SHAREGPT_RECORD, CHAT_RECORD])
    common = ["--input", shard, *FAST, "--max-new-tokens", "96", "--temperature", "0"]
    with pytest.MonkeyPatch.context() as mp:  # module scope: before the autouse _no_hub fixture
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("TRANSFORMERS_OFFLINE", "1")
        with SGLangTestServer(tiny_target, "--reasoning-parser", "qwen3", "--tool-call-parser", "qwen25") as server:
            for turns in ("first", "all"):
                run_cli("generate", *common, "--out", root / turns / "c-00000.parquet", "--backend", "servers",
                        "--servers", server.url, "--turns", turns)
        run_cli("generate", *common, "--out", root / "hf" / "c-00000.parquet", "--backend", "hf", "--model",
                tiny_target, "--turns", "first", "--max-new-tokens", "8")
        tokenizer = ShardTokenizer(str(tiny_target), 4096, True, 256, 6, False)
        audits = {leg: tokenizer.shard(str(root / leg / "c-00000.parquet"), str(root / leg / "t.parquet"),
                                       str(root / leg / "a.json")) for leg in LEGS}
    return root, audits


def _leg_rows(root, leg: str) -> tuple[dict, dict]:
    """(completions by source id, token rows by sample id) of one leg."""
    completions = {r["source_id"]: r for r in read_completions(root / leg / "c-00000.parquet")}
    tokens = {r["sample_id"]: r for r in pq.read_table(root / leg / "t.parquet").to_pylist()}
    return completions, tokens


def _assert_the_targets_stream(row: dict, tokens: dict, tok, turns: str) -> str:
    """The token row is the target's own stream: the prompt (the template's rendering of the stored context
    with the sample's tools) unsupervised, the last generated turn supervised; returns the rendered prompt."""
    from dflash_pipeline.data.conversations import message_for_template

    assert row["status"] == "ok", row
    prompt, output = row["prompt_ids"], row["output_ids"][-1]
    token_row = tokens[row["sample_id"]]
    assert token_row["input_ids"] == prompt + output  # no text round trip
    assert token_row["loss_mask"] == [0] * len(prompt) + [1] * len(output)
    stored = [{k: v for k, v in message_for_template(m).items() if k != "reasoning_content"}
              for m in row["messages"]]
    context = stored[:1] if turns == "first" else stored[:3]
    rendered = tok.apply_chat_template(context, tools=json.loads(row["tools"]), tokenize=False,
                                       add_generation_prompt=True)
    assert tok.decode(prompt) == rendered and "<tools>" in rendered and '"get_weather"' in rendered
    return rendered


def test_ingest_generate_tokenize_keeps_the_targets_call_tokens(regenerated, tiny_target):
    """Both raw shapes (OpenAI messages with tool_calls / tool turns / tools; ShareGPT function_call /
    observation with tools as a JSON string of bare schemas) -> ingest -> generate (the stand-in backed by the
    tiny target, its template rendering the tools, --tool-call-parser qwen25) -> tokenize: the token row is the
    target's own stream; the prompt (tools' schema, the user turn; with turns: all also the call and the
    original tool result) is unsupervised, the generated turn (turns: first: the call, <|im_end|> included;
    turns: all: the final answer) supervised."""
    from transformers import AutoTokenizer

    root, audits = regenerated
    tok = AutoTokenizer.from_pretrained(tiny_target)
    for turns in ("first", "all"):
        assert audits[turns]["samples"] == 3 and audits[turns]["counts"]["tools_unsupported"] == 0
        completions, tokens = _leg_rows(root, turns)
        assert completions["c1"]["status"] == "ok" and completions["c1"]["sample_id"] in tokens
        for source_id, result in RESULTS.items():
            row = completions[source_id]
            rendered = _assert_the_targets_stream(row, tokens, tok, turns)
            call = json.loads(row["messages"][1]["tool_calls"])[0]
            assert call["function"]["name"] == "get_weather" and set(call["function"]["arguments"]) == {"city"}
            supervised = tok.decode(row["output_ids"][-1])
            if turns == "first":
                assert supervised.endswith("</tool_call><|im_end|>") and "<think>" in supervised
                assert json.dumps(call["function"]["arguments"]) in supervised  # the call's own tokens train
            else:
                assert [m["role"] for m in row["messages"]] == ["user", "assistant", "tool", "assistant"]
                assert row["messages"][2]["content"] == result and row["messages"][2]["tool_call_id"] == call["id"]
                assert f"<tool_response>\n{result}\n</tool_response>" in rendered
                assert row["messages"][3]["tool_calls"] is None and row["output_ids"][-1]  # an answer, no call


def test_hf_backend_gives_tool_samples_of_both_shapes_a_token_row(regenerated, tiny_target):
    """The hf backend on the same shard (turns: first): the tool samples' prompts carry their tools through the
    target's template and each gets a token row, prompt + output supervised on the output. The random tiny
    target writes no call (its calls are parsed in test_qwen_calls_are_parsed_as_sglangs_qwen25_parser_splits_
    them on written answers), so this checks the tool prompt and the token row, not a regenerated call."""
    from transformers import AutoTokenizer

    root, audits = regenerated
    tok = AutoTokenizer.from_pretrained(tiny_target)
    assert audits["hf"]["samples"] == 3 and audits["hf"]["counts"]["tools_unsupported"] == 0
    completions, tokens = _leg_rows(root, "hf")
    assert set(tokens) == {r["sample_id"] for r in completions.values()}
    for source_id in RESULTS:
        row = completions[source_id]
        _assert_the_targets_stream(row, tokens, tok, "first")
        assert row["generated_turns"] == 1 and 1 <= len(row["output_ids"][-1]) <= 8


def test_regenerated_tool_samples_extract_and_train(regenerated, tiny_target, capsys):
    """The legs' token shards -> `extract` (one process, the tiny target's hidden states of a 1-layer drafter's
    layers): each hidden shard holds exactly its token shard's rows, ids and loss masks (the tool rows
    supervised on the call's tokens with turns: first, on the answer with turns: all), hidden states finite
    and of the target's width -> `train --mode offline` for 2 steps on the turns: first shard (the call
    tokens and the chat answer): finite losses on supervised positions, a drafter written."""
    import math

    import numpy as np
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from dflash_pipeline.cli import main as cli_main
    from dflash_pipeline.hidden_states.reader import HiddenStateShardReader

    root, _ = regenerated
    hidden = {leg: root / leg / "h.dfhs" for leg in LEGS}
    assert cli_main(["extract", "--tokens", *(str(root / leg / "t.parquet") for leg in LEGS), "--model",
                     str(tiny_target), "--out", *map(str, hidden.values()), "--num-layers", "1",
                     "--codec", "raw", "--dtype", "float32", "--device", "cpu", "--encode-threads", "1"]) == 0
    tok = AutoTokenizer.from_pretrained(tiny_target)
    for leg in LEGS:
        completions, tokens = _leg_rows(root, leg)
        reader = HiddenStateShardReader(hidden[leg])
        assert sorted(reader.sample_ids) == sorted(tokens) and reader.metadata["hidden_size"] == 128
        for sid, token_row in tokens.items():
            got = reader.read(reader.index_of(sid))
            assert got["input_ids"].tolist() == token_row["input_ids"]
            assert got["loss_mask"].tolist() == token_row["loss_mask"]
            assert got["hidden"].shape[0] == len(token_row["input_ids"]) and got["hidden"].shape[-1] == 128
            assert bool(np.isfinite(np.asarray(got["hidden"], dtype=np.float32)).all())
        if leg == "first":  # the tool rows' supervised positions are the target's call, nothing of the prompt
            for source_id in RESULTS:
                got = reader.read(reader.index_of(completions[source_id]["sample_id"]))
                supervised = tok.decode([t for t, m in zip(got["input_ids"].tolist(), got["loss_mask"]) if m])
                assert supervised == tok.decode(completions[source_id]["output_ids"][-1])
                assert '"name": "get_weather"' in supervised and supervised.endswith("</tool_call><|im_end|>")
    out, ckpt = root / "drafter", root / "ckpt"
    assert cli_main(["train", "--mode", "offline", "--inputs", str(hidden["first"]), "--model", str(tiny_target),
                     "--out", str(out), "--checkpoint-dir", str(ckpt), "--num-layers", "1", "--block-size", "8",
                     "--num-anchors", "8", "--batch-size", "3", "--max-steps", "2", "--lr", "3e-3", "--log-every",
                     "1", "--max-length", "1024", "--acceptance-every", "0", "--device", "cpu"]) == 0
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [1, 2]
    assert all(math.isfinite(r["loss"]) and r["loss"] > 0 for r in logged)
    assert all(r["count_per_position"][1] == 3 * 8 for r in logged)  # each step: the 3 rows' 8 anchor blocks
    weights = load_file(str(out / "drafter.safetensors"))
    assert weights and all(bool(w.float().isfinite().all()) for w in weights.values())
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["steps"], summary["samples"], summary["mode"]) == (2, 3, "offline")


def test_a_shard_written_before_tool_calling_reads_with_null_tool_fields(tmp_path):
    from dflash_pipeline.generation.shards import ShardJob

    old = pa.schema([("sample_id", pa.string()), ("source", pa.string()), ("source_id", pa.string()),
                     ("messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string()),
                                                      ("reasoning_content", pa.string())])))])
    pq.write_table(pa.Table.from_pylist([{"sample_id": "a", "source": "s", "source_id": None, "messages": [
        {"role": "user", "content": "hi", "reasoning_content": None}]}], schema=old), tmp_path / "old.parquet")
    job = ShardJob(str(tmp_path / "old.parquet"), str(tmp_path / "o.parquet"), tmp_path / "j.jsonl", None)
    assert job.rows == [{"sample_id": "a", "source": "s", "source_id": None, "messages": [msg("user", "hi")],
                         "tools": None}]
    assert chat_messages(job.rows[0]["messages"]) == [{"role": "user", "content": "hi"}]
