"""DCP checkpoints through cloudckpt: real gloo ranks, resharding, format compatibility,
failures, corruption and unsafe pickles."""

from __future__ import annotations

import io
import json
import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_run import run_ranks
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

import cloudckpt.dcp as cloud_dcp
from cloudckpt import (
    MANIFEST_NAME,
    CommitConflictError,
    CorruptCheckpointError,
    NotACheckpointError,
    open_checkpoint,
    open_store,
)
from cloudckpt.cli import main as cli
from cloudckpt.dcp import CloudStorageReader, CloudStorageWriter, adopt, async_save
from cloudckpt.movement.checkpoint_copy import copy_checkpoint
from cloudckpt.util.crc import crc32c_hex


def sample_state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(64, 32, generator=g),
        "b": torch.arange(10, dtype=torch.int64),
        "half": torch.randn(7, 3, generator=g).to(torch.bfloat16),
        "view": torch.randn(100, 10, generator=g)[10:20],
        "step": 42,
        "meta": {"lr": 0.1, "name": "run"},
    }


def empty_like_state(sd: dict) -> dict:
    out = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in sd.items()}
    out["meta"] = {"lr": None, "name": None}
    return out


def assert_state_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def save_local_single(sd: dict, uri: str, options: dict | None = None, **kw) -> None:
    dcp.save(sd, storage_writer=CloudStorageWriter(uri, storage_options=options, **kw),
             no_dist=True)


def load_single(uri: str, options: dict | None = None) -> dict:
    target = empty_like_state(sample_state())
    cloud_dcp.load(target, uri, storage_options=options)
    return target


@pytest.mark.parametrize("name", ["s3", "local", "gcs", "azure"])
def test_single_process_round_trip(request, name):
    backend = request.getfixturevalue(name)
    uri = backend.uri("step-1")
    save_local_single(sample_state(), uri, backend.options)
    ckpt = open_checkpoint(uri, backend.options)
    assert ckpt.manifest.kind == "dcp" and ".metadata" in ckpt.files
    assert any(f.endswith(".distcp") for f in ckpt.files)
    ckpt.verify(deep=True)
    assert_state_equal(load_single(uri, backend.options), sample_state())


def test_reader_streams_files_of_several_ranges_through_a_small_window(s3):
    g = torch.Generator().manual_seed(1)
    sd = {f"t{i}": torch.randn(300_000, generator=g) for i in range(6)}  # 1.2 MB each
    uri = s3.uri("stream")
    cloud_dcp.save(sd, uri, storage_options=s3.options, file_size=4 * 1024 * 1024,
                   max_files=2)
    files = [f for f in open_checkpoint(uri, s3.options).files if f.endswith(".distcp")]
    assert len(files) == 2  # of about 3.6 MB: several 1 MiB ranges each
    target = {k: torch.zeros_like(v) for k, v in sd.items()}
    reader = CloudStorageReader(uri, storage_options={**s3.options, "part_size": 1 << 20},
                                read_window=1)  # one range fetched ahead at a time
    dcp.load(target, storage_reader=reader, no_dist=True)
    for k, v in sd.items():
        assert torch.equal(target[k], v), k


def test_sharded_save_reshards_bit_exact_on_s3(s3, tmp_path):
    opts = s3.options_json()
    for save_world, load_worlds in ((2, (4, 1)), (4, (2,))):
        uri, ref = s3.uri(f"w{save_world}"), str(tmp_path / f"ref{save_world}.pt")
        kinds = run_ranks("dcp_workers.save_sharded", save_world, uri, opts, ref)
        assert kinds[0] == ["DTensor"]  # the model really was sharded
        ckpt = open_checkpoint(uri, s3.options)
        shard_files = [f for f in ckpt.files if f.endswith(".distcp")]
        assert {f.split("_")[2] for f in shard_files} == {str(r) for r in range(save_world)}
        for world in load_worlds:
            if world == 1:
                from dcp_workers import load_single_process

                assert load_single_process(uri, opts, ref)
            else:
                assert run_ranks("dcp_workers.load_and_compare", world, uri, opts, ref) == {
                    r: True for r in range(world)}


@pytest.mark.parametrize("name", ["local", "gcs", "azure"])
def test_sharded_save_reshards_on_other_backends(request, name, tmp_path):
    backend = request.getfixturevalue(name)
    opts, uri, ref = backend.options_json(), backend.uri("w2"), str(tmp_path / "ref.pt")
    run_ranks("dcp_workers.save_sharded", 2, uri, opts, ref)
    assert run_ranks("dcp_workers.load_and_compare", 4, uri, opts, ref) == {
        r: True for r in range(4)}


@pytest.mark.parametrize("mode", ["raise", "kill"])
def test_failing_rank_leaves_no_manifest_and_no_hang(s3, mode):
    uri = s3.uri("fail")
    results = run_ranks("dcp_workers.save_with_failing_rank", 2, uri, s3.options_json(), mode,
                        pg_timeout=20, timeout=120, allow_errors=True)
    assert not open_store(uri, s3.options).exists(MANIFEST_NAME)
    if mode == "raise":
        assert all(str(v).startswith("raised CheckpointException") for v in results.values())
        assert "disk on fire" in results[0]
    else:
        assert results[1][0] == "died"
        # The surviving rank gets an error from the collective, not a hang.
        assert not str(results[0]).startswith("saved"), results[0]


def test_items_are_torch_save_less_the_zip_crc32(monkeypatch):
    # torch's record CRC32 held the GIL for 60 ms per 256 MiB; the manifest's CRC32C
    # covers every item. Same bytes as torch.save with its CRC32 off, loadable by
    # torch.load; torch's option itself is never touched (other threads' saves).
    import torch.serialization as ts

    from cloudckpt.compat import torch_private
    from cloudckpt.serialization import torchsave

    t = torch.randn(64, 33)
    ours = io.BytesIO()
    torchsave.save_item(t, ours)
    assert ts.get_crc32_options() is True
    plain = io.BytesIO()
    torch.save(t, plain)
    bare = io.BytesIO()
    ts.set_crc32_options(False)
    try:
        torch.save(t, bare)
    finally:
        ts.set_crc32_options(True)
    assert ours.getvalue() == bare.getvalue() != plain.getvalue()
    ours.seek(0)
    assert torch.equal(torch.load(ours, weights_only=True), t)
    monkeypatch.setattr(torch_private, "_direct", False)  # torch's pieces not as tested
    fallback = io.BytesIO()
    torchsave.save_item(t, fallback)
    assert fallback.getvalue() == plain.getvalue()


def test_stock_reader_loads_our_checkpoint(s3, tmp_path):
    uri = s3.uri("step-1")
    save_local_single(sample_state(), uri, s3.options, key_spread=4)
    ckpt = open_checkpoint(uri, s3.options)
    assert all("/" in f for f in ckpt.files if f.endswith(".distcp"))  # spread over prefixes
    assert ckpt.metadata["dcp"]["key_spread"] == 4
    local = tmp_path / "copy"
    copy_checkpoint(ckpt, str(local))
    target = empty_like_state(sample_state())
    dcp.load(target, storage_reader=FileSystemReader(str(local)), no_dist=True)
    assert_state_equal(target, sample_state())


def test_stock_checkpoint_is_refused_until_adopted(s3, tmp_path):
    stock = tmp_path / "stock"
    dcp.save(sample_state(), storage_writer=FileSystemWriter(str(stock)), no_dist=True)
    uri = s3.uri("adopted")
    store = open_store(uri, s3.options)
    store.put_many({p.name: p.read_bytes() for p in stock.iterdir()})
    with pytest.raises(NotACheckpointError, match="written without cloudckpt.*cloudckpt adopt"):
        load_single(uri, s3.options)
    assert cli(["-o", f"endpoint_url={s3.options['endpoint_url']}", "adopt", uri]) == 0
    ckpt = open_checkpoint(uri, s3.options)
    ckpt.verify(deep=True)
    assert ckpt.metadata["dcp"]["adopted"] is True
    assert_state_equal(load_single(uri, s3.options), sample_state())


def test_adopt_refuses_missing_shards(memory, tmp_path):
    stock = tmp_path / "stock"
    dcp.save(sample_state(), storage_writer=FileSystemWriter(str(stock)), no_dist=True)
    store = open_store(memory.root)
    store.put(".metadata", (stock / ".metadata").read_bytes())  # shards never uploaded
    with pytest.raises(CorruptCheckpointError, match="__0_0.distcp \\(missing\\)"):
        adopt(memory.root)
    assert not store.exists(MANIFEST_NAME)


def test_flipped_byte_in_a_shard_is_named(s3):
    uri = s3.uri("step-1")
    save_local_single(sample_state(), uri, s3.options)
    store = open_store(uri, s3.options)
    shard = next(f for f in open_checkpoint(uri, s3.options).files if f.endswith(".distcp"))
    data = bytearray(store.get(shard))
    data[len(data) // 2] ^= 0x10
    store.put(shard, bytes(data))
    with pytest.raises(CorruptCheckpointError, match=f"object '{shard}' .* is corrupt") as exc:
        load_single(uri, s3.options)
    assert shard in exc.value.problems
    # Through the plain DCP API the same error arrives wrapped by torch.
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException, match="is corrupt"):
        dcp.load(empty_like_state(sample_state()),
                 storage_reader=CloudStorageReader(uri, storage_options=s3.options), no_dist=True)


class _Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_malicious_pickled_item_does_not_execute(memory, tmp_path):
    marker = tmp_path / "pwned"
    uri = memory.uri("evil")
    sd = {"w": torch.ones(3), "payload": _Evil(str(marker))}
    save_local_single(sd, uri)  # DCP pickles the object into a byte item
    target = {"w": torch.zeros(3), "payload": None}
    with pytest.raises(CorruptCheckpointError, match="cannot be loaded safely"):
        cloud_dcp.load(target, uri)
    assert not marker.exists()


def test_a_metadata_the_manifest_does_not_vouch_for_is_corrupt(memory):
    # .metadata is fetched beside the manifest; bytes that differ from what the
    # manifest records must fail the load, not be planned from
    uri = memory.uri("swapped-md")
    save_local_single(sample_state(), uri)
    store = open_store(uri)
    other = memory.uri("other")
    save_local_single({"w": torch.zeros(5)}, other)
    store.put(".metadata", open_store(other).get(".metadata"))
    with pytest.raises(CorruptCheckpointError, match="'.metadata' of .* is corrupt"):
        load_single(uri)


def test_malicious_metadata_does_not_execute(memory, tmp_path):
    marker = tmp_path / "pwned"
    uri = memory.uri("evil-md")
    save_local_single(sample_state(), uri)
    store = open_store(uri)
    evil = pickle.dumps(_Evil(str(marker)))
    store.put(".metadata", evil)
    doc = json.loads(store.get(MANIFEST_NAME))  # an attacker controls the manifest too
    from cloudckpt.util.crc import crc32c_hex

    doc["files"][".metadata"] = {"size": len(evil), "crc32c": crc32c_hex(evil)}
    store.put(MANIFEST_NAME, json.dumps(doc).encode())
    with pytest.raises(CorruptCheckpointError, match="not safe DCP metadata"):
        load_single(uri)
    assert not marker.exists()


def test_async_save_blocks_only_for_staging_and_surfaces_errors(s3):
    sd = sample_state()
    uri = s3.uri("async")
    fut = async_save(sd, uri, storage_options=s3.options, step=3)
    sd["w"].add_(1.0)  # mutating after return must not change what is saved
    fut.result(timeout=120)
    expected = sample_state()
    assert_state_equal(load_single(uri, s3.options), expected)
    assert open_checkpoint(uri, s3.options).step == 3
    again = async_save(sample_state(), uri, storage_options=s3.options)
    with pytest.raises(CommitConflictError, match="already committed"):
        again.result(timeout=120)
    open_checkpoint(uri, s3.options).verify(deep=True)  # refused before a byte went
    assert_state_equal(load_single(uri, s3.options), expected)


def test_writer_is_picklable(s3):
    w = CloudStorageWriter(s3.uri("p"), storage_options=s3.options, key_spread=2)
    clone = pickle.loads(pickle.dumps(w))
    assert clone.uri == w.uri and clone.key_spread == 2
    buf = io.BytesIO()
    torch.save(sample_state()["w"], buf)
    clone.store.put("probe", buf.getvalue())
    assert open_store(s3.uri("p"), s3.options).get("probe") == buf.getvalue()


def test_dcp_module_doc_mentions_format():
    import cloudckpt.dcp as m

    assert "FileSystemReader" in (m.__doc__ or "")
    assert Path(m.__file__).parts[-2:] == ("dcp", "__init__.py")


def test_torch_async_save_with_our_writer(local):
    uri = local.uri("torch-async")
    fut = dcp.async_save(sample_state(), storage_writer=CloudStorageWriter(
        uri, storage_options=local.options), no_dist=True)
    fut.result(timeout=120)
    open_checkpoint(uri, local.options).verify(deep=True)
    assert_state_equal(load_single(uri, local.options), sample_state())


def test_item_checksums_are_packed_and_a_wrong_one_is_refused(s3):
    """Each file's item CRC32Cs are one packed string in the manifest; a wrong or
    mangled CRC is refused."""
    import base64
    import struct

    uri = s3.uri("step-1")
    save_local_single(sample_state(), uri, s3.options)
    store = open_store(uri, s3.options)
    manifest = json.loads(store.get(MANIFEST_NAME))
    packed = manifest["metadata"]["dcp"]["item_crcs"]
    assert "items" not in manifest["metadata"]["dcp"]
    md = cloud_dcp.CloudStorageReader(uri, storage_options=s3.options).read_metadata()
    for path, blob in packed.items():
        raw = base64.b64decode(blob)
        offsets = sorted(off for off, _ in struct.iter_unpack("<Q4s", raw))
        assert len(raw) == 12 * len(offsets)
        assert offsets == sorted(i.offset for i in md.storage_data.values()
                                 if i.relative_path == path)

    def recommit(dcp_meta: object) -> None:
        manifest["metadata"]["dcp"] = dcp_meta
        store.delete([MANIFEST_NAME])
        store.put(MANIFEST_NAME, json.dumps(manifest).encode())

    recommit({"item_crcs": packed, "key_spread": 0})
    assert_state_equal(load_single(uri, s3.options), sample_state())

    path, blob = next(iter(packed.items()))
    items = list(struct.iter_unpack("<Q4s", base64.b64decode(blob)))
    off, crc = items[0]
    items[0] = (off, b"\0\0\0\0" if crc != b"\0\0\0\0" else b"\1\1\1\1")
    wrong = {**packed, path: base64.b64encode(
        b"".join(struct.pack("<Q4s", o, c) for o, c in items)).decode()}
    recommit({"item_crcs": wrong, "key_spread": 0})
    with pytest.raises(CorruptCheckpointError):
        load_single(uri, s3.options)

    recommit({"item_crcs": {p: "not base64!" for p in packed}, "key_spread": 0})
    with pytest.raises(CorruptCheckpointError, match="item checksums .* malformed"):
        load_single(uri, s3.options)
    for malformed in ({"item_crcs": {p: 7 for p in packed}}, {"item_crcs": list(packed)},
                      ["item_crcs"]):
        recommit(malformed)
        with pytest.raises(CorruptCheckpointError, match="item checksums .*malformed"):
            load_single(uri, s3.options)


@pytest.mark.parametrize("how", ["cloudckpt", "torch"])
def test_gloo_ranks_read_manifest_and_metadata_once_per_job(s3, s3_server, tmp_path, how):
    """Three gloo ranks load (resharding a 2-rank save) through a proxy that logs every
    request: the manifest and .metadata are read once in all, and nothing is listed;
    through cloudckpt.dcp.load, or torch's dcp.load with share_metadata=True."""
    from cloudckpt_testkit import FaultProxy

    uri, ref = s3.uri("w2"), str(tmp_path / "ref.pt")
    run_ranks("dcp_workers.save_sharded", 2, uri, s3.options_json(), ref)
    with FaultProxy(s3_server.endpoint) as proxy:
        opts = json.loads(s3.options_json())
        opts["endpoint_url"] = proxy.endpoint
        assert run_ranks("dcp_workers.load_shared_and_compare", 3, uri, json.dumps(opts), ref,
                         how) == {0: True, 1: True, 2: True}
        prefix = uri.split("://", 1)[1].split("/", 1)[1]
        gets = [r.target.split("?")[0] for r in proxy.request_log if r.method == "GET"]
        assert sum(t.endswith(f"{prefix}/{MANIFEST_NAME}") for t in gets) == 1
        assert sum(t.endswith(f"{prefix}/.metadata") for t in gets) == 1
        assert all(t.endswith((MANIFEST_NAME, ".metadata", ".distcp")) for t in gets
                   if prefix in t), gets
        assert not [r for r in proxy.request_log if "list-type" in r.target]


def test_items_reach_the_stream_in_a_few_writes_with_their_bytes_and_crcs():
    """torch.save writes each tensor as ~40 pieces; the stream beneath sees a few per
    item, and the same bytes, offsets and CRC32Cs as each item written alone."""
    from torch.distributed.checkpoint.planner import WriteItemType

    from cloudckpt.dcp.units import serialize
    from cloudckpt.serialization.torchsave import save_item
    from cloudckpt.util.crc import crc32c_hex

    class Recorder(io.BytesIO):
        calls = given = 0

        def write(self, data, crc32c=None):  # type: ignore[override]
            Recorder.calls += 1
            if crc32c is not None:  # a large write's CRC32C, computed once for both
                assert f"{crc32c:08x}" == crc32c_hex(data)
                Recorder.given += 1
            return super().write(data)

    class Item:
        def __init__(self, data):
            self.data, self.type = data, WriteItemType.TENSOR

    class Planner:
        def resolve_data(self, item):
            return item.data

    tensors = [torch.arange(n, dtype=torch.float32) for n in (1, 5000, 300_000, 7)]
    out = Recorder()
    placed = serialize([Item(t) for t in tensors], Planner(), out)
    stream = out.getvalue()
    assert Recorder.calls <= 3 * len(tensors)
    assert Recorder.given == 1  # the 1.2 MB tensor's bytes
    pos = 0
    for t, (_, start, length, crc) in zip(tensors, placed, strict=True):
        alone = io.BytesIO()
        save_item(t, alone)
        assert (start, length) == (pos, len(alone.getvalue()))
        assert stream[start:start + length] == alone.getvalue()
        assert crc == crc32c_hex(alone.getvalue())
        assert torch.equal(torch.load(io.BytesIO(stream[start:start + length])), t)
        pos += length
    assert pos == len(stream)


def test_a_saved_tensor_is_sent_from_its_own_memory(s3, monkeypatch):
    """A CPU tensor of the state is lent to the upload (no copy of its bytes); one
    the writer had to copy first (a strided view, compacted) is written as a copy,
    which the upload may not hold on to. Both load back bit-exact."""
    from cloudckpt.storage.writers import ObjectWriter

    lent: list[int] = []
    real = ObjectWriter.lend

    def recorded(self, data, crc32c=None):
        lent.append(torch.frombuffer(data, dtype=torch.uint8).data_ptr())
        return real(self, data, crc32c)

    monkeypatch.setattr(ObjectWriter, "lend", recorded)
    own = torch.randn(256, 1024)
    strided = torch.randn(1024, 256).t()
    cloud_dcp.save({"own": own, "strided": strided}, s3.uri("ckpt"), storage_options=s3.options)
    assert lent == [own.data_ptr()]
    # The tensors' CRC32Cs were computed once and combined into the files': the
    # manifest's are those of the bytes stored.
    ckpt = open_checkpoint(s3.uri("ckpt"), storage_options=s3.options)
    store = open_store(s3.uri("ckpt"), s3.options)
    for path, entry in ckpt.manifest.files.items():
        assert crc32c_hex(store.get(path)) == entry.crc32c, path
    back = {"own": torch.zeros_like(own), "strided": torch.zeros(256, 1024)}
    cloud_dcp.load(back, s3.uri("ckpt"), storage_options=s3.options)
    assert torch.equal(back["own"], own) and torch.equal(back["strided"], strided)


def test_a_loaded_tensor_is_received_into_its_own_memory(s3, monkeypatch):
    """A tensor whose destination takes its bytes as they are is received there
    straight from the socket: the sinks are handed views of the destination, not
    copies to make, both for an item read in one request and for one read as
    parallel parts (here over 2 MiB, two reader parts); its pages are faulted in
    beforehand, off the loop that receives."""
    import numpy as np

    from cloudckpt.dcp.placement import ItemStream
    from cloudckpt.storage.transfer.ranges import Filling
    from cloudckpt.util import pages

    pieces: list[tuple[int, int]] = []  # (address, bytes) of every piece a sink took

    def recorded(real):
        def sink(self, *args):
            data = args[-1]
            pieces.append((np.frombuffer(data, np.uint8).ctypes.data, memoryview(data).nbytes))
            return real(self, *args)
        return sink

    monkeypatch.setattr(ItemStream, "__call__", recorded(ItemStream.__call__))
    monkeypatch.setattr(Filling, "put", recorded(Filling.put))
    faulted: list[tuple[int, int]] = []  # pages faulted in before the bytes came
    real_populate = pages.populate
    monkeypatch.setattr(pages, "populate",
                        lambda at, n: faulted.append((at, n)) or real_populate(at, n))
    g = torch.Generator().manual_seed(5)
    sd = {"one": torch.randn(384, 1024, generator=g), "parts": torch.randn(1024, 1024, generator=g)}
    cloud_dcp.save(sd, s3.uri("ckpt"), storage_options=s3.options)
    back = {k: torch.zeros_like(v) for k, v in sd.items()}
    cloud_dcp.load(back, s3.uri("ckpt"), storage_options={**s3.options, "part_size": 1 << 20})
    for name, t in back.items():
        assert torch.equal(t, sd[name]), name
        lo, hi = t.data_ptr(), t.data_ptr() + t.nbytes
        inside = sum(n for at, n in pieces if lo <= at and at + n <= hi)
        assert inside >= t.nbytes - (1 << 20), (name, inside, t.nbytes)
        assert sum(n for at, n in faulted if lo <= at and at + n <= hi) == t.nbytes, name
