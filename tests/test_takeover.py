"""A save that took a prefix over writes under names of its own.

A writer whose claim was taken over may still run (a partitioned node). Its objects
have their own paths; the writer that took over writes its objects under
``.cloudckpt-writers/<its id>/`` and its manifest says so, so nothing the first one
writes afterwards changes the committed checkpoint. Over moto, fake-gcs-server and
local disk; the stock DCP reader loads a download of such a checkpoint.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import load as stock_load

from cloudckpt import dcp
from cloudckpt.core.checkpoint import CheckpointWriter
from cloudckpt.core.committed import open_checkpoint
from cloudckpt.core.deletion import delete_checkpoint
from cloudckpt.core.manifest import MANIFEST_NAME, Manifest
from cloudckpt.errors import CommitConflictError, ManifestError
from cloudckpt.movement.checkpoint_copy import download
from cloudckpt.names import WRITER_AREAS
from cloudckpt.storage import open_store
from cloudckpt.training import multipart


@pytest.fixture(params=["file", "s3", "gcs", "azure"])
def where(request):
    return request.getfixturevalue("local" if request.param == "file" else request.param)


def state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 256, generator=g), "b": torch.randn(256, generator=g)}


def test_a_fresh_save_writes_every_object_at_its_own_path(local) -> None:
    with CheckpointWriter(local.uri("step-1"), storage_options=local.options) as w:
        w.put_many({"a.bin": b"a", "sub/b.bin": b"b"})
    ckpt = open_checkpoint(local.uri("step-1"), local.options)
    assert ckpt.manifest.standard and not ckpt.manifest.moved
    keys = {o.key for o in open_store(local.uri("step-1"), local.options).list()}
    assert keys == {"a.bin", "sub/b.bin", MANIFEST_NAME}


def test_the_writer_taken_over_cannot_change_a_committed_full_save(where) -> None:
    """The zombie: A's claim is taken over by B, which commits; A writes on, over
    every name, and tries to commit. B's checkpoint verifies deep with B's bytes."""
    uri = where.uri("run", "step-7")
    a = CheckpointWriter(uri, storage_options=where.options, step=7)
    a.put_many({"model.bin": b"A" * 4096, "state/rank-0.bin": b"a-state"})
    b = CheckpointWriter(uri, storage_options=where.options, step=7, takeover=True)
    b.put_many({"model.bin": b"B" * 4096})
    with b.open("state/rank-0.bin") as f:
        f.write(b"b-state")
    committed = b.commit()
    assert committed.manifest.moved == ["model.bin", "state/rank-0.bin"]
    a.put_many({"model.bin": b"Z" * 4096, "state/rank-0.bin": b"zombie"})
    with pytest.raises(CommitConflictError):
        a.commit()
    ckpt = open_checkpoint(uri, where.options)
    assert ckpt.manifest.commit_id == committed.manifest.commit_id
    assert ckpt.manifest.writer_area.startswith(f"{WRITER_AREAS}/")
    ckpt.verify(deep=True)
    assert ckpt.read("model.bin") == b"B" * 4096
    assert ckpt.read("state/rank-0.bin") == b"b-state"
    # Deleting it takes its moved objects and the zombie's leftovers alike.
    delete_checkpoint(uri, where.options)
    assert open_store(uri, where.options).list(internal=True) == []


def test_a_taken_over_training_save_survives_every_name_overwritten(where, tmp_path) -> None:
    """A save of parts (DCP state, per-rank bytes, shared bytes) that took the prefix
    over: overwriting each object's own path afterwards changes nothing it reads, and
    its download loads with torch's own reader."""
    uri = where.uri("run", "step-3")
    store = open_store(uri, where.options)
    zombie = CheckpointWriter(store)
    zombie.claim()  # a writer elsewhere, still running
    zombie.put("model/__0_0.distcp", b"zombie")
    model = state(3)
    parts = [multipart.DcpPart("model", model, step=3),
             multipart.RankBytes(lambda r: f"state/rank-{r}.bin", b"rank bytes"),
             multipart.SharedBytes("state/shared.json", b'{"step": 3}')]
    ckpt = multipart.save(store, parts, step=3, takeover=True)
    assert ckpt is not None
    moved = set(ckpt.manifest.moved)
    assert {"model/.metadata", "state/rank-0.bin", "state/shared.json"} <= moved
    assert set(ckpt.files) - moved == {f"model/{MANIFEST_NAME}"}
    part = Manifest.from_json(ckpt.read(f"model/{MANIFEST_NAME}"))
    assert (part.writer_area, part.writer_depth) == (ckpt.manifest.writer_area, 1)
    for path in ckpt.files:  # what a zombie still running could write
        if not path.endswith(MANIFEST_NAME):
            store.put(path, b"overwritten by the zombie")
    again = open_checkpoint(uri, where.options)
    again.verify(deep=True)
    assert again.read("state/shared.json") == b'{"step": 3}'
    out = {k: torch.zeros_like(v) for k, v in model.items()}
    dcp.load(out, store.child("model"))
    assert all(torch.equal(out[k], v) for k, v in model.items())
    # A download holds the standard layout: every object at its own path.
    download(uri, tmp_path / "dl", where.options)
    local = open_checkpoint(f"file://{tmp_path / 'dl'}")
    assert local.manifest.standard
    part = Manifest.from_json((tmp_path / "dl" / "model" / MANIFEST_NAME).read_bytes())
    assert part.standard
    out = {k: torch.zeros_like(v) for k, v in model.items()}
    stock_load(out, storage_reader=FileSystemReader(str(tmp_path / "dl" / "model")))
    assert all(torch.equal(out[k], v) for k, v in model.items())


def test_a_dcp_save_that_takes_over_an_abandoned_claim_moves_its_files(s3) -> None:
    uri = s3.uri("dcp", "step-1")
    first = CheckpointWriter(uri, storage_options=s3.options)
    first.put("__0_0.distcp", b"left by a save that failed")
    first.abandon()
    model = state(1)
    ckpt = dcp.save(model, uri, storage_options=s3.options)
    assert ckpt is not None and ckpt.manifest.moved == sorted(ckpt.files)
    open_store(uri, s3.options).put("__0_0.distcp", b"late bytes of the failed save")
    out = {k: torch.zeros_like(v) for k, v in model.items()}
    dcp.load(out, uri, storage_options=s3.options)
    assert all(torch.equal(out[k], v) for k, v in model.items())


def test_manifests_with_bad_writer_areas_are_refused() -> None:
    area = f"{WRITER_AREAS}/{'ab' * 16}"
    good = {"format": "cloudckpt.core.manifest", "version": 1, "created": 1.0,
            "files": {"a.bin": {"size": 1, "crc32c": "00000000", "moved": True}},
            "writer": {"area": area, "depth": 0}}
    manifest = Manifest.from_json(json.dumps(good).encode())
    assert (manifest.moved, manifest.writer_area) == (["a.bin"], area)
    assert Manifest.from_json(manifest.to_json()) == manifest
    assert manifest.materialized().standard
    for writer in (None, {"area": "../x", "depth": 0}, {"area": area, "depth": -1},
                   {"area": area, "depth": True}, {"area": area}, "x"):
        doc = {**good, "writer": writer}
        with pytest.raises(ManifestError, match="'writer'"):
            Manifest.from_json(json.dumps(doc).encode())
    plain = {**good, "files": {"a.bin": {"size": 1, "crc32c": "00000000"}}}
    with pytest.raises(ManifestError, match="'writer'"):
        Manifest.from_json(json.dumps(plain).encode())
    both = {**good, "files": {"a.bin": {"size": 1, "crc32c": "00000000", "moved": True,
                                        "blob": "ab" * 32}}, "blob_depth": 1}
    with pytest.raises(ManifestError, match="moved"):
        Manifest.from_json(json.dumps(both).encode())
