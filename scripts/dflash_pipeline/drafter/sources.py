"""Training samples: token shards (online mode) and hidden-state shards (offline mode), the evaluation
hold-out, and the resumable epoch order.

- `TokenSource` reads token shards (the target computes the features on the fly); `HiddenSource` reads
  hidden-state shards (features stored by the extract stage). Both drop the evaluation hold-out (a fixed
  fraction of sample ids, chosen by a hash, see `is_holdout`).
- Order: an epoch is a permutation that shuffles shard groups and the samples inside a group, drawn from
  (seed, epoch) only; the data position of a run is therefore just the optimizer step.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict

import numpy as np
import torch

from dflash_pipeline.errors import PipelineError
from dflash_pipeline.sample_ids import conversation_id

TOKEN_COLUMNS = ("sample_id", "input_ids", "loss_mask")
SHUFFLE_GROUP_SHARDS = 4  # samples are shuffled within groups of this many shards (locality for readers)


def is_holdout(sample_id: str, fraction: float) -> bool:
    """A stable, config-independent split: the evaluation prompts are never trained on. By conversation: the
    samples of one conversation's turns (sample_ids.py) fall on the same side."""
    if fraction <= 0:
        return False
    h = int.from_bytes(hashlib.sha256(f"dflash-holdout:{conversation_id(sample_id)}".encode()).digest()[:8], "big")
    return h / 2**64 < fraction


def derived_seed(*parts: int) -> int:
    h = hashlib.sha256(":".join(str(int(p)) for p in parts).encode()).digest()
    return int.from_bytes(h[:8], "big") & ((1 << 63) - 1)


def read_token_columns(path: str, columns: tuple[str, ...]):
    """Columns of a token shard (parquet); a missing column or an unreadable file names the file."""
    import pyarrow.parquet as pq

    try:
        names = pq.read_schema(path).names
        missing = [c for c in columns if c not in names]
        if missing:
            raise PipelineError(f"{path}: not a token shard (no column {', '.join(missing)})")
        return pq.read_table(path, columns=list(columns))
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        raise PipelineError(f"{path}: unreadable token shard ({exc})") from None


def _claim(seen: dict[str, str], sample_id: str, path: str) -> None:
    """One sample, one place: the manifest gives every sample one shard, so an id seen twice means shards of
    two runs (or one shard twice) were mixed, and that sample would be trained on twice as often."""
    first = seen.get(sample_id)
    if first is not None:
        where = "twice in " + path if first == path else f"in {first} and in {path}"
        raise PipelineError(f"sample {sample_id!r} appears {where}: shards of different runs mixed? "
                            "Give each sample once (training would count it twice)")
    seen[sample_id] = path


class TokenSource:
    """Samples of token shards (parquet: sample_id, input_ids, loss_mask); a few shards cached at a time."""

    kind = "tokens"

    def __init__(self, paths: list[str], holdout_fraction: float = 0.0, max_length: int | None = None,
                 cache_shards: int = 4, keep: str = "train"):
        self.paths = [str(p) for p in paths]
        self.max_length = max_length
        self.cache_shards = cache_shards
        self._tables: OrderedDict[int, dict] = OrderedDict()
        self.index: list[tuple[int, int]] = []
        seen: dict[str, str] = {}
        for s, path in enumerate(self.paths):
            ids = read_token_columns(path, TOKEN_COLUMNS).column("sample_id").to_pylist()
            for row, sid in enumerate(ids):
                _claim(seen, sid, path)
                if is_holdout(sid, holdout_fraction) == (keep == "holdout"):
                    self.index.append((s, row))

    def __len__(self) -> int:
        return len(self.index)

    def shard(self, i: int) -> int:
        return self.index[i][0]

    def identity(self) -> str:
        """Digest of the shards' bytes: a resumed run must see the data its checkpoint was trained on, not a
        rewritten shard with the same sample ids (token shards are small: ~2 bytes per token)."""
        h = hashlib.sha256()
        for path in self.paths:
            with open(path, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
        return h.hexdigest()

    def _table(self, s: int) -> dict:
        if s in self._tables:
            self._tables.move_to_end(s)
            return self._tables[s]
        t = read_token_columns(self.paths[s], TOKEN_COLUMNS)
        cols = {name: t.column(name).to_pylist() for name in TOKEN_COLUMNS}
        self._tables[s] = cols
        while len(self._tables) > self.cache_shards:
            self._tables.popitem(last=False)
        return cols

    def get(self, i: int) -> dict:
        s, row = self.index[i]
        t = self._table(s)
        n = self.max_length or len(t["input_ids"][row])
        if len(t["loss_mask"][row]) != len(t["input_ids"][row]):
            raise PipelineError(f"{self.paths[s]}: sample {t['sample_id'][row]!r} has "
                                f"{len(t['input_ids'][row])} tokens but {len(t['loss_mask'][row])} loss-mask values")
        return {
            "sample_id": t["sample_id"][row],
            "input_ids": np.asarray(t["input_ids"][row][:n], dtype=np.int64),
            "loss_mask": np.asarray(t["loss_mask"][row][:n], dtype=np.uint8),
        }


class HiddenSource:
    """Samples of hidden-state shards: input_ids, loss_mask and features [T, n_layers * H]."""

    kind = "hidden"

    def __init__(self, paths: list[str], target_layer_ids: list[int], holdout_fraction: float = 0.0,
                 max_length: int | None = None, keep: str = "train"):
        from dflash_pipeline.hidden_states.reader import HiddenStateShardReader, shard_files

        self.paths = shard_files(paths)  # an extraction group's directory: its shards
        self.max_length = max_length
        self.readers = [HiddenStateShardReader(p) for p in self.paths]
        self.index: list[tuple[int, int]] = []
        seen: dict[str, str] = {}
        for s, reader in enumerate(self.readers):
            stored = [int(i) for i in reader.metadata["target_layer_ids"]]
            if stored != list(target_layer_ids):
                raise PipelineError(
                    f"{self.paths[s]}: hidden states were extracted at target layers {stored}, but the drafter "
                    f"is configured for {list(target_layer_ids)}; re-extract or fix drafter.target_layer_ids")
            for row, sid in enumerate(reader.sample_ids):
                _claim(seen, sid, self.paths[s])
                if is_holdout(sid, holdout_fraction) == (keep == "holdout"):
                    self.index.append((s, row))
        self.hidden_size = self.readers[0].hidden_size if self.readers else 0
        for path, reader in zip(self.paths, self.readers):
            if reader.hidden_size != self.hidden_size:
                raise PipelineError(f"{path}: hidden size {reader.hidden_size}, but {self.paths[0]} has "
                                    f"{self.hidden_size}: shards of different targets")

    def __len__(self) -> int:
        return len(self.index)

    def shard(self, i: int) -> int:
        return self.index[i][0]

    def identity(self) -> str:
        """Digest of each shard's metadata, sample ids and token counts (the index; hashing terabytes of
        features at every start is not affordable): re-extracted shards of other samples get another one."""
        h = hashlib.sha256()
        for reader in self.readers:
            h.update(json.dumps([reader.metadata, list(reader.sample_ids), list(reader.num_tokens)],
                                sort_keys=True, default=str).encode())
        return h.hexdigest()

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


def check_token_range(sample: dict, vocab_rows: int) -> None:
    """Token ids index the target's embedding: one outside it means the data was tokenized for another model."""
    ids = sample["input_ids"]
    if len(ids) and (int(ids.max()) >= vocab_rows or int(ids.min()) < 0):
        bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
        raise PipelineError(f"sample {sample['sample_id']!r}: token id {bad} outside the target's "
                            f"embedding (0..{vocab_rows - 1}): tokenized for another model?")
