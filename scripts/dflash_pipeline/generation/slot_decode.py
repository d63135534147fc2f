"""Decoding on a static KV cache with a graph-captured step: rows are slots, refilled as soon as they finish.

Any HF decoder-only model with full attention (Llama, Qwen, Mistral without a sliding window) runs through its
own forward: per-row `position_ids`, a fixed-width cache of our own (`SlotCache`: every row writes the same
column `t` at each step) and a 4D additive mask saying which columns each row attends to. A row's tokens sit
right-aligned against `t`, so its position ids do not depend on its slot or on `t`: only the mask does. A new
request is prefilled on its own (with others that arrive with it) and its keys/values are copied into the free
slot's columns ending at `t`; when `t` reaches the cache's end every row is moved left at once (one copy).

The decode step (model, sampling, bookkeeping) is one CUDA graph on a GPU: a small target's eager step costs
tens of milliseconds of Python and kernel launches whatever the batch, the captured one what the GPU needs.
Attention goes through `slot_attention`, registered with transformers' attention interface. A decode step on a
GPU runs live_attention's Triton kernel, which reads only each row's live columns (its first column is the
cache's `start`); otherwise SDPA with the mask, the grouped query heads of one KV head side by side so that it
reads each key once (transformers' own sdpa path repeats the keys of a GQA model whenever a mask is given,
three times the cache traffic at SmolLM2's shape).

Sampling happens inside the step: temperature, top-k, top-p, then one uniform per row per step from splitmix64
of (row seed, tokens generated so far) picks the token by inverse CDF. A request's tokens are a function of its
prompt and seed, not of the rows beside it, its slot or when it arrived (up to the GPU's floating point).
Temperature 0 is argmax: the tokens of plain `generate` greedy.

Continuous refill is the engine's mode; length-sorted fixed-width batches (`refill=False`: a pool takes new
requests only when all its rows are done) stay for the benchmark (benchmarks/generation_engines.py), which measures
both side by side. On an H200 at the SmolLM2-135M shape, 1,024 slots: 28K real answer tok/s, 3.3x `generate` with a
static compiled cache on the same workload (docs/generation.md, "The slot engine").
"""

from __future__ import annotations

import collections
import inspect
import logging
import time
from dataclasses import dataclass, field

import torch

from dflash_pipeline.generation.engines import _SPLITMIX, _shift_right

LOG = logging.getLogger(__name__)
ATTENTION = "dflash_slots"
NO_TOP_P = 2.0  # top-p off: no cumulative probability reaches it


@dataclass
class Request:
    prompt: list[int]
    budget: int
    seed: int = 0
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    tag: object = None
    slot: int = -1
    start: int = 0                     # the cache column of its first prompt token
    tokens: list[int] = field(default_factory=list)


# --------------------------------------------------------------------------------------------------------
# sampling on the device
# --------------------------------------------------------------------------------------------------------
def row_uniform(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """One uniform in (0, 1) per row, float32, from splitmix64 of (seed, step): a pure function of the two."""
    golden, mix1, mix2 = _SPLITMIX
    x = seeds * golden + (steps + 1) * mix2  # int64 products wrap, as splitmix64's unsigned ones do
    x = (x ^ _shift_right(x, 30)) * mix1
    x = (x ^ _shift_right(x, 27)) * mix2
    x = x ^ _shift_right(x, 31)
    return (_shift_right(x, 40).float() + 0.5) * 2.0 ** -24  # 24 bits: exact in float32, never 0 or 1


def sample_rows(logits, seeds, steps, temperature, top_k, top_p, warp: bool) -> torch.Tensor:
    """The next token of each row: argmax where temperature is 0, else inverse-CDF sampling of the tempered
    distribution, cut to the top-k tokens and then to the top-p mass (transformers' order) when `warp`."""
    logits = logits.float()
    vocab = logits.shape[-1]
    greedy = logits.argmax(-1)
    scaled = logits / temperature.clamp_min(1e-5).unsqueeze(1)
    order = None
    if warp:
        scaled, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
        rank = torch.arange(vocab, device=logits.device)
        scaled = scaled.masked_fill(rank.unsqueeze(0) >= top_k.unsqueeze(1), float("-inf"))
    probs = torch.softmax(scaled, -1)
    if warp:
        before = probs.cumsum(-1) - probs  # the mass ranked above each token: the first one is always kept
        probs = probs.masked_fill(before >= top_p.unsqueeze(1), 0.0)
    cdf = probs.cumsum(-1)
    target = (row_uniform(seeds, steps) * cdf[:, -1]).unsqueeze(1)
    pick = torch.searchsorted(cdf, target, right=True).clamp_max(vocab - 1)
    if order is not None:
        pick = order.gather(1, pick)
    return torch.where(temperature > 0, pick.squeeze(1), greedy)


# --------------------------------------------------------------------------------------------------------
# the model's cache and attention
# --------------------------------------------------------------------------------------------------------
class SlotCache:
    """Per layer [rows, kv_heads, width, head_dim]; a decode step writes column `pos` (a device tensor, so a
    captured graph sees its new value); `start` (int32 [rows]) is each row's first live column, kept by the pool
    in step with the mask. Quacks like transformers' Cache where a model's forward uses one."""

    is_compileable = False

    def __init__(self):
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.pos: torch.Tensor | None = None
        self.start: torch.Tensor | None = None

    def add_layer(self, keys: torch.Tensor, values: torch.Tensor, live=None) -> None:
        """`live` (a live_attention.LiveAttention) rides on the key buffer: `update` returns that very tensor to
        the layer, which hands it to `slot_attention` (transformers gives the attention no cache)."""
        keys.slot_live = live
        self.keys.append(keys)
        self.values.append(values)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # position ids are always given

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.keys[layer_idx].index_copy_(2, self.pos, key_states)
        self.values[layer_idx].index_copy_(2, self.pos, value_states)
        return self.keys[layer_idx], self.values[layer_idx]


class PrefillCache(SlotCache):
    """Keeps what a prefill computed, to be copied into the slots."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.keys.append(key_states)
        self.values.append(value_states)
        return key_states, value_states


def slot_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """A decode step on a slot cache with the live-column kernel on: that kernel. Else SDPA with the 4D additive
    mask as given; for one query position (a decode step) the query heads that share a KV head become that
    head's query rows, so each key is read once; a prefill repeats the keys instead."""
    rows, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    live = getattr(key, "slot_live", None)
    if q_len == 1 and live is not None and dropout == 0.0:
        out = live(query, key, value, dim ** -0.5 if scaling is None else scaling)
        if out is not None:
            return out.transpose(1, 2), None
    if q_len == 1:
        out = torch.nn.functional.scaled_dot_product_attention(
            query.reshape(rows, kv_heads, group, dim), key, value, attn_mask=attention_mask, scale=scaling)
        return out.reshape(rows, heads, 1, dim).transpose(1, 2), None
    if group > 1:
        key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                           scale=scaling, is_causal=attention_mask is None)
    return out.transpose(1, 2).contiguous(), None


def use_slot_attention(model) -> None:
    """Route the model's attention through `slot_attention` (transformers' attention interface)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, slot_attention)
    try:
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionMaskInterface.register(ATTENTION, sdpa_mask)  # never used: our masks are 4D already
    except ImportError:
        pass
    try:
        model.set_attn_implementation(ATTENTION)
    except (AttributeError, ValueError, KeyError):
        model.config._attn_implementation = ATTENTION


def cache_keyword(model) -> str:
    """transformers >= 5.2x names the forward's cache `cache`, earlier versions `past_key_values`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
