"""A target that calls a tool exactly when its prompt lists tools, built by hand (training one here would take
minutes on a shared CPU): a one-layer Llama whose weights spell out a bigram chain plus one attention head that
looks for a marker token of the template's tools block.

- embeddings are one-hot (hidden size = embedding rows + 1); the extra dimension is the "tools offered" flag;
- the head's query is the same for every token, its key is large only at the marker token and its value flags it
  (query and key sit on the RoPE pair that turns 1e-6 rad per position, so position does not matter): attention
  lands on the marker when the prompt has one, and the flag is ~1, else 0;
- the MLP is zero; the untied LM head maps each token to its successor in a chain: the prompt's last token
  (the end of the generation prompt) -> `chat` tokens -> EOS, every other token -> EOS; the flag adds a bonus to
  the first token of the `call` chain just large enough to win at the prompt's last token only.

Its greedy output after a prompt with tools is `call` (text holding `<tool_call>`), else `chat`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path


def distinct_tokens(tokenizer, text: str, used: set[int]) -> list[int]:
    """Token ids that decode to `text`, each used once and none in `used` (a bigram chain can't repeat one)."""
    pieces = {}
    for i in range(len(tokenizer)):
        s = tokenizer.decode([i])
        if s and s in text and i not in used:
            pieces.setdefault(s, []).append(i)

    def search(at: int, taken: frozenset) -> list[int] | None:
        if at == len(text):
            return []
        for s in sorted(pieces, key=len, reverse=True):
            if text.startswith(s, at):
                for i in pieces[s]:
                    if i not in taken:
                        rest = search(at + len(s), taken | {i})
                        if rest is not None:
                            return [i, *rest]
        return None

    ids = search(0, frozenset(used))
    assert ids is not None, f"no spelling of {text!r} with distinct tokens"
    return ids


def tool_calling_target(base: Path, out: Path, marker_text: str, call: str, chat: str) -> dict:
    """Write the target to `out` with `base`'s tokenizer and template; returns the chains' token ids."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(base)
    meta = json.loads((base / "demo_target.json").read_text())
    rows = meta["mask_token_id"] + 1
    end = tok.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True,
                                  tokenize=True, return_dict=True)["input_ids"][-1]
    eos = tok.eos_token_id
    marker = tok(marker_text, add_special_tokens=False)["input_ids"]
    assert len(marker) == 1, f"{marker_text!r} is {len(marker)} tokens"
    call_ids = distinct_tokens(tok, call, {end, eos})
    chat_ids = distinct_tokens(tok, chat, {end, eos, *call_ids})
    d = rows + 1
    flag = rows
    cfg = LlamaConfig(vocab_size=rows, hidden_size=d, intermediate_size=1, num_hidden_layers=1,
                      num_attention_heads=1, num_key_value_heads=1, head_dim=4, max_position_embeddings=4096,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e12}, tie_word_embeddings=False,
                      eos_token_id=eos, pad_token_id=tok.pad_token_id, attention_bias=False, mlp_bias=False)
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for prm in model.parameters():
            prm.zero_()
        model.model.embed_tokens.weight[:, :rows] = torch.eye(rows)
        for norm in (model.model.norm, model.model.layers[0].input_layernorm,
                     model.model.layers[0].post_attention_layernorm):
            norm.weight.fill_(1.0)
        att = model.model.layers[0].self_attn
        scale = d ** -0.5  # the input norm scales a one-hot row by sqrt(d)
        att.q_proj.weight[1, :rows] = 8.0 * scale  # dims 1 and 3 are the RoPE pair at 1e-6 rad per position
        att.k_proj.weight[1, marker[0]] = 10.0 * scale  # score 8 * 10 / sqrt(4) = 40 at the marker, 0 elsewhere
        att.v_proj.weight[1, marker[0]] = scale
        att.o_proj.weight[flag, 1] = 1.0
        head = model.lm_head.weight
        head[eos, :rows] = 1.0  # every token ends the turn ...
        chain = [end, *chat_ids, eos]
        for a, b in zip(chain, chain[1:]):  # ... except along the chains
            head[eos, a] = 0.0
            head[b, a] = 1.0
        for a, b in zip(call_ids, [*call_ids[1:], eos]):
            head[eos, a] = 0.0
            head[b, a] = 1.0
        head[call_ids[0], end] = 0.9  # after the generation prompt: chat (1.0) unless the flag adds 0.2
        head[call_ids[0], flag] = 0.2
    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    shutil.copy(base / "demo_target.json", out / "demo_target.json")
    return {"marker": marker[0], "end": end, "call": call_ids, "chat": chat_ids}
