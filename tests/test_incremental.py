"""Incremental saves: each object a blob named by its SHA-256 in the run's blob area.

Over moto, fake-gcs-server and local disk: what did not change is referenced, not
sent; restores are bit-exact; retention and gc delete only blobs nothing needs; a
sweep that missed a save's hold is caught by the save; a writer whose claim was
taken over cannot change a committed checkpoint's bytes.
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import load as stock_load

from cloudckpt import CheckpointManager, ManagerOptions, dcp
from cloudckpt.core import blobs
from cloudckpt.core.blobs import BlobArea, sweep
from cloudckpt.core.checkpoint import CheckpointWriter
from cloudckpt.core.committed import open_checkpoint
from cloudckpt.core.gc import BLOBS, collect, find_garbage
from cloudckpt.core.listing import list_checkpoints
from cloudckpt.core.manifest import MANIFEST_NAME, Manifest
from cloudckpt.errors import CommitConflictError, ConfigError, ManifestError
from cloudckpt.movement.checkpoint_copy import copy_checkpoint, download
from cloudckpt.names import BLOB_AREA
from cloudckpt.runtime.state import StepInfo
from cloudckpt.storage import open_store


@pytest.fixture(params=["file", "s3", "gcs", "azure"])
def where(request):
    return request.getfixturevalue("local" if request.param == "file" else request.param)


def frozen_state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    state = {f"base.{i}": torch.randn(256, 1024, generator=g) for i in range(4)}
    state["adapter"] = torch.randn(8, 1024, generator=g)
    return state


def zeros_like(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in state.items()}


def test_a_second_save_sends_only_what_changed_and_restores_bit_exact(where) -> None:
    state = frozen_state()
    first = dcp.save(state, where.uri("run", "step-1"), storage_options=where.options,
                     incremental=True)
    state["adapter"] += 1.0
    second = dcp.save(state, where.uri("run", "step-2"), storage_options=where.options,
                      incremental=True)
    assert first is not None and second is not None
    sent = second.metadata["dcp"]["incremental"]
    assert sent["sent_bytes"] < 0.05 * sent["bytes"], sent  # the four base tensors stayed
    assert first.metadata["dcp"]["incremental"]["sent_bytes"] == sent["bytes"]
    # Nothing but the manifest lies under the checkpoint's prefix: every byte is a blob.
    step2 = open_store(where.uri("run", "step-2"), where.options)
    assert [o.key for o in step2.list()] == [MANIFEST_NAME]
    ckpt = open_checkpoint(where.uri("run", "step-2"), where.options)
    assert ckpt.manifest.blob_depth == 1 and set(ckpt.manifest.blobs) == set(ckpt.files)
    shared = set(ckpt.manifest.blobs.values()) & set(first.manifest.blobs.values())
    assert len(shared) == 4  # the base tensors' files, referenced by both
    ckpt.verify(deep=True)
    out = zeros_like(state)
    dcp.load(out, where.uri("run", "step-2"), storage_options=where.options)
    assert all(torch.equal(out[k], v) for k, v in state.items())


def test_a_downloaded_or_copied_incremental_checkpoint_has_the_standard_layout(
        s3, local, tmp_path) -> None:
    state = frozen_state(1)
    dcp.save(state, s3.uri("run", "step-1"), storage_options=s3.options, incremental=True)
    state["adapter"] *= 2
    dcp.save(state, s3.uri("run", "step-2"), storage_options=s3.options, incremental=True)
    ckpt = open_checkpoint(s3.uri("run", "step-2"), s3.options)
    where = download(ckpt, tmp_path / "dl")
    out = zeros_like(state)
    stock_load(out, storage_reader=FileSystemReader(str(where)), no_dist=True)
    assert all(torch.equal(out[k], v) for k, v in state.items())
    local_manifest = Manifest.from_json((where / MANIFEST_NAME).read_bytes())
    assert local_manifest.blob_depth is None
    assert local_manifest.commit_id == ckpt.manifest.commit_id
    copy = copy_checkpoint(ckpt, local.uri("copy", "step-2"), dst_options=local.options)
    copy.verify(deep=True)
    assert not os.path.exists(local.uri("copy", BLOB_AREA))
    out = zeros_like(state)
    dcp.load(out, local.uri("copy", "step-2"), storage_options=local.options)
    assert all(torch.equal(out[k], v) for k, v in state.items())


class Tiny(torch.nn.Module):
    """A frozen base and a trained head: most bytes never change."""

    def __init__(self) -> None:
        super().__init__()
        self.base = torch.nn.Linear(512, 512)
        self.head = torch.nn.Linear(512, 4)
        self.base.requires_grad_(False)


def train(model: Tiny, opt: torch.optim.Optimizer) -> None:
    model.head(model.base(torch.randn(4, 512))).sum().backward()
    opt.step()
    opt.zero_grad()


def assert_restores(root: str, options: dict, model: Tiny, step: int) -> None:
    """A fresh manager restores step ``step`` below ``root`` into a fresh model and
    optimizer, bit-exact with ``model``."""
    restored_model = Tiny()
    restored_opt = torch.optim.Adam(restored_model.head.parameters())
    info = CheckpointManager(root, storage_options=options).restore(
        {"model": restored_model, "optim": restored_opt})
    assert info is not None and info.global_step == step
    for a, b in zip(model.state_dict().values(), restored_model.state_dict().values(),
                    strict=True):
        assert torch.equal(a, b)


def referenced_blobs(root: str, options: dict) -> set[str]:
    return blobs.referenced(open_store(root, options))


def area_blobs(root: str, options: dict) -> set[str]:
    area = open_store(root, options).child(BLOB_AREA)
    return {o.key for o in area.list() if blobs.DIGEST_RE.match(o.key)}


def test_manager_retention_deletes_only_blobs_no_kept_checkpoint_references(
        where, tmp_path) -> None:
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.Adam(model.head.parameters())
    root = where.uri("run")
    mgr = CheckpointManager(root, ManagerOptions(every_steps=1, keep_last=2, incremental=True),
                            storage_options=where.options)
    for step in range(1, 6):
        train(model, opt)
        mgr.save(StepInfo(global_step=step, epoch_step=step, steps_per_epoch=100),
                 {"model": model, "optim": opt})
    mgr.close()
    names = [c.name for c in list_checkpoints(root, where.options)]
    assert names == ["step-4", "step-5"]
    # Every blob left is referenced by a kept checkpoint, and every reference resolves.
    assert area_blobs(root, where.options) == referenced_blobs(root, where.options)
    base = open_checkpoint(f"{root}/step-4", where.options).manifest.blobs
    for name in names:
        open_checkpoint(f"{root}/{name}", where.options).verify(deep=True)
    frozen = {d for p, d in base.items() if p.startswith("model/__")}
    assert frozen & set(open_checkpoint(f"{root}/step-5", where.options).manifest.blobs
                        .values())  # the base weights' file: one blob, both checkpoints
    assert_restores(root, where.options, model, 5)
    # Nothing is left to collect, and gc says so.
    assert [g for g in find_garbage(root, where.options, grace_seconds=0)
            if g.kind == BLOBS] == []


def test_gc_sweeps_old_orphans_and_stale_holds_and_spares_live_holds(local) -> None:
    root = open_store(local.uri("run"), local.options)
    dcp.save(frozen_state(2), local.uri("run", "step-1"), storage_options=local.options,
             incremental=True)
    area = BlobArea(root)
    orphan, _ = area.put(b"left by a save that crashed before committing")
    held, _ = area.put(b"relied on by a save still running")
    old = time.time() - 7200
    for digest in (orphan, held):
        os.utime(area.store.path(digest), (old, old))
    area.holding("step-2").settle([held], lambda _: None)
    stale_hold = area.store.put(f"{blobs.HOLDS}/step-0/old.json",
                                json.dumps({"blobs": [orphan]}).encode())
    os.utime(area.store.path(stale_hold.key), (old, old))
    found = [g for g in find_garbage(root, grace_seconds=3600) if g.kind == BLOBS]
    assert len(found) == 1 and found[0].objects == 2  # the orphan and the stale hold
    collect(found)
    left = area_blobs(local.uri("run"), local.options)
    assert orphan not in left and held in left
    assert referenced_blobs(local.uri("run"), local.options) <= left
    open_checkpoint(local.uri("run", "step-1"), local.options).verify(deep=True)
    assert not area.store.exists(stale_hold.key)


def test_a_sweep_that_ran_before_the_hold_is_caught_and_the_blob_sent_again(s3) -> None:
    root = open_store(s3.uri("run"), s3.options)
    area = BlobArea(root)
    digest, _ = area.put(b"a blob a deleted checkpoint referenced")
    holding = area.holding("step-9")  # the save looked at the area: the blob is there
    assert sweep(root, released={digest}).blobs == 1  # a retention sweep, no hold yet
    restored = []
    holding.settle([digest], lambda d: restored.append(area.put(b"a blob a deleted "
                                                                 b"checkpoint referenced", d)))
    assert [d for d, _ in restored] == [digest] and area.store.exists(digest)
    # Once held, a later sweep spares it, released or not.
    assert sweep(root, released={digest}).blobs == 0 and area.store.exists(digest)


def test_a_save_waits_for_a_running_sweep_before_trusting_its_blobs(s3) -> None:
    root = open_store(s3.uri("run"), s3.options)
    area = BlobArea(root)
    digest, _ = area.put(b"bytes")
    area.store.put(blobs.SWEEP_RECORD, json.dumps({"count": 1, "running": True,
                                                   "since": time.time(), "lease": 1.0})
                   .encode())
    holding = area.holding("step-1")
    area.store.delete([digest])  # the running sweep took it
    begun = time.monotonic()
    sent = []
    holding.settle([digest], lambda d: sent.append(area.put(b"bytes", d)))
    assert time.monotonic() - begun >= 0.8  # until the sweep's lease ran out
    assert sent and area.store.exists(digest)
    with pytest.raises(CommitConflictError, match="another sweep"):
        area.store.put(blobs.SWEEP_RECORD, json.dumps(
            {"count": 2, "running": True, "since": time.time(), "lease": 60}).encode())
        sweep(root)


def test_a_taken_over_writer_cannot_change_a_committed_incremental_checkpoint(where) -> None:
    """The zombie: A's claim is taken over by B, which commits; A goes on writing the
    same checkpoint's objects. B's checkpoint still verifies deep, with B's bytes."""
    uri = where.uri("run", "step-7")
    area = BlobArea(open_store(where.uri("run"), where.options))
    a = CheckpointWriter(uri, storage_options=where.options, step=7, blobs=area)
    a.put_many({"model/__0_0.distcp": b"A" * 4096, "state/shared.bin": b"a-state"})
    b = CheckpointWriter(uri, storage_options=where.options, step=7, blobs=area,
                         takeover=True)
    b.put_many({"model/__0_0.distcp": b"B" * 4096, "state/shared.bin": b"b-state"})
    committed = b.commit()
    a.put_many({"model/__0_0.distcp": b"Z" * 4096, "state/shared.bin": b"zombie"})
    with pytest.raises(CommitConflictError):
        a.commit()
    ckpt = open_checkpoint(uri, where.options)
    assert ckpt.manifest.commit_id == committed.manifest.commit_id
    ckpt.verify(deep=True)
    assert ckpt.read("model/__0_0.distcp") == b"B" * 4096
    assert ckpt.read("state/shared.bin") == b"b-state"


def test_manifests_with_bad_blob_references_are_refused() -> None:
    good = {"format": "cloudckpt.core.manifest", "version": 1, "created": 1.0,
            "files": {"a.bin": {"size": 1, "crc32c": "00000000", "blob": "ab" * 32}},
            "blob_depth": 1}
    assert Manifest.from_json(json.dumps(good).encode()).blobs == {"a.bin": "ab" * 32}
    for bad, why in (({"blob": "../x"}, "bad blob digest"), ({"blob": "AB" * 32}, "digest")):
        doc = json.loads(json.dumps(good))
        doc["files"]["a.bin"].update(bad)
        with pytest.raises(ManifestError, match=why):
            Manifest.from_json(json.dumps(doc).encode())
    for depth in (None, 0, 33, True, "1"):
        doc = {**good, "blob_depth": depth}
        with pytest.raises(ManifestError, match="blob_depth"):
            Manifest.from_json(json.dumps(doc).encode())
    plain = {**good, "files": {"a.bin": {"size": 1, "crc32c": "00000000"}}}
    with pytest.raises(ManifestError, match="blob_depth"):
        Manifest.from_json(json.dumps(plain).encode())


def test_a_view_that_reads_blobs_cannot_write_and_stores_stay_inside_their_bucket(
        s3) -> None:
    dcp.save(frozen_state(3), s3.uri("run", "step-1"), storage_options=s3.options,
             incremental=True)
    view = open_checkpoint(s3.uri("run", "step-1"), s3.options).store
    with pytest.raises(ConfigError, match="cannot write or delete"):
        view.put("x.bin", b"x")
    with pytest.raises(ConfigError, match="cannot write or delete"):
        view.delete([".metadata"])
    store = open_store(s3.uri("run"), s3.options)
    with pytest.raises(ConfigError, match="no prefix"):
        store.ancestor(store.root.count("/") + 1)
    with pytest.raises(ConfigError, match="not below"):
        BlobArea(store.child("a")).depth_of(store.child("b"))
    with pytest.raises(ConfigError, match="as a stream"):
        CheckpointWriter(s3.uri("run", "step-2"), storage_options=s3.options,
                         blobs=BlobArea(store)).open("big.bin")


def test_an_incremental_upload_of_a_directory_sends_only_changed_files(s3, tmp_path) -> None:
    """A framework's saved directory (HF shards of a frozen base, a trained adapter):
    the second upload sends the adapter only, and downloads as the directory was."""
    from cloudckpt.training.staging import upload_dir

    src = tmp_path / "save"
    (src / "base").mkdir(parents=True)
    (src / "base" / "model-00001.safetensors").write_bytes(os.urandom(3 << 20))
    (src / "adapter.bin").write_bytes(b"step 1" * 1000)
    upload_dir(src, s3.uri("run", "ckpt-1"), storage_options=s3.options, incremental=True)
    base_blob = open_checkpoint(s3.uri("run", "ckpt-1"), s3.options).manifest.blobs[
        "base/model-00001.safetensors"]
    area = open_store(s3.uri("run", BLOB_AREA), s3.options)

    def written_at() -> float | None:
        return next(o.mtime for o in area.list() if o.key == base_blob)

    sent_at = written_at()
    time.sleep(1.1)  # a new upload would show a later modification time
    (src / "adapter.bin").write_bytes(b"step 2" * 1000)
    ckpt = upload_dir(src, s3.uri("run", "ckpt-2"), storage_options=s3.options,
                      incremental=True)
    assert ckpt is not None and ckpt.manifest.blobs["base/model-00001.safetensors"] == base_blob
    assert written_at() == sent_at  # not sent again
    ckpt.verify(deep=True)
    got = download(ckpt, tmp_path / "dl")
    for rel in ("base/model-00001.safetensors", "adapter.bin"):
        assert (got / rel).read_bytes() == (src / rel).read_bytes()
    assert area_blobs(s3.uri("run"), s3.options) == referenced_blobs(s3.uri("run"), s3.options)


def test_the_cli_shows_verifies_and_collects_an_incremental_run(s3, capsys) -> None:
    from cloudckpt.cli import main as cli

    flags = [f"-o{k}={v}" for k, v in s3.options.items() if isinstance(v, str)]
    dcp.save(frozen_state(4), s3.uri("run", "step-1"), storage_options=s3.options,
             incremental=True)
    assert cli(["info", s3.uri("run", "step-1"), *flags]) == 0
    out = capsys.readouterr().out
    assert "an incremental save" in out and "(blob " in out
    assert cli(["verify", "--deep", s3.uri("run", "step-1"), *flags]) == 0
    assert cli(["ls", s3.uri("run"), *flags]) == 0
    assert BLOB_AREA not in capsys.readouterr().out
    area = open_store(s3.uri("run", BLOB_AREA), s3.options)
    first = area_blobs(s3.uri("run"), s3.options)
    area.put("0" * 64, b"an orphan")  # as if a save died before referencing it
    assert cli(["gc", s3.uri("run"), "--grace", "0", *flags]) == 0  # a dry run
    assert "no committed checkpoint references" in capsys.readouterr().out
    assert area.exists("0" * 64)
    assert cli(["gc", s3.uri("run"), "--grace", "0", "--yes", *flags]) == 0
    assert area_blobs(s3.uri("run"), s3.options) == first
    assert cli(["verify", "--deep", s3.uri("run", "step-1"), *flags]) == 0


def test_a_manifest_pointing_its_blobs_above_the_bucket_is_corrupt(s3) -> None:
    from cloudckpt.errors import CorruptCheckpointError

    uri = s3.uri("run", "step-1")
    dcp.save(frozen_state(5), uri, storage_options=s3.options, incremental=True)
    store = open_store(uri, s3.options)
    doc = json.loads(store.get(MANIFEST_NAME))
    doc["blob_depth"] = 20
    store.delete([MANIFEST_NAME])
    store.put(MANIFEST_NAME, json.dumps(doc).encode())
    with pytest.raises(CorruptCheckpointError, match="above the bucket"):
        open_checkpoint(uri, s3.options)


def test_local_tier_drains_of_an_incremental_manager_send_only_what_changed(
        s3, tmp_path) -> None:
    """The local saves lay one file per large tensor out; each drain sends a file only
    when the blob area lacks its bytes, and the drained step restores bit-exact."""
    from cloudckpt import LocalTier

    torch.manual_seed(1)
    model = Tiny()
    opt = torch.optim.Adam(model.head.parameters())
    root = s3.uri("run")
    tier = LocalTier(str(tmp_path / "tier"), every_steps=1, drain_every=1)
    mgr = CheckpointManager(root, ManagerOptions(local=tier, incremental=True),
                            storage_options=s3.options)
    for step in (1, 2):
        train(model, opt)
        mgr.save(StepInfo(global_step=step, epoch_step=step, steps_per_epoch=100),
                 {"model": model, "optim": opt})
        mgr.wait()  # the drain
    mgr.close()
    first, second = (open_checkpoint(f"{root}/step-{s}", s3.options) for s in (1, 2))
    assert second.metadata.get("drained") and second.manifest.blob_depth == 1
    base = {d for p, d in first.manifest.blobs.items() if p.startswith("model/__")}
    assert base & set(second.manifest.blobs.values())  # the frozen base's file, shared
    second.verify(deep=True)
    assert area_blobs(root, s3.options) == referenced_blobs(root, s3.options)
    assert_restores(root, s3.options, model, 2)


def test_async_incremental_saves_send_only_what_changed(gcs) -> None:
    """With ``async_save`` the staged copies are hashed and sent in the background: the
    frozen base is sent once, and the newest step restores bit-exact."""
    torch.manual_seed(2)
    model = Tiny()
    opt = torch.optim.Adam(model.head.parameters())
    root = gcs.uri("run")
    mgr = CheckpointManager(root, ManagerOptions(every_steps=1, async_save=True,
                                                 incremental=True),
                            storage_options=gcs.options)
    for step in (1, 2, 3):
        train(model, opt)
        mgr.save(StepInfo(global_step=step, epoch_step=step, steps_per_epoch=100),
                 {"model": model, "optim": opt})
    mgr.close()
    for step in (2, 3):
        sent = open_checkpoint(f"{root}/step-{step}/model", gcs.options).metadata["dcp"][
            "incremental"]
        assert sent["sent_files"] == sent["files"] - 1, sent  # all but the frozen base
    assert_restores(root, gcs.options, model, 3)
