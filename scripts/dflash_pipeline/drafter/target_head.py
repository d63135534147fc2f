"""The target's token embedding and LM head: frozen, read from the target's safetensors, never saved with the
drafter (the engines use the target's own). Also the mask token: a row of that embedding."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from dflash_pipeline.errors import PipelineError
from dflash_pipeline.target import load_tokenizer, read_config, text_config


class TargetHead(nn.Module):
    """The target's token embedding and LM head, frozen (requires_grad False), never saved with the drafter."""

    def __init__(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor | None):
        super().__init__()
        self.embed = nn.Embedding.from_pretrained(embed_weight, freeze=True)
        tied = lm_head_weight is None
        self.lm_head = nn.Linear(embed_weight.shape[1], embed_weight.shape[0], bias=False)
        self.lm_head.weight = self.embed.weight if tied else nn.Parameter(lm_head_weight, requires_grad=False)
        self.lm_head.weight.requires_grad_(False)

    @property
    def vocab_rows(self) -> int:
        return self.embed.weight.shape[0]

    def check_mask_token(self, mask_token_id: int) -> None:
        if not 0 <= int(mask_token_id) < self.vocab_rows:
            raise PipelineError(
                f"mask_token_id {mask_token_id} is not a row of the target's embedding (0..{self.vocab_rows - 1})"
            )


def safetensor_files(model_dir: Path) -> dict[str, Path]:
    """tensor name -> file, for single-file and sharded (index.json) checkpoints."""
    from safetensors import safe_open

    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise PipelineError(f"{index}: unreadable safetensors index ({exc!r})") from None
        return {name: model_dir / fname for name, fname in weight_map.items()}
    single = model_dir / "model.safetensors"
    if not single.exists():
        raise PipelineError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")
    try:
        with safe_open(str(single), framework="pt") as fh:
            return {name: single for name in fh.keys()}
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types for damaged headers
        raise PipelineError(f"{single}: unreadable safetensors file ({exc})") from None


def _embed_and_head_names(model_dir: Path, files: dict[str, Path]) -> tuple[str, str | None]:
    cfg = read_config(model_dir)
    embed_names = [n for n in files if n.endswith("embed_tokens.weight")]
    if not embed_names:
        raise PipelineError(f"{model_dir}: no *embed_tokens.weight tensor in the checkpoint")
    head_names = [n for n in files if n.endswith("lm_head.weight")]
    tied = bool(cfg.get("tie_word_embeddings", text_config(cfg).get("tie_word_embeddings", False)))
    head = None if tied or not head_names else sorted(head_names, key=len)[0]
    return sorted(embed_names, key=len)[0], head


def target_vocab_rows(model_dir: str | Path) -> int:
    """Rows of the target's embedding, from the safetensors header only (no tensor is read)."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    files = safetensor_files(model_dir)
    name, _ = _embed_and_head_names(model_dir, files)
    with safe_open(str(files[name]), framework="pt") as fh:
        return int(fh.get_slice(name).get_shape()[0])


def load_target_head(model_dir: str | Path, dtype: torch.dtype = torch.float32) -> TargetHead:
    """Read only the embedding and LM head tensors from the target's safetensors (not the whole model)."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    files = safetensor_files(model_dir)
    embed_name, head_name = _embed_and_head_names(model_dir, files)

    def load(name):
        with safe_open(str(files[name]), framework="pt") as fh:
            return fh.get_tensor(name).to(dtype)

    return TargetHead(load(embed_name), None if head_name is None else load(head_name))


@dataclass(frozen=True)
class MaskChoice:
    """The drafter's mask token: its id, its text (None for a spare row), and why it was chosen."""

    token_id: int
    token: str | None
    reason: str

    def describe(self) -> str:
        text = f" {self.token!r}" if self.token is not None else ""
        return f"{self.token_id}{text} ({self.reason})"


def unused_special_token(tokenizer) -> tuple[int, str] | None:
    """(id, text) of the highest-id special added token that the data cannot hold and the template never writes.

    The tokenize stage leaves out every sample whose (non-assistant) text contains any special added token
    (data/tokenize.py, control tokens), so such a token reaches training only if the target itself writes it;
    bos/eos/pad/unk and the tokens of the chat template are the ones it does write, so they are excluded.
    """
    written = {getattr(tokenizer, f"{k}_token_id", None) for k in ("bos", "eos", "pad", "unk")}
    template = tokenizer.chat_template if isinstance(getattr(tokenizer, "chat_template", None), str) else ""
    candidates = [(int(i), t.content) for i, t in sorted(tokenizer.added_tokens_decoder.items())
                  if t.special and int(i) not in written and t.content and t.content not in template]
    return candidates[-1] if candidates else None


def choose_mask_token(model_dir: str | Path, configured: int | None, vocab_rows: int,
                      trust_remote_code: bool = False) -> MaskChoice:
    """The configured id; else `demo_target.json`'s; else the first embedding row past the tokenizer; else (no
    spare row, e.g. SmolLM2: 49152 tokens, 49152 rows) an existing special token the data never holds."""
    model_dir = Path(model_dir)
    if configured is not None:
        return MaskChoice(int(configured), None, "drafter.mask_token_id")
    demo = model_dir / "demo_target.json"
    if demo.exists():
        try:
            return MaskChoice(int(json.loads(demo.read_text())["mask_token_id"]), None, "demo_target.json")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise PipelineError(f"{demo}: no readable mask_token_id ({exc!r})") from None
    try:
        tokenizer = load_tokenizer(model_dir, trust_remote_code=trust_remote_code)
    except PipelineError as exc:
        raise PipelineError(f"drafter.mask_token_id is not set and the tokenizer could not be read: {exc}") from None
    n_tok = len(tokenizer)
    if n_tok < vocab_rows:
        return MaskChoice(n_tok, None, f"the first embedding row past the tokenizer's {n_tok} tokens")
    special = unused_special_token(tokenizer)
    if special is None:
        raise PipelineError(
            f"drafter.mask_token_id is not set, the embedding has no spare row past the tokenizer ({n_tok} tokens, "
            f"{vocab_rows} rows) and no special token is free of the data and the chat template: set "
            f"drafter.mask_token_id to a token id the drafter may use")
    return MaskChoice(special[0], special[1], f"no spare embedding row ({vocab_rows} rows, {n_tok} tokens): "
                                              "an existing special token that no training text holds")


def resolve_mask_token_id(model_dir: str | Path, configured: int | None, vocab_rows: int,
                          trust_remote_code: bool = False) -> int:
    """The mask token's id (`choose_mask_token`)."""
    return choose_mask_token(model_dir, configured, vocab_rows, trust_remote_code).token_id
