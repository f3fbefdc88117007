"""Manifest-committed checkpoints on every backend."""

from __future__ import annotations

import json
import os

import pytest
from helpers import torn_save

from cloudckpt import (
    MANIFEST_NAME,
    CheckpointNotFoundError,
    CheckpointWriter,
    CommitConflictError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    ManifestError,
    delete_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    open_checkpoint,
    open_store,
)
from cloudckpt.movement.checkpoint_copy import copy_checkpoint


def write_ckpt(uri, options, step, n=5, size=2000):
    objs = {f"shard-{i}.bin": os.urandom(size + i) for i in range(n)}
    with CheckpointWriter(uri, step=step, metadata={"note": "t"}, storage_options=options) as w:
        w.put_many(objs)
    return objs


def test_write_commit_open_read(backend):
    uri = backend.uri("step-7")
    objs = write_ckpt(uri, backend.options, 7)
    with CheckpointWriter(backend.uri("step-8"), step=8, storage_options=backend.options) as w:
        with w.open("nested/stream.bin") as f:
            f.write(b"abc" * 1000)
            f.write(b"def")
    ckpt = open_checkpoint(uri, backend.options)
    assert ckpt.step == 7 and ckpt.metadata == {"note": "t"}
    assert ckpt.files == sorted(objs)
    assert ckpt.total_size == sum(map(len, objs.values()))
    for name, data in objs.items():
        assert ckpt.read(name) == data
    assert ckpt.read_range("shard-3.bin", 100, 200) == objs["shard-3.bin"][100:200]
    assert dict(ckpt.iter_objects()) == objs
    ckpt.verify(deep=True)
    s8 = open_checkpoint(backend.uri("step-8"), backend.options)
    assert s8.read("nested/stream.bin") == b"abc" * 1000 + b"def"


def test_list_and_latest_only_see_committed(backend):
    assert latest_checkpoint(backend.root, backend.options) is None
    write_ckpt(backend.uri("step-1"), backend.options, 1)
    write_ckpt(backend.uri("step-10"), backend.options, 10)
    write_ckpt(backend.uri("step-2"), backend.options, 2)
    # A torn save with a higher step: objects but no manifest.
    torn_save(backend.uri("step-99"), backend.options, {"shard-0.bin": b"partial"})
    committed = list_checkpoints(backend.root, backend.options)
    assert [(c.name, c.step) for c in committed] == [("step-1", 1), ("step-2", 2), ("step-10", 10)]
    everything = list_checkpoints(backend.root, backend.options, include_uncommitted=True)
    assert {c.name: c.committed for c in everything}["step-99"] is False
    assert latest_checkpoint(backend.root, backend.options).step == 10
    with pytest.raises(IncompleteCheckpointError, match="no manifest"):
        open_checkpoint(backend.uri("step-99"), backend.options)
    with pytest.raises(CheckpointNotFoundError, match="nothing is stored"):
        open_checkpoint(backend.uri("step-404"), backend.options)


def test_error_inside_writer_leaves_no_manifest(backend):
    uri = backend.uri("step-3")
    with pytest.raises(ValueError):
        with CheckpointWriter(uri, step=3, storage_options=backend.options) as w:
            w.put("a.bin", b"a")
            raise ValueError("training blew up")
    store = open_store(uri, backend.options)
    assert not store.exists(MANIFEST_NAME)
    with pytest.raises(IncompleteCheckpointError):
        open_checkpoint(uri, backend.options)
    assert list_checkpoints(backend.root, backend.options) == []


def test_committed_checkpoints_are_immutable(backend):
    uri = backend.uri("step-1")
    write_ckpt(uri, backend.options, 1)
    with pytest.raises(CommitConflictError, match="already committed"):
        CheckpointWriter(uri, step=1, storage_options=backend.options)


def test_racing_commits_have_one_winner(backend):
    uri = backend.uri("step-5")
    a = CheckpointWriter(uri, step=5, metadata={"who": "a"}, storage_options=backend.options)
    b = CheckpointWriter(uri, step=5, metadata={"who": "b"}, storage_options=backend.options)
    a.put("x.bin", b"from a")
    # b is stopped before it writes: its objects would land in a's checkpoint.
    with pytest.raises(CommitConflictError, match="another save is writing"):
        b.put("x.bin", b"from b")
    a.commit()
    with pytest.raises(CommitConflictError):
        b.commit()
    ckpt = open_checkpoint(uri, backend.options)
    assert ckpt.metadata == {"who": "a"} and ckpt.read("x.bin") == b"from a"
    assert not open_store(uri, backend.options).exists(".cloudckpt-writer.json")


def test_flipped_byte_is_detected(backend):
    uri = backend.uri("step-1")
    objs = write_ckpt(uri, backend.options, 1)
    store = open_store(uri, backend.options)
    bad = bytearray(objs["shard-2.bin"])
    bad[100] ^= 0x01
    store.put("shard-2.bin", bytes(bad))
    ckpt = open_checkpoint(uri, backend.options)
    ckpt.verify(deep=False)  # same size: only the checksum can tell
    with pytest.raises(CorruptCheckpointError, match="shard-2.bin") as exc:
        ckpt.verify(deep=True)
    assert set(exc.value.problems) == {"shard-2.bin"}
    with pytest.raises(CorruptCheckpointError, match="shard-2.bin.*crc32c"):
        ckpt.read("shard-2.bin")
    assert ckpt.read("shard-1.bin") == objs["shard-1.bin"]
    store.put("shard-3.bin", b"short")
    store.delete(["shard-4.bin"])
    with pytest.raises(CorruptCheckpointError) as exc:
        ckpt.verify()
    assert exc.value.problems.keys() == {"shard-3.bin", "shard-4.bin"}


@pytest.mark.parametrize("evil", ["../x", "/etc/x", "s3://other/x", "a/../../x", "C:/x"])
def test_manifest_paths_outside_the_checkpoint_are_rejected(backend, evil):
    uri = backend.uri("step-1")
    write_ckpt(uri, backend.options, 1, n=1)
    store = open_store(uri, backend.options)
    doc = json.loads(store.get(MANIFEST_NAME))
    doc["files"][evil] = {"size": 1, "crc32c": "00000000"}
    store.put(MANIFEST_NAME, json.dumps(doc).encode())
    with pytest.raises(ManifestError, match="relative paths inside the checkpoint"):
        open_checkpoint(uri, backend.options)


@pytest.mark.parametrize("garbage", [b"{not json", b"[]", b'{"format": "other"}',
                                     b'{"format": "cloudckpt.core.manifest", "version": 99}'])
def test_malformed_manifest_is_rejected(memory, garbage):
    store = open_store(memory.uri("step-1"))
    store.put(MANIFEST_NAME, garbage)
    with pytest.raises(ManifestError):
        open_checkpoint(store.uri)
    listed = list_checkpoints(memory.root, include_uncommitted=True)
    assert [(c.committed, bool(c.error)) for c in listed] == [(False, True)]


def test_copy_between_backends_keeps_identity(s3, azure, gcs, local):
    objs = write_ckpt(s3.uri("step-4"), s3.options, 4, n=6, size=50_000)
    to_azure = copy_checkpoint(s3.uri("step-4"), azure.uri("step-4"), src_options=s3.options,
                               dst_options=azure.options)
    to_gcs = copy_checkpoint(to_azure, gcs.uri("step-4"), dst_options=gcs.options)
    to_local = copy_checkpoint(to_gcs, local.uri("step-4"), dst_options=local.options)
    src = open_checkpoint(s3.uri("step-4"), s3.options)
    for ckpt in (to_azure, to_gcs, to_local):
        assert ckpt.manifest.to_json() == src.manifest.to_json()
        ckpt.verify(deep=True)
        assert dict(ckpt.iter_objects()) == objs
    # Copying again is a no-op; onto a different checkpoint it is a conflict.
    copy_checkpoint(src, local.uri("step-4"), dst_options=local.options)
    write_ckpt(local.uri("other"), local.options, 9, n=1)
    with pytest.raises(CommitConflictError):
        copy_checkpoint(src, local.uri("other"), dst_options=local.options)


def test_copy_refuses_a_corrupt_source(memory, local):
    objs = write_ckpt(memory.uri("s"), {}, 1, n=3)
    store = open_store(memory.uri("s"))
    store.put("shard-1.bin", objs["shard-1.bin"][::-1])
    with pytest.raises(CorruptCheckpointError, match="shard-1.bin"):
        copy_checkpoint(memory.uri("s"), local.uri("s"), dst_options=local.options)
    assert not open_store(local.uri("s"), local.options).exists(MANIFEST_NAME)


def test_large_objects_are_copied_streamed(memory, s3):
    big = os.urandom(3 * 1024 * 1024 + 17)
    with CheckpointWriter(memory.uri("s"), step=1) as w:
        w.put("big.bin", big)
    src = open_checkpoint(open_store(memory.uri("s"), {"part_size": 1024 * 1024}))
    out = copy_checkpoint(src, s3.uri("s"), dst_options=s3.options)
    assert out.read("big.bin") == big


def test_delete_checkpoint(backend):
    write_ckpt(backend.uri("step-1"), backend.options, 1, n=3)
    assert delete_checkpoint(backend.uri("step-1"), backend.options) == 4
    assert open_store(backend.root, backend.options).list() == []
    torn_save(backend.uri("torn"), backend.options, {"a": b"a"})
    with pytest.raises(IncompleteCheckpointError):
        delete_checkpoint(backend.uri("torn"), backend.options)
    assert delete_checkpoint(backend.uri("torn"), backend.options, force=True) == 2  # + claim
    assert open_store(backend.root, backend.options).list(internal=True) == []
    with pytest.raises(CheckpointNotFoundError):
        delete_checkpoint(backend.uri("step-1"), backend.options)


def test_large_objects_read_in_parallel_ranges_even_inside_batches(s3):
    opts = {**s3.options, "part_size": 1024 * 1024, "max_concurrency": 4}
    objs = {f"big-{i}.bin": os.urandom(3 * 1024 * 1024 + i) for i in range(6)}
    with CheckpointWriter(s3.uri("big"), step=1, storage_options=opts) as w:
        w.put_many(objs)
    ckpt = open_checkpoint(s3.uri("big"), opts)
    assert ckpt.read("big-1.bin") == objs["big-1.bin"]  # ranged, in parallel
    # read_many runs reads on the pool; their ranged reads must not deadlock it.
    assert ckpt.read_many(sorted(objs)) == objs
    store = open_store(s3.uri("big"), s3.options)
    store.put("big-2.bin", objs["big-2.bin"][: 2 * 1024 * 1024])
    with pytest.raises(CorruptCheckpointError, match="big-2.bin"):
        ckpt.read("big-2.bin")
