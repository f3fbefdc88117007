"""CloudStorageWriter/CloudStorageReader as drop-ins for torch's DCP writers and readers:
``overwrite`` with torch's meaning, replacing a committed checkpoint safely (nothing
committed goes before its replacement commits, committed bytes are never written over,
a zombie cannot corrupt either generation), ``validate_checkpoint_id``, the refusal of
a checkpoint torch's own writer left in a bucket, and torch's writer options.

Over moto, fake-gcs-server, Azurite and local disk, through torch's own ``dcp.save`` and
``dcp.load``.
"""

from __future__ import annotations

import inspect
import io
import json
import logging
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import SerializationFormat
from torch.distributed.checkpoint.staging import AsyncStager

import cloudckpt.dcp as cloud_dcp
from cloudckpt.cli import main as cli
from cloudckpt.core import replacing
from cloudckpt.core.checkpoint import CheckpointWriter
from cloudckpt.core.committed import open_checkpoint
from cloudckpt.core.deletion import delete_checkpoint
from cloudckpt.core.manifest import MANIFEST_NAME, Manifest
from cloudckpt.dcp import CloudStorageReader, CloudStorageWriter
from cloudckpt.errors import CommitConflictError, ConfigError, ManifestError, NotACheckpointError
from cloudckpt.movement.checkpoint_copy import download
from cloudckpt.names import WRITER_AREAS
from cloudckpt.storage import open_store


@pytest.fixture(params=["file", "s3", "gcs", "azure"])
def where(request):
    return request.getfixturevalue("local" if request.param == "file" else request.param)


def state(seed: int, n: int = 2) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"t{i}": torch.randn(64, 128, generator=g) for i in range(n)}


def load(uri: str, options: dict, like: dict[str, torch.Tensor],
         reader: CloudStorageReader | None = None) -> dict[str, torch.Tensor]:
    out = {k: torch.zeros_like(v) for k, v in like.items()}
    dcp.load(out, storage_reader=reader or CloudStorageReader(uri, storage_options=options),
             no_dist=True)
    return out


def equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def keys(uri: str, options: dict) -> set[str]:
    return {o.key for o in open_store(uri, options).list(internal=True)}


# ------------------------------------------------------------------ overwrite


def test_a_save_onto_a_committed_checkpoint_replaces_it_as_torch_s_writer_does(
        where, tmp_path, caplog) -> None:
    uri, opts = where.uri("run", "step-1"), where.options
    first, second = state(1, n=3), state(2, n=1)
    writer = CloudStorageWriter(uri, storage_options=opts, thread_count=3, file_size=1 << 14)
    assert writer.overwrite is True  # torch's default
    dcp.save(first, storage_writer=writer, no_dist=True)
    old = open_checkpoint(uri, opts).manifest
    assert old.standard and len([f for f in old.files if f.endswith(".distcp")]) == 3
    with caplog.at_level(logging.WARNING, logger="cloudckpt"):
        dcp.save(second, storage_writer=CloudStorageWriter(uri, storage_options=opts),
                 no_dist=True)
    assert "replacing the checkpoint committed at" in caplog.text
    ckpt = open_checkpoint(uri, opts)
    ckpt.verify(deep=True)
    assert ckpt.manifest.commit_id != old.commit_id
    assert ckpt.manifest.moved == sorted(ckpt.files)  # not one committed name written over
    assert set(ckpt.manifest.superseded) == set(old.files)
    area = ckpt.manifest.writer_area
    assert keys(uri, opts) == {MANIFEST_NAME, *(f"{area}/{p}" for p in ckpt.files)}
    assert equal(load(uri, opts, second), second)
    download(uri, tmp_path / "dl", opts)  # the standard layout, for torch's own reader
    out = {k: torch.zeros_like(v) for k, v in second.items()}
    dcp.load(out, storage_reader=FileSystemReader(str(tmp_path / "dl")), no_dist=True)
    assert equal(out, second)


def test_overwrite_false_refuses_before_any_rank_writes(s3) -> None:
    uri, opts = s3.uri("step-1"), s3.options
    first = state(1)
    dcp.save(first, storage_writer=CloudStorageWriter(uri, storage_options=opts), no_dist=True)
    before = keys(uri, opts)
    with pytest.raises(CheckpointException, match="Checkpoint already exists") as exc:
        dcp.save(state(2), storage_writer=CloudStorageWriter(uri, storage_options=opts,
                                                             overwrite=False), no_dist=True)
    assert "overwrite=True" in str(exc.value)
    with pytest.raises(CommitConflictError, match="overwrite=True.*replaces it"):
        cloud_dcp.save(state(2), uri, storage_options=opts)  # cloudckpt's own: commit-once
    assert keys(uri, opts) == before
    assert equal(load(uri, opts, first), first)
    cloud_dcp.save(state(3), uri, storage_options=opts, overwrite=True)
    assert equal(load(uri, opts, first), state(3))


def test_the_old_checkpoint_stays_whole_until_its_replacement_commits(s3, monkeypatch) -> None:
    uri, opts = s3.uri("step-1"), s3.options
    first = state(1)
    cloud_dcp.save(first, uri, storage_options=opts)
    old = open_checkpoint(uri, opts).manifest
    # A replacement that fails before its commit leaves the old checkpoint as it was.
    failing = CheckpointWriter(uri, storage_options=opts, kind="dcp", replace=True)
    failing.put_many({".metadata": b"new", "__0_0.distcp": b"new"})
    failing.abandon()
    ckpt = open_checkpoint(uri, opts)
    ckpt.verify(deep=True)
    assert ckpt.manifest.commit_id == old.commit_id and equal(load(uri, opts, first), first)
    # One cut short between its swap and deleting the old objects: they stay listed in
    # the new manifest, and the next replace (or rm) deletes them.
    monkeypatch.setattr(replacing, "clear", lambda *args: None)
    cloud_dcp.save(state(2), uri, storage_options=opts, overwrite=True)
    monkeypatch.undo()
    ckpt = open_checkpoint(uri, opts)
    assert set(old.files) <= set(ckpt.manifest.superseded) and set(old.files) <= keys(uri, opts)
    cloud_dcp.save(state(3), uri, storage_options=opts, overwrite=True)
    left = keys(uri, opts)
    assert not set(old.files) & left and not set(ckpt.manifest.superseded) & left
    assert equal(load(uri, opts, first), state(3))
    delete_checkpoint(uri, opts)
    assert keys(uri, opts) == set()


def test_a_zombie_of_the_replaced_save_cannot_corrupt_the_replacement(where) -> None:
    """The first save's writer still runs after another took its claim over and
    committed, and after a third replaced that: it writes over every name it knows and
    tries to commit. The replacement verifies deep with its own bytes."""
    uri, opts = where.uri("run", "step-2"), where.options
    zombie = CheckpointWriter(uri, storage_options=opts, kind="dcp")
    zombie.put_many({"a.bin": b"zombie 1"})
    taker = CheckpointWriter(uri, storage_options=opts, kind="dcp", takeover=True)
    taker.put_many({"a.bin": b"gen 1"})
    taker.commit()
    again = CheckpointWriter(uri, storage_options=opts, kind="dcp", replace=True)
    again.put_many({"a.bin": b"gen 2", "b.bin": b"gen 2"})
    committed = again.commit()
    zombie.put_many({"a.bin": b"zombie 2", "b.bin": b"zombie 2"})
    with pytest.raises(CommitConflictError):
        zombie.commit()
    ckpt = open_checkpoint(uri, opts)
    assert ckpt.manifest.commit_id == committed.manifest.commit_id
    ckpt.verify(deep=True)
    assert (ckpt.read("a.bin"), ckpt.read("b.bin")) == (b"gen 2", b"gen 2")


def test_a_taken_over_replacement_cannot_commit_over_the_one_that_took_it_over(where) -> None:
    """Two replacements of one checkpoint, the first taken over while it still runs:
    whether it fails its claim check or passed it just before, only the second's
    commit counts, and the first's objects are removed when it loses the swap."""
    uri, opts = where.uri("run", "step-3"), where.options
    with CheckpointWriter(uri, storage_options=opts, kind="dcp") as w:
        w.put("a.bin", b"gen 0")
    first = CheckpointWriter(uri, storage_options=opts, kind="dcp", replace=True)
    first.put_many({"a.bin": b"first"})
    second = CheckpointWriter(uri, storage_options=opts, kind="dcp", replace=True, takeover=True)
    second.put_many({"a.bin": b"second"})
    committed = second.commit()
    first.put_many({"b.bin": b"first, later"})  # it does not know yet
    with pytest.raises(CommitConflictError, match="taken over"):
        first.commit()
    first._claim.check = lambda: None  # as if it passed its check just before the takeover
    with pytest.raises(CommitConflictError, match="replaced or deleted by another save"):
        first.commit()
    ckpt = open_checkpoint(uri, opts)
    assert ckpt.manifest.commit_id == committed.manifest.commit_id
    ckpt.verify(deep=True)
    assert ckpt.read("a.bin") == b"second"
    assert not any(k.startswith(f"{WRITER_AREAS}/{first._claim.writer}/")
                   for k in keys(uri, opts))


def test_only_a_checkpoint_of_the_same_kind_and_standing_alone_is_replaced(local) -> None:
    opts = local.options
    with CheckpointWriter(local.uri("generic"), storage_options=opts) as w:
        w.put("model.bin", b"x")
    with pytest.raises(CommitConflictError,
                       match="kind 'generic', which a save of kind 'dcp' does not replace"):
        cloud_dcp.save(state(1), local.uri("generic"), storage_options=opts, overwrite=True)
    part = local.uri("step-1", "model")
    cloud_dcp.save(state(1), part, storage_options=opts)
    with CheckpointWriter(local.uri("step-1"), storage_options=opts) as w:
        w.add_part("model")
    with pytest.raises(CheckpointException, match="lies inside the checkpoint committed at"):
        dcp.save(state(2), storage_writer=CloudStorageWriter(part, storage_options=opts),
                 no_dist=True)
    open_checkpoint(local.uri("step-1"), opts).verify(deep=True)
    assert equal(load(part, opts, state(1)), state(1))


def test_an_incremental_save_replaces_and_its_unreferenced_blobs_are_swept(local) -> None:
    uri, opts = local.uri("run", "step-1"), local.options
    big = {"frozen": torch.randn(512, 1024), "head": torch.randn(512, 1024)}
    cloud_dcp.save(big, uri, storage_options=opts, incremental=True)
    old = set(open_checkpoint(uri, opts).manifest.blobs.values())
    changed = {"frozen": big["frozen"], "head": big["head"] + 1}
    cloud_dcp.save(changed, uri, storage_options=opts, incremental=True, overwrite=True)
    new = set(open_checkpoint(uri, opts).manifest.blobs.values())
    assert len(old - new) == 1  # the head's file; the frozen one's is referenced again
    area = {o.key for o in open_store(local.uri("run", "cloudckpt-blobs"), opts).list()
            if len(o.key) == 64}
    assert area == new  # the replaced generation's other blobs were swept
    assert equal(load(uri, opts, changed), changed)


def test_a_reader_used_again_after_a_replace_reads_the_new_checkpoint(s3) -> None:
    uri, opts = s3.uri("step-1"), s3.options
    cloud_dcp.save(state(1), uri, storage_options=opts)
    reader = CloudStorageReader(uri, storage_options=opts)
    assert equal(load(uri, opts, state(1), reader), state(1))
    cloud_dcp.save(state(2), uri, storage_options=opts, overwrite=True)
    assert equal(load(uri, opts, state(1), reader), state(2))


def test_superseded_keys_are_validated() -> None:
    area = f"{WRITER_AREAS}/{'ab' * 16}"
    doc = {"format": "cloudckpt.core.manifest", "version": 1, "created": 1.0,
           "files": {"a.bin": {"size": 1, "crc32c": "00000000", "moved": True}},
           "writer": {"area": area, "depth": 0}, "superseded": ["a.bin", "old/b.bin"]}
    manifest = Manifest.from_json(json.dumps(doc).encode())
    assert manifest.superseded == ("a.bin", "old/b.bin")
    assert Manifest.from_json(manifest.to_json()) == manifest
    assert manifest.materialized().superseded == ()
    for bad in (f"{area}/a.bin", "../x", "/abs"):
        with pytest.raises(ManifestError):
            Manifest.from_json(json.dumps({**doc, "superseded": [bad]}).encode())
    with pytest.raises(ManifestError, match="list of paths"):
        Manifest.from_json(json.dumps({**doc, "superseded": "a.bin"}).encode())


# ------------------------------------------------------------------ ids, refusals, options


@pytest.mark.parametrize("cls", [CloudStorageWriter, CloudStorageReader])
def test_validate_checkpoint_id_accepts_exactly_what_the_classes_open(cls, tmp_path) -> None:
    for good in ("s3://b/run/step-1", "gs://b/x", "az://c/x", "memory://m/x", "file:///tmp/x",
                 str(tmp_path / "x"), tmp_path / "x", "relative/dir"):
        assert cls.validate_checkpoint_id(good), good
    for bad in ("abc://abc.abc", "nosuchscheme://b/x", "s3://", "", None, 7):
        assert not cls.validate_checkpoint_id(bad), bad


def test_a_checkpoint_torch_s_fsspec_writer_left_says_how_to_use_cloudckpt(s3, s3_server,
                                                                        monkeypatch) -> None:
    """dcp.save(checkpoint_id="s3://...") with no storage_writer picks torch's FsspecWriter
    (torch offers no way to register another); cloudckpt pointed at the result says what
    to pass, and adopts it."""
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    uri, sd = s3.uri("torch-wrote"), state(1)
    dcp.save(sd, checkpoint_id=uri, no_dist=True)
    assert ".metadata" in keys(uri, s3.options) and MANIFEST_NAME not in keys(uri, s3.options)
    with pytest.raises(NotACheckpointError) as exc:
        cloud_dcp.load({k: torch.zeros_like(v) for k, v in sd.items()}, uri,
                       storage_options=s3.options)
    text = str(exc.value)
    assert "FsspecWriter" in text and "storage_writer=CloudStorageWriter(" in text
    assert f"cloudckpt adopt {uri}" in text
    assert cli(["-o", f"endpoint_url={s3.options['endpoint_url']}", "adopt", uri]) == 0
    assert equal(load(uri, s3.options, sd), sd)


def test_every_option_of_torch_s_writer_is_taken_or_refused_with_a_reason(local) -> None:
    params = inspect.signature(FileSystemWriter.__init__).parameters
    for name, p in params.items():  # each with torch's default: never a TypeError
        if name not in ("self", "path"):
            CloudStorageWriter(local.uri("x"), **{name: p.default})
    refusals = {"_extensions": [object()], "serialization_format": SerializationFormat.SAFETENSORS,
                "thread_count": 0, "per_thread_copy_ahead": -1, "sync_files": "no",
                "overwrite": None, "single_file_per_rank": 1, "cache_staged_state_dict": "y"}
    for name, value in refusals.items():
        with pytest.raises(ConfigError, match=name.lstrip("_")):
            CloudStorageWriter(local.uri("x"), **{name: value})
    with pytest.raises(ConfigError, match="thread_count.*or max_files"):
        CloudStorageWriter(local.uri("x"), thread_count=2, max_files=2)
    assert not Path(local.uri("x")).exists()  # refused before anything was written
    assert CloudStorageWriter(local.uri("x"), sync_files=False).store.backend.fsync is False
    cached = CloudStorageWriter(local.uri("x"), cache_staged_state_dict=True)
    assert isinstance(cached, AsyncStager) and cached.cache_staged_state_dict


@pytest.mark.parametrize("options, files", [
    ({"thread_count": 1}, 1), ({"thread_count": 3}, 3),
    ({"single_file_per_rank": False, "thread_count": 1}, 4)])
def test_thread_count_and_single_file_per_rank_lay_out_files_as_torch_s_writer(
        local, options, files) -> None:
    uri = local.uri("layout")
    sd = {f"t{i}": torch.randn(512, 1024) for i in range(4)}  # 2 MiB each: a file apiece
    dcp.save(sd, storage_writer=CloudStorageWriter(uri, storage_options=local.options,
                                                   file_size=1 << 20, **options), no_dist=True)
    distcp = [f for f in open_checkpoint(uri, local.options).files if f.endswith(".distcp")]
    assert len(distcp) == files
    assert equal(load(uri, local.options, sd), sd)


def test_a_bytesio_in_the_state_saves_and_loads_as_with_torch_s_writer(memory) -> None:
    """DCP saves a BytesIO as itself (torch's own tests keep losses in one): it passes
    the state check and loads back, built from its bytes, while code still cannot run."""
    losses = io.BytesIO()
    torch.save([0.5, 1.5], losses)
    cloud_dcp.save({"w": torch.ones(2), "losses": losses}, memory.uri("s"))
    out = {"w": torch.zeros(2), "losses": io.BytesIO()}
    cloud_dcp.load(out, memory.uri("s"))
    assert out["losses"].getvalue() == losses.getvalue() and torch.equal(out["w"], torch.ones(2))
    with pytest.raises(ConfigError, match="cannot be restored"):
        cloud_dcp.save({"f": io.StringIO("text")}, memory.uri("t"))
