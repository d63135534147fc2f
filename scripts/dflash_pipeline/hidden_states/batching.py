"""Batches for extraction: token-budget batching of length-sorted samples, and moving a batch's captured states
into the layout the codec stores, computed where the states are (the GPU), then to pinned host memory."""

from __future__ import annotations

from dataclasses import dataclass

from dflash_pipeline.hidden_states.codec import Codec, EncodedSample, quantize_fp8


def token_budget_batches(lengths, token_budget: int, max_batch: int = 256, max_padding: float = 0.2):
    """Indices sorted by length (longest first) cut into batches with batch * max_len <= token_budget and
    at most `max_padding` of each batch's tokens being padding (a new batch starts when a sample is
    shorter than (1 - max_padding) x the batch's longest)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches, cur = [], []
    for i in order:
        longest = lengths[cur[0]] if cur else lengths[i]
        if cur and ((len(cur) + 1) * longest > token_budget or len(cur) >= max_batch
                    or lengths[i] < (1 - max_padding) * longest):
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


@dataclass
class Batch:
    ids: list           # sample ids
    input_ids: list     # numpy int32 per sample
    loss_mask: list
    lengths: list
    host: object        # host tensor: planes [P, B, S, L*H] (zstd), [B, S, L, H] (raw) or (q, scales) (fp8)
    event: object       # CUDA event of the copy, or None


def to_host_layout(feats, codec: str, dtype: str):
    """[B, S, L, H] captured states -> the layout the codec stores, computed where the states are."""
    import torch

    tdt = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    if codec == "fp8":
        return quantize_fp8(feats)
    x = feats.to(tdt)
    if codec == "raw":
        return x.contiguous()
    idt, nbits = (torch.int16, 16) if dtype == "bfloat16" else (torch.int32, 32)
    bits = x.contiguous().view(idt)
    rot = (bits << 1) | ((bits >> (nbits - 1)) & 1)  # the sign bit moves to the bottom (codec.split_planes)
    B, S, L, H = x.shape
    return rot.view(torch.uint8).view(B, S, L * H, nbits // 8).permute(3, 0, 1, 2).contiguous()


def copy_to_host(obj, stream):
    """Start copying a device tensor (or a tuple of them) into pinned host memory on `stream`."""
    import torch

    if isinstance(obj, tuple):
        return tuple(copy_to_host(o, stream) for o in obj)
    if obj.device.type == "cpu":
        return obj
    host = torch.empty(obj.shape, dtype=obj.dtype, pin_memory=True)
    with torch.cuda.stream(stream):
        host.copy_(obj, non_blocking=True)
    obj.record_stream(stream)
    return host


def encode_sample(codec: Codec, batch: Batch, b: int) -> EncodedSample:
    """Sample b of a batch whose host copy is complete, encoded (runs on the encode thread pool)."""
    t = batch.lengths[b]
    if codec.codec == "zstd":
        planes = batch.host[:, b, :t].numpy()  # [P, t, L*H]; each plane contiguous
        return codec.encode(batch.ids[b], batch.input_ids[b], batch.loss_mask[b], planes=planes)
    if codec.codec == "raw":
        return codec.encode(batch.ids[b], batch.input_ids[b], batch.loss_mask[b], batch.host[b, :t])
    q, s = batch.host
    return codec.encode(batch.ids[b], batch.input_ids[b], batch.loss_mask[b], fp8=(q[b, :t].numpy(), s[b, :t].numpy()))
