"""Issue 28: the evaluation reports tau on tool-call turns and on chat turns separately. A held-out set of raw
tool-calling and chat records goes through ingest -> manifest -> shards -> tokenize; the target (built by hand,
tests/tool_call_target.py) calls a tool exactly when its prompt lists tools, so its own output, not the data,
decides a turn's kind; `evaluate` runs through the CLI and the report page shows the table."""

from __future__ import annotations

import json
from html.parser import HTMLParser

import pytest
import torch

from data_fixtures import tokenized_audits
from dflash_pipeline.cli import main as cli_main
from dflash_pipeline.drafter.config import DrafterConfig
from dflash_pipeline.drafter.evaluate import TurnKinds, _by_turn, held_out_prompts
from dflash_pipeline.drafter.batched_decoding import RowOutput
from dflash_pipeline.drafter.model import DFlashDrafter, save_drafter
from dflash_pipeline.drafter.target_head import load_target_head
from dflash_pipeline.generation.engines import HFEngine
from dflash_pipeline.target import read_config as read_target_config
from tool_call_target import tool_calling_target

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def records() -> list[dict]:
    """OpenAI-shaped records: five call get_weather first, five are chat, and two list the tools but answer in
    text (the data says chat; a target that calls a tool there makes it a tool-call turn)."""
    out = []
    for i, city in enumerate(["Paris", "Oslo", "Lima", "Cairo", "Quito"]):
        out.append({"id": f"weather-{i}", "tools": TOOLS, "messages": [
            {"role": "user", "content": f"What is the weather in {city}?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"temp_c": 10 + i})},
            {"role": "assistant", "content": f"It is {10 + i} C in {city}."}]})
    for i, (a, b) in enumerate([(3, 4), (12, 5), (7, 9), (20, 22), (8, 1)]):
        out.append({"id": f"sum-{i}", "messages": [{"role": "user", "content": f"What is {a} plus {b}?"},
                                                   {"role": "assistant", "content": f"{a} plus {b} is {a + b}."}]})
    for i, (ask, answer) in enumerate([("Say hello.", "Hello there!"), ("Say goodbye.", "Goodbye!")]):
        out.append({"id": f"polite-{i}", "tools": TOOLS, "messages": [{"role": "user", "content": ask},
                                                                      {"role": "assistant", "content": answer}]})
    return out


HOLDOUT = 0.5  # the most the config schema allows


@pytest.fixture(scope="module")
def agentic(tiny_target, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("agentic")
    raw = tmp / "agentic.jsonl"
    raw.write_text("".join(json.dumps(r) + "\n" for r in records()))
    tokenized_audits([raw], tmp, tiny_target, max_length=2048)
    tokens = sorted(str(p) for p in tmp.glob("*.tokens.parquet"))
    # the marker: the first token of the template's tools block ("# Tools"), in no prompt without tools
    target = tmp / "calls-when-tools"
    tool_calling_target(tiny_target, target, "#", call="<tool_call>", chat="Sure, done.")
    return tmp, tokens, target


def _export_untrained(target, tmp) -> str:
    head = load_target_head(str(target))
    cfg = DrafterConfig.from_target(read_target_config(str(target)), 1, [0], 4, head.vocab_rows - 1,
                                    head.vocab_rows)
    torch.manual_seed(1)
    train_dir = tmp / "train"
    train_dir.mkdir()
    save_drafter(train_dir, DFlashDrafter(cfg))
    assert cli_main(["export", "--drafter", str(train_dir), "--model", str(target), "--out", str(tmp / "export"),
                     "--dtype", "float32"]) == 0
    return str(tmp / "export")


def _records_of_prompts(target, prompts) -> dict[str, dict]:
    """sample_id -> the raw record whose first turn the hf generation engine renders (with the record's tools) to
    exactly that prompt's tokens."""
    engine = HFEngine(str(target), threads=1)
    engine._load()
    rendered = {tuple(engine.render([{"role": "user", "content": r["messages"][0]["content"]}], True,
                                    r.get("tools"))): r for r in records()}
    return {p["sample_id"]: rendered.get(tuple(p["prompt"])) for p in prompts}


def test_held_out_prompts_render_the_tools_as_generation_does(agentic):
    """An evaluation prompt is the token row's prefix that tokenize wrote; it is exactly what the hf generation
    engine renders for the same first turn, with the record's tools (and without, for chat records)."""
    tmp, tokens, target = agentic
    prompts = held_out_prompts(tokens, 1.0, 100)
    of = _records_of_prompts(target, prompts)
    assert sorted(r["id"] for r in of.values() if r) == sorted(r["id"] for r in records())
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    with_schema = [p for p in prompts if "Current weather in a city." in tok.decode(p["prompt"])]
    assert len(with_schema) == sum(1 for r in records() if r.get("tools"))


def test_tau_is_reported_per_kind_of_turn(agentic, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp, tokens, target = agentic
    # what the target writes, by plain transformers greedy decoding (not the evaluator's decoder)
    model = AutoModelForCausalLM.from_pretrained(target).eval()
    tok = AutoTokenizer.from_pretrained(target)
    prompts = held_out_prompts(tokens, HOLDOUT, 100)
    expected = {}
    for p in prompts:
        out = model.generate(torch.tensor([p["prompt"]]), max_new_tokens=16, do_sample=False)
        expected[p["sample_id"]] = "tool_call" if "<tool_call>" in tok.decode(out[0, len(p["prompt"]):]) else "chat"
    want = {k: list(expected.values()).count(k) for k in ("tool_call", "chat")}
    assert want["tool_call"] and want["chat"], want  # the set has both kinds
    of = _records_of_prompts(target, prompts)
    data = {sid: "tool_call" if r["messages"][1].get("tool_calls") else "chat" for sid, r in of.items()}
    in_data = {k: list(data.values()).count(k) for k in ("tool_call", "chat")}
    pairs = {f"data {d}, target {t}": sum(1 for sid in data if (data[sid], expected[sid]) == (d, t))
             for d in ("tool_call", "chat") for t in ("tool_call", "chat")}
    assert pairs["data chat, target tool_call"] >= 1  # the target calls a tool where the data answered in text

    export = _export_untrained(target, tmp_path)
    report, plot = tmp_path / "report.json", tmp_path / "acc.png"
    assert cli_main(["evaluate", "--drafter", export, "--model", str(target), "--tokens", *tokens,
                     "--holdout-fraction", str(HOLDOUT), "--num-prompts", "20", "--max-new-tokens", "16",
                     "--temperatures", "0", "0.7", "--speedup-prompts", "0", "--min-tau-gain", "0",
                     "--device", "cpu", "--out", str(report), "--plot", str(plot)]) == 0
    r = json.loads(report.read_text())
    turns = r["turns"]
    assert turns["data"] == in_data and turns["greedy_vs_data"] == pairs
    for t in ("0", "0.7"):
        for name in ("trained", "untrained"):
            run = r[name] if t == "0" else r["sampled"][t][name]
            by = run["by_turn"]
            assert set(by) == {"tool_call", "chat"}
            if t == "0":  # greedy: lossless, so the kinds are the target's greedy ones
                assert {k: v["prompts"] for k, v in by.items()} == want
            assert sum(v["prompts"] for v in by.values()) == len(prompts)
            # every forward belongs to one turn: pooled tau is the forward-weighted mean of the kinds'
            forwards = sum(v["target_forwards"] for v in by.values())
            assert forwards == run["target_forwards"]
            weighted = sum(v["tau"] * v["target_forwards"] for v in by.values() if v["prompts"])
            assert abs(weighted / forwards - run["tau"]) < 1e-9
            assert turns["tau"][t][name] == {k: {"tau": v["tau"], "prompts": v["prompts"]} for k, v in by.items()}
    out = capsys.readouterr().out
    assert "held-out greedy, by kind of turn (the target's output), tau trained vs untrained: tool_call " in out
    assert f"({want['tool_call']} prompts); chat" in out

    # the summary page shows the table beside the per-temperature tau
    assert cli_main(["report-figures", "--evaluate", str(report), "--out-dir", str(tmp_path / "page")]) == 0
    rows = _table_rows((tmp_path / "page" / "summary.html").read_text())
    table = {(row[0], row[1]): row[2:] for row in rows if len(row) == 5}
    tau0 = turns["tau"]["0"]
    assert table[("greedy (T=0)", "tool call")] == [str(want["tool_call"]),
                                                     f"{tau0['trained']['tool_call']['tau']:.4g}",
                                                     f"{tau0['untrained']['tool_call']['tau']:.4g}"]
    assert table[("greedy (T=0)", "chat")][0] == str(want["chat"])
    assert ("sampled, T=0.7", "tool call") in table


def test_no_breakdown_for_a_template_without_tool_calls(tiny_target):
    """A target whose template writes no <tool_call> (SmolLM2's, Llama 3's): no per-kind tau, the reason said."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_target)
    assert TurnKinds(tok).unavailable is None
    tok.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    kinds = TurnKinds(tok)
    assert "<tool_call>" in kinds.unavailable
    assert _by_turn([RowOutput([1, 2], [0])], kinds, 4) is None


class _Rows(HTMLParser):
    def __init__(self):
        super().__init__()
        self.rows, self._row, self._cell = [], None, None

    def handle_starttag(self, tag, attrs):
        if tag == "tr":
            self._row = []
        elif tag in ("td", "th") and self._row is not None:
            self._cell = ""

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self._row.append(self._cell)
            self._cell = None
        elif tag == "tr" and self._row is not None:
            self.rows.append(self._row)
            self._row = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell += data


def _table_rows(text: str) -> list[list[str]]:
    p = _Rows()
    p.feed(text)
    return p.rows
