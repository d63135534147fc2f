"""Training data for the drafter: sample sources, a resumable epoch order, anchors, batches and the loss.

- Sources: `TokenSource` reads token shards (online mode: the target computes the features on the fly);
  `HiddenSource` reads hidden-state shards through `hidden_states_format` (offline mode). Both drop the
  evaluation hold-out (a fixed fraction of sample ids, chosen by a hash, see `is_holdout`).
- Order: an epoch is a permutation that shuffles shard groups and the samples inside a group, drawn from
  (seed, epoch) only; the data position of a run is therefore just the optimizer step.
- Anchors: up to `num_anchors` random positions of a sample whose token is supervised (loss mask 1) and has
  at least one following token, drawn from a generator seeded by (seed, epoch, position in the epoch): a
  resumed run draws the same anchors as an uninterrupted one.
- A batch packs all blocks of each sequence into one forward: queries are the blocks
  `[anchor, MASK x (block_size-1)]`, keys are `[context (S) | blocks]`; block j sees context keys
  `< anchor_j` and its own block keys only (`dense_block_mask` for SDPA, `flex_block_mask` for flex
  attention on GPU: same visibility, block-sparse).
- Loss: same-position labels (block position k predicts token anchor + k; position 0 is the anchor and
  is not scored; labels must be supervised and inside the sequence), cross-entropy weighted by
  w_k = exp(-(k-1)/gamma) and normalized by the sum of weights.
"""

from __future__ import annotations

import functools
import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from dflash_pipeline.drafter.model import DFlashDrafter, TargetHead, decay_weights
from dflash_pipeline.errors import PipelineError


def keeps_torch_threads(fn):
    """A stage's CPU thread setting is its own, not its caller's (tests run stages in-process): restore it."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        threads = torch.get_num_threads()
        try:
            return fn(*args, **kwargs)
        finally:
            torch.set_num_threads(threads)

    return wrapper

SHUFFLE_GROUP_SHARDS = 4  # samples are shuffled within groups of this many shards (locality for readers)


def is_holdout(sample_id: str, fraction: float) -> bool:
    """A stable, config-independent split: the evaluation prompts are never trained on."""
    if fraction <= 0:
        return False
    h = int.from_bytes(hashlib.sha256(f"dflash-holdout:{sample_id}".encode()).digest()[:8], "big")
    return h / 2**64 < fraction


def derived_seed(*parts: int) -> int:
    h = hashlib.sha256(":".join(str(int(p)) for p in parts).encode()).digest()
    return int.from_bytes(h[:8], "big") & ((1 << 63) - 1)


class TokenSource:
    """Samples of token shards (parquet: sample_id, input_ids, loss_mask); a few shards cached at a time."""

    kind = "tokens"

    def __init__(self, paths: list[str], holdout_fraction: float = 0.0, max_length: int | None = None,
                 cache_shards: int = 4, keep: str = "train"):
        import pyarrow.parquet as pq

        self.paths = [str(p) for p in paths]
        self.max_length = max_length
        self.cache_shards = cache_shards
        self._tables: OrderedDict[int, dict] = OrderedDict()
        self.index: list[tuple[int, int]] = []
        self.shard_of: list[int] = []
        for s, path in enumerate(self.paths):
            ids = pq.read_table(path, columns=["sample_id"]).column("sample_id").to_pylist()
            for row, sid in enumerate(ids):
                if is_holdout(sid, holdout_fraction) == (keep == "holdout"):
                    self.index.append((s, row))

    def __len__(self) -> int:
        return len(self.index)

    def shard(self, i: int) -> int:
        return self.index[i][0]

    def _table(self, s: int) -> dict:
        import pyarrow.parquet as pq

        if s in self._tables:
            self._tables.move_to_end(s)
            return self._tables[s]
        t = pq.read_table(self.paths[s], columns=["sample_id", "input_ids", "loss_mask"])
        cols = {name: t.column(name).to_pylist() for name in ("sample_id", "input_ids", "loss_mask")}
        self._tables[s] = cols
        while len(self._tables) > self.cache_shards:
            self._tables.popitem(last=False)
        return cols

    def get(self, i: int) -> dict:
        s, row = self.index[i]
        t = self._table(s)
        n = self.max_length or len(t["input_ids"][row])
        return {
            "sample_id": t["sample_id"][row],
            "input_ids": np.asarray(t["input_ids"][row][:n], dtype=np.int64),
            "loss_mask": np.asarray(t["loss_mask"][row][:n], dtype=np.uint8),
        }


class HiddenSource:
    """Samples of hidden-state shards: input_ids, loss_mask and features [T, n_layers * H]."""

    kind = "hidden"

    def __init__(self, paths: list[str], target_layer_ids: list[int], holdout_fraction: float = 0.0,
                 max_length: int | None = None):
        from dflash_pipeline.hidden_states.shard_format import HiddenStateShardReader

        self.paths = [str(p) for p in paths]
        self.max_length = max_length
        self.readers = [HiddenStateShardReader(p) for p in self.paths]
        self.index: list[tuple[int, int]] = []
        for s, reader in enumerate(self.readers):
            stored = [int(i) for i in reader.metadata["target_layer_ids"]]
            if stored != list(target_layer_ids):
                raise PipelineError(
                    f"{self.paths[s]}: hidden states were extracted at target layers {stored}, but the drafter "
                    f"is configured for {list(target_layer_ids)}; re-extract or fix drafter.target_layer_ids")
            for row, sid in enumerate(reader.sample_ids):
                if not is_holdout(sid, holdout_fraction):
                    self.index.append((s, row))
        self.hidden_size = self.readers[0].hidden_size if self.readers else 0

    def __len__(self) -> int:
        return len(self.index)

    def shard(self, i: int) -> int:
        return self.index[i][0]

    def get(self, i: int) -> dict:
        s, row = self.index[i]
        d = self.readers[s].read(row)
        n = self.max_length or len(d["input_ids"])
        hidden = d["hidden"][:n]
        return {
            "sample_id": d["sample_id"],
            "input_ids": np.asarray(d["input_ids"][:n], dtype=np.int64),
            "loss_mask": np.asarray(d["loss_mask"][:n], dtype=np.uint8),
            "features": hidden.reshape(hidden.shape[0], -1),
        }


def epoch_order(source, seed: int, epoch: int) -> list[int]:
    """A permutation of the source's samples for one epoch: shard groups shuffled, samples within a group."""
    g = torch.Generator().manual_seed(derived_seed(seed, epoch, 1))
    by_shard: dict[int, list[int]] = {}
    for i in range(len(source)):
        by_shard.setdefault(source.shard(i), []).append(i)
    shards = sorted(by_shard)
    shards = [shards[j] for j in torch.randperm(len(shards), generator=g).tolist()]
    order: list[int] = []
    for start in range(0, len(shards), SHUFFLE_GROUP_SHARDS):
        group = [i for s in shards[start:start + SHUFFLE_GROUP_SHARDS] for i in by_shard[s]]
        order.extend(group[j] for j in torch.randperm(len(group), generator=g).tolist())
    return order


def sample_anchors(loss_mask: np.ndarray, num_anchors: int, generator: torch.Generator) -> torch.Tensor:
    """Sorted anchor positions: supervised tokens followed by at least one token, at most num_anchors."""
    valid = np.flatnonzero(np.asarray(loss_mask[:-1]) > 0)
    if len(valid) > num_anchors:
        pick = torch.randperm(len(valid), generator=generator)[:num_anchors].numpy()
        valid = np.sort(valid[pick])
    return torch.as_tensor(valid, dtype=torch.long)


@dataclass
class Batch:
    input_ids: torch.Tensor      # [B, S] long (padded with 0)
    loss_mask: torch.Tensor      # [B, S] float
    lengths: torch.Tensor        # [B] long
    anchors: torch.Tensor        # [B, N] long (0 where not valid)
    block_valid: torch.Tensor    # [B, N] bool
    features: torch.Tensor | None  # [B, S, n*H] (offline) or None (online: computed by the target)

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    def to(self, device) -> "Batch":
        return Batch(
            self.input_ids.to(device), self.loss_mask.to(device), self.lengths.to(device),
            self.anchors.to(device), self.block_valid.to(device),
            None if self.features is None else self.features.to(device, non_blocking=True),
        )


def collate(samples: list[dict], anchors: list[torch.Tensor], pad_multiple: int = 1, num_blocks: int = 0) -> Batch:
    """Pad a batch; `pad_multiple` rounds the sequence length up and `num_blocks` fixes the block count, so
    compiled kernels (flex attention, torch.compile on GPU) see few distinct shapes instead of one per batch."""
    b = len(samples)
    s = max(len(x["input_ids"]) for x in samples)
    s = -(-s // pad_multiple) * pad_multiple
    n = max(1, num_blocks, max(len(a) for a in anchors))
    input_ids = torch.zeros(b, s, dtype=torch.long)
    loss_mask = torch.zeros(b, s, dtype=torch.float32)
    lengths = torch.zeros(b, dtype=torch.long)
    anc = torch.zeros(b, n, dtype=torch.long)
    valid = torch.zeros(b, n, dtype=torch.bool)
    feats = None
    if "features" in samples[0]:
        f0 = samples[0]["features"]
        feats = torch.zeros(b, s, f0.shape[-1], dtype=f0.dtype)
    for i, (x, a) in enumerate(zip(samples, anchors)):
        t = len(x["input_ids"])
        input_ids[i, :t] = torch.as_tensor(x["input_ids"])
        loss_mask[i, :t] = torch.as_tensor(x["loss_mask"], dtype=torch.float32)
        lengths[i] = t
        anc[i, : len(a)] = a
        valid[i, : len(a)] = True
        if feats is not None:
            feats[i, :t] = x["features"]
    return Batch(input_ids, loss_mask, lengths, anc, valid, feats)


# ---------------------------------------------------------------------------------------------------------
# Masks: block j (queries j*bs .. j*bs+bs-1) sees context keys < anchor_j and its own block's keys.
# A block that is not valid (padding) sees its own keys only, so no query row is fully masked.
# ---------------------------------------------------------------------------------------------------------


def dense_block_mask(anchors: torch.Tensor, block_valid: torch.Tensor, ctx_len: int, block_size: int) -> torch.Tensor:
    """Bool [B, 1, N*bs, S + N*bs], True = visible (for scaled_dot_product_attention)."""
    b, n = anchors.shape
    dev = anchors.device
    q_block = torch.arange(n * block_size, device=dev) // block_size          # [Q]
    anchor_q = anchors[:, q_block]                                            # [B, Q]
    valid_q = block_valid[:, q_block]                                         # [B, Q]
    kv_ctx = torch.arange(ctx_len, device=dev)
    ctx_vis = (kv_ctx[None, None, :] < anchor_q[:, :, None]) & valid_q[:, :, None]     # [B, Q, S]
    kv_block = torch.arange(n * block_size, device=dev) // block_size
    blk_vis = (q_block[:, None] == kv_block[None, :]).expand(b, -1, -1)              # [B, Q, N*bs]
    return torch.cat([ctx_vis, blk_vis], dim=-1)[:, None]


def flex_block_mask(anchors: torch.Tensor, block_valid: torch.Tensor, ctx_len: int, block_size: int):
    """The same visibility as a flex-attention BlockMask (block-sparse: skips invisible 128x128 tiles)."""
    from torch.nn.attention.flex_attention import create_block_mask

    b, n = anchors.shape
    s = ctx_len

    def mask_mod(bi, h, q_idx, kv_idx):
        j = q_idx // block_size
        anchor = anchors[bi, j]
        ok = block_valid[bi, j]
        ctx = (kv_idx < s) & (kv_idx < anchor) & ok
        own = (kv_idx >= s) & ((kv_idx - s) // block_size == j)
        return ctx | own

    return create_block_mask(mask_mod, B=b, H=None, Q_LEN=n * block_size, KV_LEN=s + n * block_size,
                             device=anchors.device)


# ---------------------------------------------------------------------------------------------------------
# Forward + loss over all blocks of a batch
# ---------------------------------------------------------------------------------------------------------


@dataclass
class BlockLoss:
    loss: torch.Tensor               # scalar, weighted mean CE
    weight_sum: float
    count: torch.Tensor              # [bs] scored labels per block position
    correct: torch.Tensor            # [bs] argmax == label per block position
    ce_sum: torch.Tensor             # [bs] summed CE per block position
    scored_tokens: int
    block_tokens: int


def block_loss(drafter: DFlashDrafter, head: TargetHead, batch: Batch, features: torch.Tensor, gamma: float,
               attention: str = "sdpa", compute_dtype: torch.dtype | None = None,
               labels: torch.Tensor | None = None) -> BlockLoss:
    """One forward of all blocks of the batch and the decay-weighted same-position cross-entropy.

    `labels` [B, S]: the token expected at each position (default: the data, `batch.input_ids`); block
    position k of the block anchored at p is scored against labels[p + k].
    """
    cfg = drafter.config
    bs = cfg.block_size
    ids, anchors, valid = batch.input_ids, batch.anchors, batch.block_valid
    b, s = ids.shape
    n = anchors.shape[1]
    dev = ids.device
    k = torch.arange(bs, device=dev)

    noise = torch.full((b, n, bs), cfg.mask_token_id, dtype=torch.long, device=dev)
    noise[:, :, 0] = torch.where(valid, ids.gather(1, anchors), torch.full_like(anchors, cfg.mask_token_id))
    dtype = compute_dtype or head.embed.weight.dtype
    emb = head.embed(noise.view(b, n * bs)).to(dtype)
    ctx_pos = torch.arange(s, device=dev).expand(b, s)
    blk_pos = (anchors[:, :, None] + k).view(b, n * bs)
    if attention == "flex":
        mask = flex_block_mask(anchors, valid, s, bs)
    else:
        mask = dense_block_mask(anchors, valid, s, bs)
    hidden = drafter(emb, features.to(dtype), ctx_pos, blk_pos, mask)          # [B, N*bs, H]

    label_pos = anchors[:, :, None] + k                                       # [B, N, bs]
    in_range = label_pos < batch.lengths[:, None, None]
    safe = label_pos.clamp(max=s - 1).view(b, n * bs)
    labels = (ids if labels is None else labels).gather(1, safe).view(b, n, bs)
    supervised = batch.loss_mask.gather(1, safe).view(b, n, bs) > 0
    decay = decay_weights(bs, gamma, device=dev)                              # decay[0] == 0
    weights = (valid[:, :, None] & in_range & supervised).float() * decay
    sel = (weights > 0).view(-1)
    pos_k = k.expand(b, n, bs).reshape(-1)[sel]
    w = weights.view(-1)[sel]
    y = labels.view(-1)[sel]
    if int(sel.sum()) == 0:
        zero = hidden.sum() * 0.0
        z = torch.zeros(bs, device=dev)
        return BlockLoss(zero, 0.0, z, z.clone(), z.clone(), 0, b * n * bs)
    logits = head.lm_head(hidden.reshape(-1, hidden.shape[-1])[sel])
    ce = F.cross_entropy(logits.float(), y, reduction="none")
    wsum = w.sum()
    loss = (ce * w).sum() / wsum
    with torch.no_grad():
        correct = (logits.argmax(-1) == y).float()
        count = torch.zeros(bs, device=dev).index_add_(0, pos_k, torch.ones_like(ce))
        corr = torch.zeros(bs, device=dev).index_add_(0, pos_k, correct)
        ce_sum = torch.zeros(bs, device=dev).index_add_(0, pos_k, ce.detach())
    return BlockLoss(loss, float(wsum), count, corr, ce_sum, int(sel.sum()), int(valid.sum()) * bs)


# ---------------------------------------------------------------------------------------------------------
# Online features: the target runs alongside the drafter
# ---------------------------------------------------------------------------------------------------------


def target_features_and_predictions(target, input_ids, lengths, layer_ids) -> tuple[torch.Tensor, torch.Tensor]:
    """Features as `target_features`, plus the target's own greedy token for every position [B, S]:
    predictions[t] = argmax of the target's logits at t - 1 (position 0 keeps the data token)."""
    s = input_ids.shape[1]
    attn = (torch.arange(s, device=input_ids.device)[None, :] < lengths[:, None]).long()
    with torch.no_grad():
        out = target(input_ids=input_ids, attention_mask=attn, output_hidden_states=True, use_cache=False)
        feats = torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)
        pred = input_ids.clone()
        pred[:, 1:] = out.logits[:, :-1].argmax(-1)
    return feats, pred


def target_features(target, input_ids: torch.Tensor, lengths: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    """Concatenated outputs of the target layers `layer_ids` ([B, S, n*H]), i.e. hidden_states[id + 1].

    Runs the target's decoder only (no LM head), under no_grad, with right padding masked out.
    """
    s = input_ids.shape[1]
    attn = (torch.arange(s, device=input_ids.device)[None, :] < lengths[:, None]).long()
    base = getattr(target, "model", None) or target.base_model
    with torch.no_grad():
        out = base(input_ids=input_ids, attention_mask=attn, output_hidden_states=True, use_cache=False)
        return torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)


def write_greedy_token_shard(model_dir: str, out: str, num_samples: int, prompt_len: int = 24,
                             new_tokens: int = 48, seed: int = 0, prefix: str = "greedy",
                             suffix_len: int = 4) -> None:
    """A token shard whose responses are the target's own greedy continuations of random prompts.

    For tests and benchmarks: the same kind of data the generate stage produces (the target's own output),
    without the ingest/generate stages. Columns follow the token-shard contract.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import AutoModelForCausalLM

    from dflash_pipeline.storage import atomic_path

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: one thread is fastest on shared cores
    try:
        target = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        ids = _greedy_rollouts(target, num_samples, prompt_len, new_tokens, seed, suffix_len)
    finally:
        torch.set_num_threads(threads)
    rows = {"sample_id": [], "input_ids": [], "loss_mask": [], "length": [], "num_loss_tokens": [], "truncated": []}
    for i in range(num_samples):
        seq = ids[i].tolist()
        mask = [0] * prompt_len + [1] * new_tokens
        rows["sample_id"].append(f"{prefix}-{i:05d}")
        rows["input_ids"].append(seq)
        rows["loss_mask"].append(mask)
        rows["length"].append(len(seq))
        rows["num_loss_tokens"].append(new_tokens)
        rows["truncated"].append(False)
    schema = pa.schema([("sample_id", pa.string()), ("input_ids", pa.list_(pa.int32())),
                        ("loss_mask", pa.list_(pa.int8())), ("length", pa.int32()),
                        ("num_loss_tokens", pa.int32()), ("truncated", pa.bool_())])
    with atomic_path(out, suffix=".parquet") as tmp:
        pq.write_table(pa.table(rows, schema=schema), tmp)


def _greedy_rollouts(target, num_samples, prompt_len, new_tokens, seed, suffix_len) -> torch.Tensor:
    vocab = int(target.config.vocab_size)
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, min(vocab, 1000), (num_samples, prompt_len), generator=g)
    # a fixed prompt ending shared by all samples, like a chat template's assistant header
    suffix = torch.randint(0, min(vocab, 1000), (suffix_len,), generator=torch.Generator().manual_seed(12345))
    if suffix_len:
        prompts[:, -suffix_len:] = suffix
    ids = prompts
    past = None
    step_in = prompts
    with torch.no_grad():
        for _ in range(new_tokens):  # batched greedy decoding with the KV cache
            o = target(input_ids=step_in, past_key_values=past, use_cache=True)
            past = o.past_key_values
            step_in = o.logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, step_in], dim=1)
    return ids
