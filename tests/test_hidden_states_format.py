"""The hidden-state shard format: round trips, random access, damage detection, resume, streaming, S3."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest
import torch

from dflash_pipeline.hidden_states import layout, reader
from dflash_pipeline.hidden_states.codec import merge_planes, split_planes
from dflash_pipeline.hidden_states.layout import ShardFormatError
from dflash_pipeline.hidden_states.reader import HiddenStateShardReader
from support.stream import iter_shard_samples
from dflash_pipeline.hidden_states.writer import HiddenStateShardWriter

META = {"target_layer_ids": [1, 3, 5], "hidden_size": 32, "num_layers": 8, "model_path": "m"}


def _samples(n=7, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        t = 5 + 13 * i % 41
        # hidden-state-like values: mostly small with a few large outliers
        h = torch.randn(t, 3, 32, generator=g) * torch.exp(torch.randn(t, 3, 1, generator=g))
        h[:, :, 7] *= 50
        out.append({
            "sample_id": f"s{i:03d}",
            "input_ids": torch.randint(0, 150000, (t,), generator=g).numpy().astype(np.int32),
            "loss_mask": (torch.rand(t, generator=g) > 0.4).numpy().astype(np.uint8),
            "hidden": h.to(dtype),
        })
    return out


def _write(path, samples, **kw):
    with HiddenStateShardWriter(path, META, **kw) as w:
        for s in samples:
            w.add(s["sample_id"], s["input_ids"], s["loss_mask"], s["hidden"])


@pytest.mark.parametrize("codec", ["raw", "zstd"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_lossless_round_trip_is_bit_exact(tmp_path, codec, dtype):
    tdt = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    samples = _samples(dtype=tdt)
    # special values survive too
    samples[0]["hidden"][0, 0, :4] = torch.tensor([float("inf"), float("-inf"), -0.0, float("nan")])
    path = tmp_path / f"a{layout.FILE_EXTENSION}"
    _write(path, samples, codec=codec, dtype=dtype)
    r = HiddenStateShardReader(path)
    assert len(r) == len(samples)
    assert r.sample_ids == [s["sample_id"] for s in samples]
    assert r.metadata["target_layer_ids"] == [1, 3, 5] and r.metadata["dtype"] == dtype
    assert r.metadata["model_path"] == "m" and r.metadata["num_layers"] == 8
    for s, got in zip(samples, r):
        assert got["sample_id"] == s["sample_id"]
        assert got["input_ids"].dtype == np.int32 and np.array_equal(got["input_ids"], s["input_ids"])
        assert got["loss_mask"].dtype == np.uint8 and np.array_equal(got["loss_mask"], s["loss_mask"])
        assert got["hidden"].dtype == tdt and got["hidden"].shape == s["hidden"].shape
        bits = torch.int16 if dtype == "bfloat16" else torch.int32
        assert torch.equal(got["hidden"].view(bits), s["hidden"].view(bits))  # bit-exact, NaN included
    assert not list(tmp_path.glob("*.partial")) and not list(tmp_path.glob("*.journal"))


def test_zstd_planes_compress_and_fp8_is_close(tmp_path):
    samples = _samples(n=4)
    sizes = {}
    for codec in ["raw", "zstd", "fp8"]:
        p = tmp_path / f"{codec}.dfhs"
        _write(p, samples, codec=codec, level=3)
        sizes[codec] = os.path.getsize(p)
    assert sizes["zstd"] < 0.85 * sizes["raw"]
    assert sizes["fp8"] < 0.6 * sizes["raw"]
    r = HiddenStateShardReader(tmp_path / "fp8.dfhs")
    for s, got in zip(samples, r):
        ref = s["hidden"].float()
        err = (got["hidden"].float() - ref).abs()
        assert got["hidden"].dtype == torch.bfloat16
        # e4m3 has 3 mantissa bits: relative error per element <= 1/16 of the row scale's power of two
        rowmax = ref.abs().amax(-1, keepdim=True)
        assert bool((err <= rowmax / 448 * 16 + 0.07 * ref.abs()).all())
        assert np.array_equal(got["input_ids"], s["input_ids"])


def test_split_planes_inverse_and_exponent_plane():
    x = torch.randn(1000).to(torch.bfloat16)
    bits = x.view(torch.int16).numpy().view(np.uint16)
    planes = split_planes(bits)
    assert planes.shape == (2, 1000)
    assert np.array_equal(merge_planes(planes, np.uint16), bits)
    # the top plane holds exactly the 8 exponent bits
    assert np.array_equal(planes[1], ((bits >> 7) & 0xFF).astype(np.uint8))


def test_random_access_reads_only_that_record(tmp_path):
    samples = _samples(n=9)
    path = tmp_path / "a.dfhs"
    _write(path, samples, codec="zstd")
    r = HiddenStateShardReader(path)
    # damage every record except #5: reading #5 must still work
    data = bytearray(path.read_bytes())
    for i in range(len(r)):
        if i != 5:
            data[r._offsets[i] + 1] ^= 0xFF
    path.write_bytes(bytes(data))
    r = HiddenStateShardReader(path)
    got = r.read(5)
    assert torch.equal(got["hidden"].view(torch.int16), samples[5]["hidden"].view(torch.int16))
    assert r.read(r.index_of("s005"))["sample_id"] == "s005"
    with pytest.raises(ShardFormatError, match="s004.*checksum"):
        r.read(4)


@pytest.mark.parametrize("codec", ["raw", "zstd", "fp8"])
def test_corruption_detected(tmp_path, codec):
    path = tmp_path / "a.dfhs"
    _write(path, _samples(n=3), codec=codec)
    r = HiddenStateShardReader(path)
    off, n = r._offsets[1], r._lengths[1]
    r.close()
    data = bytearray(path.read_bytes())
    data[off + n // 2] ^= 0x10  # one bit
    path.write_bytes(bytes(data))
    r = HiddenStateShardReader(path)
    r.read(0), r.read(2)
    with pytest.raises(ShardFormatError, match="checksum mismatch"):
        r.read(1)
    with pytest.raises(ShardFormatError):
        r.verify_all()


def test_truncation_and_garbage_detected(tmp_path):
    path = tmp_path / "a.dfhs"
    _write(path, _samples(n=3))
    full = path.read_bytes()
    for cut in [len(full) - 1, len(full) - 40, len(full) // 2, 100, 10]:
        path.write_bytes(full[:cut])
        with pytest.raises(ShardFormatError, match="truncated|too short|footer|index"):
            HiddenStateShardReader(path)
    path.write_bytes(b"PAR1" + full[4:])
    with pytest.raises(ShardFormatError, match="magic"):
        HiddenStateShardReader(path)
    # a damaged index is caught by its checksum
    data = bytearray(full)
    idx_off = struct.unpack("<Q", full[-32:-24])[0]
    data[idx_off + 5] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(ShardFormatError, match="index checksum"):
        HiddenStateShardReader(path)


def test_resume_after_kill_continues_from_last_flush(tmp_path):
    samples = _samples(n=8)
    path = tmp_path / "a.dfhs"
    w = HiddenStateShardWriter(path, META, codec="zstd", resume=True)
    for s in samples[:2]:
        w.add(s["sample_id"], s["input_ids"], s["loss_mask"], s["hidden"])
    w.flush(background=True)  # fsync + journal in a helper thread while appending goes on
    w.add(samples[2]["sample_id"], samples[2]["input_ids"], samples[2]["loss_mask"], samples[2]["hidden"])
    w.flush()
    for s in samples[3:5]:  # written but never flushed: lost in the "kill"
        w.add(s["sample_id"], s["input_ids"], s["loss_mask"], s["hidden"])
    w._fh.flush()
    w.abort()
    # a torn journal line from the kill is ignored
    with open(str(path) + ".journal", "a") as fh:
        fh.write("deadbeef {\"sample_ids\": [")
    assert not path.exists()
    w = HiddenStateShardWriter(path, META, codec="zstd", resume=True)
    assert w.completed_ids == {"s000", "s001", "s002"}
    for s in samples:
        if s["sample_id"] not in w.completed_ids:
            w.add(s["sample_id"], s["input_ids"], s["loss_mask"], s["hidden"])
    w.close()
    r = HiddenStateShardReader(path)
    assert r.sample_ids == [s["sample_id"] for s in samples]
    for s, got in zip(samples, r):
        assert torch.equal(got["hidden"].view(torch.int16), s["hidden"].view(torch.int16))
    # different settings do not resume a partial file written with others
    w = HiddenStateShardWriter(tmp_path / "b.dfhs", META, codec="zstd", resume=True)
    w.add(**{k: samples[0][k] for k in ("sample_id", "input_ids", "loss_mask", "hidden")})
    w.flush()
    w.abort()
    w = HiddenStateShardWriter(tmp_path / "b.dfhs", META, codec="raw", resume=True)
    assert w.completed_ids == set()
    w.abort()


def test_iter_shard_samples_order_shuffle_prefetch(tmp_path):
    a, b = _samples(n=5, seed=1), _samples(n=4, seed=2)
    for s in b:
        s["sample_id"] = "b" + s["sample_id"]
    _write(tmp_path / "a.dfhs", a)
    _write(tmp_path / "b.dfhs", b)
    paths = [tmp_path / "a.dfhs", tmp_path / "b.dfhs"]
    got = [s["sample_id"] for s in iter_shard_samples(paths, prefetch=2, workers=3)]
    assert got == [s["sample_id"] for s in a + b]
    s1 = [s["sample_id"] for s in iter_shard_samples(paths, seed=7, prefetch=3)]
    s2 = [s["sample_id"] for s in iter_shard_samples(paths, seed=7, prefetch=1)]
    assert s1 == s2 and sorted(s1) == sorted(got) and s1 != got
    # an early break stops cleanly; a damaged shard raises in the consumer
    it = iter_shard_samples(paths, prefetch=2)
    next(it)
    it.close()
    (tmp_path / "b.dfhs").write_bytes((tmp_path / "b.dfhs").read_bytes()[:-3])
    with pytest.raises(ShardFormatError):
        list(iter_shard_samples(paths))


def test_read_from_s3_with_ranged_gets(tmp_path, monkeypatch):
    boto3 = pytest.importorskip("boto3")
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
        monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
        samples = _samples(n=4)
        path = tmp_path / "a.dfhs"
        _write(path, samples, codec="zstd")
        s3 = boto3.client("s3", endpoint_url=endpoint)
        s3.create_bucket(Bucket="hs-bucket")
        s3.upload_file(str(path), "hs-bucket", "hidden/a.dfhs")
        r = HiddenStateShardReader("s3://hs-bucket/hidden/a.dfhs")
        got = r.read(2)
        assert torch.equal(got["hidden"].view(torch.int16), samples[2]["hidden"].view(torch.int16))
        ids = [s["sample_id"] for s in iter_shard_samples(["s3://hs-bucket/hidden/a.dfhs"], prefetch=2)]
        assert ids == [s["sample_id"] for s in samples]
        s3.put_object(Bucket="hs-bucket", Key="hidden/cut.dfhs", Body=path.read_bytes()[:-100])
        with pytest.raises(ShardFormatError):
            HiddenStateShardReader("s3://hs-bucket/hidden/cut.dfhs")
    finally:
        server.stop()


def test_default_target_layer_ids_match_design():
    from dflash_pipeline.errors import PipelineError
    from dflash_pipeline.target_layers import default_target_layer_ids, resolve_target_layer_ids

    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]
    assert resolve_target_layer_ids([0, 2], 3, 8) == [0, 2]  # explicit ids win over num_layers
    assert resolve_target_layer_ids(None, 3, 36) == [1, 17, 33]
    assert resolve_target_layer_ids(None, None, 36) == default_target_layer_ids(36, 5)  # the schema's num_layers
    with pytest.raises(PipelineError, match="out of range"):
        resolve_target_layer_ids([1, 8], None, 8)
    with pytest.raises(PipelineError, match="increasing"):
        resolve_target_layer_ids([3, 1], None, 8)


def test_many_readers_keep_few_files_open(tmp_path):
    samples = _samples(n=2)
    paths = []
    for k in range(reader.MAX_OPEN_FILES + 40):
        p = tmp_path / f"s{k}.dfhs"
        _write(p, samples, codec="zstd" if k % 2 else "raw")
        paths.append(p)
    before = len(os.listdir("/proc/self/fd"))
    readers = [HiddenStateShardReader(p) for p in paths]
    views = [r.read(1)["hidden"] for r in readers]  # raw ones are views of maps, zstd ones copies
    assert len(os.listdir("/proc/self/fd")) - before <= 2 * reader.MAX_OPEN_FILES + 4
    assert reader._OPEN.open_count() <= reader.MAX_OPEN_FILES
    for v in views:  # every tensor is still valid after its file left the cache
        assert torch.equal(v.view(torch.int16), samples[1]["hidden"].view(torch.int16))


def test_hidden_verify_command_deletes_only_damaged_shards(tmp_path):
    from conftest import run_cli

    good, bad = tmp_path / "good.dfhs", tmp_path / "bad.dfhs"
    _write(good, _samples(n=2))
    _write(bad, _samples(n=2))
    (tmp_path / "bad.stats.json").write_text("{}")
    data = bytearray(bad.read_bytes())
    data[200] ^= 0xFF
    bad.write_bytes(bytes(data))
    proc = run_cli("hidden-verify", good, bad, "--delete-damaged", check=False)
    assert proc.returncode == 1
    assert "DAMAGED" in proc.stdout and "checksum mismatch" in proc.stdout and "1 ok, 1 damaged" in proc.stdout
    assert good.exists() and not bad.exists() and not (tmp_path / "bad.stats.json").exists()
    assert run_cli("hidden-verify", good).returncode == 0


def test_hidden_verify_of_a_group_directory_removes_the_groups_stats_so_the_group_is_redone(tmp_path):
    """The workflow's extraction output is a group directory plus the group's stats file: a damaged shard in it
    takes the group's stats with it (the job's output goes missing: snakemake redoes that group, not others)."""
    from conftest import run_cli

    from dflash_pipeline.hidden_states.group_stats import write_group_stats

    groups = tmp_path / "hidden" / "groups"
    ok_dir, bad_dir = groups / "src-x00000", groups / "src-x00001"
    for d, names in ((ok_dir, ("src-00000", "src-00001")), (bad_dir, ("src-00002", "src-00003"))):
        d.mkdir(parents=True)
        for name in names:
            _write(d / f"{name}.dfhs", _samples(n=2))
        write_group_stats(str(d) + ".stats.json", {name: {"samples": 2} for name in names})
    bad = bad_dir / "src-00003.dfhs"
    data = bytearray(bad.read_bytes())
    data[200] ^= 0xFF
    bad.write_bytes(bytes(data))
    proc = run_cli("hidden-verify", ok_dir, bad_dir, "--delete-damaged", check=False)
    assert proc.returncode == 1 and "3 ok, 1 damaged" in proc.stdout, proc.stdout
    assert not bad.exists() and not (groups / "src-x00001.stats.json").exists()
    assert (bad_dir / "src-00002.dfhs").exists()  # the rest of the group stays until its job redoes it
    assert (groups / "src-x00000.stats.json").exists() and len(list(ok_dir.glob("*.dfhs"))) == 2
    empty = groups / "src-x00009"
    empty.mkdir()
    proc = run_cli("hidden-verify", empty, check=False)
    assert proc.returncode != 0 and "a directory without hidden-state shards" in proc.stdout + proc.stderr


# -- hostile files: sizes a file claims are checked before anything is allocated


def _peak_bytes(fn) -> int:
    """The peak of Python-traced allocations while `fn` runs (zstandard's output buffers are Python bytes)."""
    import tracemalloc

    tracemalloc.start()
    try:
        fn()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


def _replace_index(path, index_bytes: bytes, *, stated_size: bool = True, header_claim: int = 0):
    """Rewrite a shard's index (recompressed, checksummed, footer and header updated): a crafted but
    self-consistent file, as an attacker would make it."""
    import zlib

    import zstandard

    data = path.read_bytes()
    index_offset = struct.unpack("<Q", data[-32:-24])[0]
    if stated_size:
        blob = zstandard.ZstdCompressor(level=1).compress(index_bytes)
    else:  # a streamed frame: no decompressed size in its header
        cobj = zstandard.ZstdCompressor(level=1).compressobj()
        blob = b"".join(cobj.compress(index_bytes[k:k + (1 << 22)]) for k in range(0, len(index_bytes), 1 << 22))
        blob += cobj.flush()
    footer = struct.pack("<QQII8s", index_offset, len(blob), zlib.crc32(blob), 1, b"HSEND001")
    head = data[:16] + struct.pack("<Q", header_claim) + data[24:index_offset]
    path.write_bytes(head + blob + footer)


def _index_json(path) -> dict:
    import json

    import zstandard

    data = path.read_bytes()
    off, n = struct.unpack("<QQ", data[-32:-16])
    return json.loads(zstandard.ZstdDecompressor().decompress(data[off:off + n]))


@pytest.mark.parametrize("stated_size", [True, False])
def test_index_that_decompresses_to_far_more_than_the_file_is_refused(tmp_path, stated_size):
    import json

    path = tmp_path / "bomb.dfhs"
    _write(path, _samples(n=2))
    index = _index_json(path)
    # valid JSON, padded with 64 MiB of whitespace: a ~10 KB file whose index inflates 6000-fold
    _replace_index(path, json.dumps(index).encode() + b" " * (64 << 20), stated_size=stated_size)
    assert path.stat().st_size < 20_000

    def open_it():
        with pytest.raises(ShardFormatError, match="bomb.dfhs: index.*(more than|decompress)"):
            HiddenStateShardReader(path)

    assert _peak_bytes(open_it) < 8 << 20
    # the header's own claim is bounded too, and must match when given
    _replace_index(path, json.dumps(index).encode(), header_claim=1 << 40)
    with pytest.raises(ShardFormatError, match="header says the index decompresses to 1099511627776 bytes"):
        HiddenStateShardReader(path)
    _replace_index(path, json.dumps(index).encode(), header_claim=100)
    with pytest.raises(ShardFormatError, match="index.*more than the 100"):
        HiddenStateShardReader(path)


def test_written_header_states_the_index_size(tmp_path):
    path = tmp_path / "a.dfhs"
    _write(path, _samples(n=3))
    import json

    claim = struct.unpack("<Q", path.read_bytes()[16:24])[0]
    assert claim == len(json.dumps(_index_json(path)).encode())
    assert len(HiddenStateShardReader(path)) == 3


def _frame_stating(data: bytes, claim: int) -> bytes:
    """A zstd frame of `data` whose header states `claim` decompressed bytes (its 4-byte size field patched)."""
    import zstandard

    frame = bytearray(zstandard.ZstdCompressor(level=1).compress(data))
    assert frame[4] >> 6 == 2 and frame[4] & 0x20  # 4-byte content size, single segment: size at bytes 5-8
    frame[5:9] = struct.pack("<I", claim)
    return bytes(frame)


def _crafted_record(path, planes, n_tokens, layers, hidden):
    """A one-sample zstd shard whose two bf16 planes are the given (payload, claimed raw length) pairs."""
    from dflash_pipeline.hidden_states.codec import EncodedSample

    meta = {"target_layer_ids": list(range(layers)), "hidden_size": hidden, "num_layers": layers + 3,
            "model_path": "m"}
    ids = np.zeros(n_tokens, dtype=np.int32)
    mask = np.ones(n_tokens, dtype=np.uint8)
    with HiddenStateShardWriter(path, meta, codec="zstd") as w:
        w.add_encoded(EncodedSample("evil", n_tokens, [*planes, (ids, ids.nbytes), (mask, mask.nbytes)]))


def test_section_claiming_gigabytes_is_refused_before_allocating(tmp_path):
    import zstandard

    # 64 tokens x 64 layers x 2^20 hidden: each bf16 plane "is" 4 GiB, stored as a few hundred bytes
    path = tmp_path / "big.dfhs"
    cobj = zstandard.ZstdCompressor(level=1).compressobj()  # no size in the frame header
    small = cobj.compress(b"\0" * 4096) + cobj.flush()
    _crafted_record(path, [(small, 1 << 32), (small, 1 << 32)], 64, 64, 1 << 20)
    assert path.stat().st_size < 128 << 10
    r = HiddenStateShardReader(path)

    def read_it():
        with pytest.raises(ShardFormatError, match="big.dfhs: sample 0 \\(evil\\).*claims to decompress to 4294967296"):
            r.read(0)

    assert _peak_bytes(read_it) < 64 << 20
    with pytest.raises(ShardFormatError, match="4294967296"):
        r.verify_all()  # hidden-verify sees it too


def test_zstd_frame_stating_a_huge_size_is_refused_before_allocating(tmp_path):
    # the section table is honest (8 tokens x 1 layer x 16 = 128 bytes per plane) but the frame header
    # says 4 GiB: zstandard would allocate what the frame states
    path = tmp_path / "frame.dfhs"
    plane = _frame_stating(bytes(range(100)) * 700, 0xFFFFFFFF)
    _crafted_record(path, [(b"\1" * 128, 128), (plane, 128)], 8, 1, 16)
    r = HiddenStateShardReader(path)

    def read_it():
        with pytest.raises(ShardFormatError, match="frame.dfhs: undecodable section.*states 4294967295"):
            r.read(0)

    assert _peak_bytes(read_it) < 64 << 20


def test_index_with_inconsistent_records_is_refused(tmp_path):
    import json

    path = tmp_path / "a.dfhs"
    _write(path, _samples(n=3))
    good = _index_json(path)
    for mutate, why in [
        (lambda ix: ix["samples"]["sample_ids"].pop(), "columns"),
        (lambda ix: ix["samples"]["sample_ids"].__setitem__(1, "s000"), "repeats a sample id"),
        (lambda ix: ix["metadata"].__setitem__("hidden_size", "32"), "hidden size"),
        (lambda ix: ix["samples"]["offsets"].__setitem__(0, 10 ** 12), "outside the shard"),
        (lambda ix: ix["samples"]["num_tokens"].__setitem__(0, 10 ** 9), "do not fit"),
        (lambda ix: ix["samples"]["sections"][0][-1].__setitem__(2, 99), "its shape needs"),
        (lambda ix: ix["metadata"].pop("dtype"), "lacks 'dtype'"),
    ]:
        ix = json.loads(json.dumps(good))
        mutate(ix)
        _replace_index(path, json.dumps(ix).encode())
        with pytest.raises(ShardFormatError, match=why):
            HiddenStateShardReader(path).verify_all()


def test_hidden_verify_out_of_file_descriptors_deletes_nothing(tmp_path):
    """Too many open files is no damage: verified shards are closed (so it does not happen), and any
    unreadable shard stops the command before anything is deleted."""
    import resource

    from conftest import BIN

    paths = []
    for k in range(40):
        p = tmp_path / f"s{k:02d}.dfhs"
        _write(p, _samples(n=2), codec="raw" if k % 2 else "zstd")  # raw shards are memory-mapped
        paths.append(p)

    def few_fds():
        resource.setrlimit(resource.RLIMIT_NOFILE, (48, 48))

    import subprocess

    proc = subprocess.run([str(BIN / "dflash-pipeline"), "hidden-verify", "--delete-damaged", *map(str, paths)],
                          capture_output=True, text=True, preexec_fn=few_fds)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "40 ok, 0 damaged" in proc.stdout and all(p.exists() for p in paths)


def test_hidden_verify_unreadable_shard_is_an_error_and_deletes_nothing(tmp_path):
    from conftest import run_cli

    bad, good = tmp_path / "bad.dfhs", tmp_path / "good.dfhs"
    _write(bad, _samples(n=2))
    _write(good, _samples(n=2))
    data = bytearray(bad.read_bytes())
    data[200] ^= 0xFF
    bad.write_bytes(bytes(data))
    missing = tmp_path / "gone.dfhs"
    proc = run_cli("hidden-verify", "--delete-damaged", bad, missing, good, check=False)
    assert proc.returncode == 2
    assert "cannot read" in proc.stderr and "gone.dfhs" in proc.stderr and "nothing was deleted" in proc.stderr
    assert bad.exists() and good.exists()
