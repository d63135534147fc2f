"""Everything about the target model in one place: its config, its identity, where and how to load it.

Every stage that touches the target (tokenize, generate, extract, train online, export, evaluate) goes through
these functions, so `target.trust_remote_code`, device and dtype choice mean the same thing everywhere.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from dflash_pipeline.errors import PipelineError

COMPUTE_DTYPES = ("auto", "bfloat16", "float16", "float32")


def is_gguf_path(path: str | Path) -> bool:
    """A target given as a GGUF file (imported into a transformers directory before any stage reads it)."""
    return str(path).lower().endswith(".gguf")


def text_config(config):
    """The language model's config: `text_config` of a multimodal config (dict or transformers config)."""
    if isinstance(config, dict):
        return config.get("text_config") or config
    return getattr(config, "text_config", None) or config


def read_config(model_dir: str | Path) -> dict:
    """The target's `config.json` as a dict (top level, not the text config)."""
    path = Path(model_dir) / "config.json"
    if not path.exists():
        raise PipelineError(f"{path}: target config.json not found")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise PipelineError(f"{path}: unreadable target config ({exc})") from exc


# hashed whole (small): what decides the prompts and answers besides the weights
CONTENT_FILES = frozenset({"config.json", "chat_template.jinja", "chat_template.json", "tokenizer_config.json",
                           "tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt", "special_tokens_map.json",
                           "added_tokens.json", "tiktoken.model"})
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


def fingerprint(model_dir: str | Path, weights: bool = True) -> str:
    """Identifies the target, not the path: hash of config.json, the chat template and tokenizer files, plus
    (weights=True) every weight file's name, size and mtime and the safetensors index. A target retrained,
    rebuilt or re-templated in the same directory gets a new fingerprint; hashing the weights' bytes would cost
    minutes for a 27B model. weights=False: what tokenization depends on. Non-local targets (hub ids, URLs)
    hash to their name."""
    model_dir = Path(model_dir)
    h = hashlib.sha256()
    if not model_dir.is_dir():
        h.update(str(model_dir).encode())
        return h.hexdigest()[:16]
    for p in sorted(model_dir.iterdir()):
        if p.name in CONTENT_FILES or (weights and p.name.endswith((".index.json", "generation_config.json"))):
            h.update(p.name.encode() + b"\0" + p.read_bytes())
        elif weights and p.suffix in WEIGHT_SUFFIXES:
            st = p.stat()
            h.update(f"{p.name}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def resolve_device(name: str = "auto") -> str:
    """`auto` -> cuda when visible, else cpu; an explicit cuda device that is not visible is an error."""
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise PipelineError(f"--device {name}: no CUDA device visible (CUDA_VISIBLE_DEVICES="
                            f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")
    return name


def compute_dtype(name: str, device) -> "torch.dtype":
    """`auto` -> bf16 on GPU, fp32 on CPU (CPU bf16 matmuls are slow and lossy)."""
    import torch

    if name not in COMPUTE_DTYPES:
        raise PipelineError(f"compute dtype {name!r}: expected one of {', '.join(COMPUTE_DTYPES)}")
    if name == "auto":
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    return getattr(torch, name)


def load_tokenizer(model_dir: str | Path, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise PipelineError(f"{model_dir}: cannot load the target's tokenizer ({exc})") from exc


def load_model(model_dir: str | Path, device: str = "auto", dtype: str = "auto", *,
               trust_remote_code: bool = False, attn_implementation: str | None = None):
    """The target as an eval-mode causal LM on `device` (resolved) in `dtype` (resolved)."""
    from transformers import AutoModelForCausalLM

    device = resolve_device(device)
    kwargs = dict(dtype=compute_dtype(dtype, device), trust_remote_code=trust_remote_code)
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    try:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), **kwargs)
    except (OSError, ValueError) as exc:
        raise PipelineError(f"{model_dir}: cannot load the target model ({exc})") from exc
    return model.to(device).eval()
