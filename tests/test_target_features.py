"""One feature definition everywhere: for every target layer id, the last one included, the features the
extract stage stores, the ones online training computes and the ones evaluation gives the drafter are the
same tensors (the decoder layer's output before the final norm, as SGLang and vLLM capture it)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from dflash_pipeline.drafter.config import DrafterConfig
from dflash_pipeline.drafter.features import target_features, target_features_and_predictions
from dflash_pipeline.drafter.model import DFlashDrafter
from dflash_pipeline.drafter.sources import HiddenSource
from dflash_pipeline.drafter.speculative import speculative_generate
from dflash_pipeline.drafter.target_head import load_target_head
from dflash_pipeline.hidden_states.extract import ExtractSettings, extract_shard
from dflash_pipeline.target import read_config

LENGTHS = (23, 41, 9, 32, 17)  # different lengths: every batch below is padded


@pytest.fixture(scope="module")
def setup(tiny_target, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(tiny_target, attn_implementation="sdpa").eval()
    n_layers = int(read_config(tiny_target)["num_hidden_layers"])
    rng = np.random.default_rng(3)
    ids = [rng.integers(0, 1000, n).astype(np.int32) for n in LENGTHS]
    path = tmp_path_factory.mktemp("feat") / "tokens.parquet"
    pq.write_table(pa.table({"sample_id": [f"f{i}" for i in range(len(ids))], "input_ids": [x.tolist() for x in ids],
                             "loss_mask": [[0] * 4 + [1] * (len(x) - 4) for x in ids]},
                            schema=pa.schema([("sample_id", pa.string()), ("input_ids", pa.list_(pa.int32())),
                                              ("loss_mask", pa.list_(pa.int8()))])), path)
    return target, n_layers, ids, path


def _online(target, ids, layer_ids):
    """Online training's features: all samples in one right-padded batch, per sample unpadded."""
    s = max(len(x) for x in ids)
    batch = torch.zeros(len(ids), s, dtype=torch.long)
    for i, x in enumerate(ids):
        batch[i, :len(x)] = torch.as_tensor(x)
    feats = target_features(target, batch, torch.tensor([len(x) for x in ids]), layer_ids)
    return [feats[i, :len(x)] for i, x in enumerate(ids)]


def _extracted(target, tokens, out, layer_ids, dtype):
    """The extract stage's stored features, through the offline training source."""
    extract_shard(str(tokens), "unused", str(out), ExtractSettings(target_layer_ids=layer_ids, codec="raw", dtype=dtype,
                  device="cpu", token_budget=64), model=target)  # several batches of mixed lengths
    src = HiddenSource([str(out)], layer_ids)
    by_id = {}
    for i in range(len(src)):
        x = src.get(i)
        by_id[tuple(np.asarray(x["input_ids"]).tolist())] = torch.as_tensor(x["features"]).float()
    return by_id


def test_online_extracted_and_evaluation_features_are_equal_for_every_layer(setup, tiny_target, tmp_path):
    target, n_layers, ids, tokens = setup
    every = list(range(n_layers))  # ... including L-1, whose hidden_states entry is post-norm in transformers
    online = _online(target, ids, every)
    # extracted (fp32 and bf16 storage) == online, sample by sample
    stored = _extracted(target, tokens, tmp_path / "f32.dfhs", every, "float32")
    stored16 = _extracted(target, tokens, tmp_path / "bf16.dfhs", every, "bfloat16")
    for x, f in zip(ids, online):
        torch.testing.assert_close(stored[tuple(x.tolist())], f, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(stored16[tuple(x.tolist())], f.to(torch.bfloat16).float(), rtol=2 ** -7, atol=1e-3)
    # online with predictions (labels: target) and with eager attention: the same features
    s = max(LENGTHS)
    with_pred, _ = target_features_and_predictions(
        target, torch.stack([torch.nn.functional.pad(torch.as_tensor(x, dtype=torch.long), (0, s - len(x))) for x in ids]),
        torch.tensor(LENGTHS), every)
    from transformers import AutoModelForCausalLM

    eager = AutoModelForCausalLM.from_pretrained(tiny_target, attn_implementation="eager").eval()
    for i, (x, f) in enumerate(zip(ids, _online(eager, ids, every))):
        torch.testing.assert_close(with_pred[i, :len(x)], online[i], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(f, online[i], rtol=1e-4, atol=1e-5)
    # the trap this definition avoids: hidden_states[L] is the final norm's output, not layer L-1's
    h = target(input_ids=torch.as_tensor(ids[0][None], dtype=torch.long), output_hidden_states=True).hidden_states
    hsize = h[0].shape[-1]
    torch.testing.assert_close(online[0][:, : (n_layers - 1) * hsize],
                               torch.cat([h[k + 1][0] for k in range(n_layers - 1)], -1), rtol=1e-4, atol=1e-5)
    assert not torch.allclose(online[0][:, (n_layers - 1) * hsize:], h[n_layers][0], atol=1e-2)


def test_evaluation_gives_the_drafter_the_same_features(setup, tiny_target):
    """speculative_generate (prefill, then KV-cached verify forwards, cropped to the kept tokens) hands the
    drafter, at each position, the features online training computes for the whole generated sequence."""
    target, n_layers, ids, _ = setup
    every = list(range(n_layers))
    head = load_target_head(tiny_target)
    cfg = DrafterConfig.from_target(read_config(tiny_target), 1, every, 4, 0, head.vocab_rows)
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg).eval()
    seen = {}

    def record(module, args, kwargs):
        for pos, f in zip(args[2][0].tolist(), args[1][0]):
            seen[pos] = f.clone()

    drafter.register_forward_pre_hook(record, with_kwargs=True)
    prompt = ids[1][:20].tolist()
    generated, accepted = speculative_generate(target, drafter, head, prompt, 14, set(), "cpu")
    full = _online(target, [np.array(prompt + generated[:-1])], every)[0]
    # every position up to the last verified one, each once (prefill, then the kept part of each verify)
    assert sorted(seen) == list(range(len(seen))) and len(seen) > len(prompt) + 5 and len(accepted) > 5
    for pos, f in seen.items():
        torch.testing.assert_close(f, full[pos], rtol=1e-4, atol=1e-5)


def test_online_features_stop_after_the_last_wanted_layer(setup):
    """Online training runs the target only up to its last feature layer (as extraction does), with the same
    features as a whole forward, and leaves the model without hooks."""
    from dflash_pipeline.target_layers import LayerOutputs, find_decoder_layers

    target, n_layers, ids, _ = setup
    layers = find_decoder_layers(target)
    before = [len(layer._forward_hooks) for layer in layers]  # extraction keeps its (inactive) hooks on a model
    ran = []
    handles = [layer.register_forward_hook(lambda m, a, o, i=i: ran.append(i)) for i, layer in enumerate(layers)]
    head_calls = []
    handles.append(target.lm_head.register_forward_hook(lambda *a: head_calls.append(1)))
    try:
        online = _online(target, ids, [0, 1])
        assert sorted(set(ran)) == [0, 1] and not head_calls and n_layers > 2
        ran.clear()
        s = max(LENGTHS)
        batch = torch.stack([torch.nn.functional.pad(torch.as_tensor(x, dtype=torch.long), (0, s - len(x)))
                             for x in ids])
        mask = (torch.arange(s)[None] < torch.tensor(LENGTHS)[:, None]).long()
        with torch.no_grad(), LayerOutputs(target, [0, 1]) as cap:
            target.model(input_ids=batch, attention_mask=mask, use_cache=False)  # the whole decoder
            whole = cap.features()
        assert sorted(set(ran)) == list(range(n_layers))
        for i, x in enumerate(ids):
            torch.testing.assert_close(online[i], whole[i, :len(x)], rtol=1e-5, atol=1e-6)
    finally:
        for h in handles:
            h.remove()
    assert [len(layer._forward_hooks) for layer in layers] == before
