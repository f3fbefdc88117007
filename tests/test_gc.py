"""gc removes exactly what no reader can reach and is older than the grace period."""

from __future__ import annotations

import os
import time

import torch

from cloudckpt import CheckpointWriter, RecoverSlot, list_checkpoints, open_store
from cloudckpt.cli import main as cli
from cloudckpt.core.gc import collect, find_garbage


def age(path: str, seconds: float) -> None:
    """Make every file below ``path`` look ``seconds`` old."""
    t = time.time() - seconds
    for d, _, files in os.walk(path):
        for f in files:
            os.utime(os.path.join(d, f), (t, t))


def torn(backend, name: str, data: bytes) -> None:
    """A save that wrote an object and failed before its commit."""
    w = CheckpointWriter(backend.uri(name), storage_options=backend.options)
    w.put("a.bin", data)
    w.abandon()


def test_gc_on_local_respects_the_grace_period(local):
    with CheckpointWriter(local.uri("step-1"), step=1, storage_options=local.options) as w:
        w.put("a.bin", b"a")
    torn(local, "step-2", b"torn, old")
    torn(local, "step-3", b"torn, still being written")
    age(local.uri("step-1"), 7200)
    age(local.uri("step-2"), 7200)
    found = find_garbage(local.root, local.options, grace_seconds=3600)
    assert [g.uri.rsplit("/", 1)[1] for g in found] == ["step-2"]
    assert found[0].reason.startswith("uncommitted")
    assert collect(found, local.options) == found[0].objects == 2  # a.bin and the claim
    everything = list_checkpoints(local.root, local.options, include_uncommitted=True)
    assert [(c.name, c.committed) for c in everything] == [("step-1", True), ("step-3", False)]


def test_gc_leaves_an_unfinished_save_whose_age_it_cannot_tell(local, monkeypatch, caplog):
    # a listing without times must not read as "abandoned at the epoch": on a
    # backend that gives none, gc would delete saves in progress
    import cloudckpt.storage.store as base

    torn(local, "step-2", b"torn, old")
    age(local.uri("step-2"), 7200)
    monkeypatch.setattr(base, "mtime_of", lambda raw: None)
    assert find_garbage(local.root, local.options, grace_seconds=3600) == []
    assert "tells no modification times" in caplog.text
    monkeypatch.undo()
    assert len(find_garbage(local.root, local.options, grace_seconds=3600)) == 1


def test_gc_removes_orphan_slot_generations_only(s3):
    slot = RecoverSlot(s3.uri("recover"), storage_options=s3.options)
    slot.save({"w": torch.ones(4)})
    current = slot.info()["generation"]
    # An orphan: a committed generation whose pointer swap never happened.
    orphan = "gen-00000000000000000001-deadbeef"
    with CheckpointWriter(slot.store.child(orphan), step=0) as w:
        w.put("x.bin", b"x")
    assert sorted(slot.generations()) == sorted([current, orphan])
    for root in (s3.root, s3.uri("recover")):  # a root holding slots, or the slot itself
        found = find_garbage(root, s3.options, grace_seconds=0)
        assert [g.uri.rsplit("/", 1)[1] for g in found] == [orphan]
    collect(find_garbage(s3.root, s3.options, grace_seconds=0), s3.options)
    assert slot.generations() == [current]
    target = {"w": torch.zeros(4)}
    slot.load(target, rng=False)
    assert torch.equal(target["w"], torch.ones(4))


def test_gc_cli_is_a_dry_run_unless_told(s3, capsys):
    torn(s3, "torn", b"a")
    base = ["-o", f"endpoint_url={s3.options['endpoint_url']}"]
    assert cli([*base, "gc", "--grace", "0", s3.root]) == 0
    out = capsys.readouterr().out
    assert "would remove" in out and "torn" in out and "dry run" in out
    assert open_store(s3.uri("torn"), s3.options).exists("a.bin")
    assert cli([*base, "gc", "--grace", "0", "--yes", s3.root]) == 0
    assert "removed 1 prefix (2 objects)" in capsys.readouterr().out
    assert not open_store(s3.uri("torn"), s3.options).exists("a.bin")
    assert cli([*base, "gc", s3.root]) == 0
    assert "nothing to collect" in capsys.readouterr().out
