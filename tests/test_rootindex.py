"""The root index: ls, latest, retention and resume read O(1) objects of a run root.

Against moto S3 (the request counts through a logging proxy): the index is written by
the commits of the savers of a root and by listings that find it missing or stale,
never trusted over a manifest, and kept by conditional writes that racing savers never
lose an entry to.
"""

from __future__ import annotations

import json
import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from cloudckpt_testkit import FaultProxy
from helpers import boto3_s3

from cloudckpt import CheckpointManager, CheckpointWriter, ManagerOptions, StepInfo, open_store
from cloudckpt.cli import main
from cloudckpt.core import rootindex
from cloudckpt.core.deletion import delete_checkpoint
from cloudckpt.core.listing import latest_checkpoint, list_checkpoints
from cloudckpt.core.manifest import FileEntry, Manifest
from cloudckpt.core.ownership import OURS, ROOT, survey
from cloudckpt.names import INDEX_NAME, MANIFEST_NAME
from cloudckpt.util.crc import crc32c_hex

LOG = "cloudckpt.core.listing"


def commit(backend, name: str, step: int, **writer: object) -> None:
    with CheckpointWriter(backend.uri(name), step=step, storage_options=backend.options,
                          **writer) as w:
        w.put("model.bin", b"w" * (100 + step))


def behind_its_back(backend, name: str, step: int) -> None:
    """A checkpoint committed by a writer that knows no index: its objects and its
    manifest, put as plain objects."""
    store = open_store(backend.uri(name), backend.options)
    data = b"w" * (100 + step)
    store.put("model.bin", data)
    store.put(MANIFEST_NAME, Manifest({"model.bin": FileEntry(len(data), crc32c_hex(data))},
                                      step=step).to_json())


def recorded(backend) -> rootindex.Index:
    loaded = rootindex.load(open_store(backend.root, backend.options))
    assert loaded.index is not None, loaded
    return loaded.index


def test_manager_commits_and_retention_keep_the_index(s3):
    mgr = CheckpointManager(s3.root, ManagerOptions(every_steps=1, keep_last=2),
                            storage_options=s3.options)
    state = {"w": torch.arange(10.0)}
    for step in (1, 2, 3):
        mgr.save(StepInfo(global_step=step), state)
    mgr.close()
    index = recorded(s3)
    assert sorted(index.checkpoints) == ["step-2", "step-3"]  # step-1 dropped by retention
    assert index.pending == {} and index.others == {}
    entry = index.checkpoints["step-3"]
    ckpt = latest_checkpoint(s3.root, s3.options)
    assert (entry.step, entry.size, entry.files, entry.kind, entry.created) == (
        3, ckpt.total_size, len(ckpt.files), ckpt.manifest.kind, ckpt.manifest.created)
    target = {"w": torch.zeros(10)}
    assert CheckpointManager(s3.root, storage_options=s3.options).restore(target).global_step == 3
    assert torch.equal(target["w"], state["w"])


def fill(s3, checkpoints: int, others: int) -> None:
    """``checkpoints`` committed checkpoints (no index) and ``others`` objects of a user's
    under ``logs/`` of the root, put with plain boto3 in parallel."""
    client = boto3_s3(s3.options["endpoint_url"])
    bucket, _, prefix = s3.root.removeprefix("s3://").partition("/")
    data = b"x" * 1000
    manifest = {i: Manifest({"model.bin": FileEntry(len(data), crc32c_hex(data))},
                            step=i).to_json() for i in range(checkpoints)}
    puts = [(f"{prefix}/step-{i}/model.bin", data) for i in range(checkpoints)]
    puts += [(f"{prefix}/step-{i}/{MANIFEST_NAME}", manifest[i]) for i in range(checkpoints)]
    puts += [(f"{prefix}/logs/{i}.txt", b"log line\n") for i in range(others)]
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda kv: client.put_object(Bucket=bucket, Key=kv[0], Body=kv[1]), puts))


def test_ls_of_300_checkpoints_and_2000_other_objects_makes_3_requests(s3, s3_server, capsys,
                                                                        caplog):
    fill(s3, 300, 2000)
    with FaultProxy(s3_server.endpoint) as proxy:
        args = ["-o", f"endpoint_url={proxy.endpoint}", "-o", f"key={s3.options['key']}",
                "-o", f"secret={s3.options['secret']}", "ls", "--json", s3.root]
        with caplog.at_level(logging.INFO, LOG):
            assert main(args) == 0  # no index yet: every manifest read, the index written
        first = json.loads(capsys.readouterr().out)
        assert f"rebuilt the index of {s3.root}: 300 entries added, 0 dropped" in caplog.text
        assert proxy.count_requests(MANIFEST_NAME, method="GET") == 301  # and logs/'s
        proxy.reset_counters()
        assert main(args) == 0
        again = json.loads(capsys.readouterr().out)
        sent = [(r.method, r.target) for r in proxy.request_log]
    assert len(sent) <= 3, sent
    # the index, the root's listing, and the probe of logs/ (no checkpoint: its survey is
    # the index's); no checkpoint's manifest
    assert [t for _, t in sent if MANIFEST_NAME in t] == [
        f"/{s3.root.removeprefix('s3://')}/logs/{MANIFEST_NAME}"]
    assert again == first
    assert [d["name"] for d in again] == ["logs"] + [f"step-{i}" for i in range(300)]
    assert again[0]["status"] == "foreign" and again[0]["files"] == 2000
    assert all(d["status"] == "committed" and d["size"] == 1000 for d in again[1:])


def test_a_missing_index_is_rebuilt_and_logged(s3, caplog, monkeypatch):
    for step in (1, 2, 3):
        commit(s3, f"step-{step}", step)  # no saver of the root: no index
    assert not open_store(s3.root, s3.options).exists(INDEX_NAME)
    with caplog.at_level(logging.INFO, LOG):
        listed = list_checkpoints(s3.root, s3.options)
    assert f"rebuilt the index of {s3.root}: 3 entries added, 0 dropped (it had none)" \
        in caplog.text
    assert sorted(recorded(s3).checkpoints) == ["step-1", "step-2", "step-3"]
    from cloudckpt.core import listing
    reads = []
    real = listing.read_manifest_bytes
    monkeypatch.setattr(listing, "read_manifest_bytes",
                        lambda store, *a, **k: reads.append(store.uri) or real(store, *a, **k))
    assert list_checkpoints(s3.root, s3.options) == listed
    assert reads == []  # every one from the index
    # a commit into a root with an index keeps it, whoever the writer
    commit(s3, "step-4", 4)
    assert recorded(s3).checkpoints["step-4"].step == 4


def test_a_stale_index_is_rebuilt_and_logged(s3, caplog):
    for step in (1, 2, 3):
        commit(s3, f"step-{step}", step, index=True)
    behind_its_back(s3, "step-4", 4)  # committed without the index
    open_store(s3.uri("step-1"), s3.options).delete_prefix("")  # deleted behind its back
    with caplog.at_level(logging.INFO, LOG):
        listed = list_checkpoints(s3.root, s3.options)
    assert [c.name for c in listed] == ["step-2", "step-3", "step-4"]
    assert f"rebuilt the index of {s3.root}: 1 entries added, 1 dropped" in caplog.text
    assert sorted(recorded(s3).checkpoints) == ["step-2", "step-3", "step-4"]


def test_the_index_is_never_trusted_over_a_manifest(s3, caplog):
    for step in (1, 2):
        commit(s3, f"step-{step}", step, index=True)
    step2 = open_store(s3.uri("step-2"), s3.options)
    step2.put("notes.txt", b"a user's")  # the prefix stays when the manifest goes
    step2.delete([MANIFEST_NAME])  # behind the index's back
    # a manifest that disagrees with its entry (replaced behind its back)
    index = recorded(s3)
    index.checkpoints["step-1"] = rootindex.Entry(1, 0.0, 1, 1, "other")
    root = open_store(s3.root, s3.options)
    root.put(INDEX_NAME, index.to_json())
    with caplog.at_level(logging.INFO, "cloudckpt"):
        latest = latest_checkpoint(s3.root, s3.options)
    assert latest is not None and latest.step == 1  # step-2's manifest is gone: skipped
    assert "its manifest is gone" in caplog.text
    assert "disagreed with the manifest of step-1; fixed its entry" in caplog.text
    fixed = recorded(s3)
    assert "step-2" not in fixed.checkpoints
    assert fixed.checkpoints["step-1"] == rootindex.Entry.of(latest.manifest)


@pytest.mark.parametrize("garbage", [b"{not json", b"[]", json.dumps(
    {"format": rootindex.FORMAT, "version": 99, "checkpoints": {}}).encode(), json.dumps(
    {"format": rootindex.FORMAT, "version": 1, "checkpoints": {"step-1": {"step": "x"}}}
).encode()])
def test_a_malformed_index_is_ignored_with_a_warning_and_rebuilt(s3, caplog, garbage):
    for step in (1, 2):
        commit(s3, f"step-{step}", step)
    open_store(s3.root, s3.options).put(INDEX_NAME, garbage)
    with caplog.at_level(logging.INFO, "cloudckpt"):
        listed = list_checkpoints(s3.root, s3.options)
    assert [(c.name, c.step) for c in listed] == [("step-1", 1), ("step-2", 2)]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert any("cannot be used" in r.getMessage() for r in warnings), caplog.text
    assert "2 entries added, 0 dropped (it could not be used)" in caplog.text
    assert sorted(recorded(s3).checkpoints) == ["step-1", "step-2"]


def test_two_savers_committing_at_once_lose_no_entry(s3):
    each = 12
    start = threading.Barrier(2)

    def saver(who: str) -> None:
        options = dict(s3.options)  # each its own Store, opened by each writer
        start.wait(timeout=120)
        for i in range(each):
            with CheckpointWriter(f"{s3.root}/{who}-{i}", step=i, storage_options=options,
                                  index=True) as w:
                w.put("model.bin", b"x")

    with ThreadPoolExecutor(2) as pool:
        for f in [pool.submit(saver, who) for who in ("a", "b")]:
            f.result(timeout=600)
    index = recorded(s3)  # as the savers left it: no listing repaired it
    assert sorted(index.checkpoints) == sorted(f"{w}-{i}" for w in "ab" for i in range(each))
    assert index.pending == {}


def test_a_crash_between_the_manifest_and_the_index_still_shows_the_checkpoint(s3, monkeypatch):
    commit(s3, "step-1", 1, index=True)

    def crash(self, manifest, *size):
        raise RuntimeError("killed after the manifest PUT")

    monkeypatch.setattr(rootindex.Commit, "done", crash)
    w = CheckpointWriter(s3.uri("step-2"), step=2, storage_options=s3.options, index=True)
    w.put("model.bin", b"x")
    with pytest.raises(RuntimeError, match="killed"):
        w.commit()
    monkeypatch.undo()
    assert "step-2" in recorded(s3).pending  # marked before the manifest, never recorded
    assert [c.name for c in list_checkpoints(s3.root, s3.options)] == ["step-1", "step-2"]
    assert sorted(recorded(s3).checkpoints) == ["step-1", "step-2"]  # the listing settled it
    assert recorded(s3).pending == {}


def test_a_crash_between_the_uncommit_and_the_drop_never_shows_the_deleted_one(s3, monkeypatch):
    for step in (1, 2):
        commit(s3, f"step-{step}", step, index=True)
    real = rootindex.update
    calls = []

    def crash_on_the_drop(root, change, **kw):
        calls.append(kw)
        if len(calls) == 2:
            raise RuntimeError("killed after the manifest DELETE")
        return real(root, change, **kw)

    monkeypatch.setattr(rootindex, "update", crash_on_the_drop)
    with pytest.raises(RuntimeError, match="killed"):
        delete_checkpoint(s3.uri("step-2"), s3.options)
    monkeypatch.undo()
    assert recorded(s3).pending["step-2"].op == rootindex.DELETE
    assert [c.name for c in list_checkpoints(s3.root, s3.options)] == ["step-1"]


def test_cli_rm_drops_the_entry_and_rm_of_the_root_leaves_nothing(s3, capsys):
    for step in (1, 2):
        commit(s3, f"step-{step}", step, index=True)
    args = ["-o", f"endpoint_url={s3.options['endpoint_url']}", "-o",
            f"key={s3.options['key']}", "-o", f"secret={s3.options['secret']}"]
    assert main([*args, "rm", s3.uri("step-1")]) == 0
    assert sorted(recorded(s3).checkpoints) == ["step-2"]
    assert main([*args, "rm", "--recursive", "--yes", s3.root]) == 0
    assert open_store(s3.root, s3.options).list(internal=True) == []


def test_the_index_is_cloudckpts_own_mark(memory):
    root = open_store(memory.root)
    root.child("step-1").put(MANIFEST_NAME, Manifest({}).to_json())
    root.put(INDEX_NAME, rootindex.Index().to_json())
    assert survey(root).kind == ROOT  # a root holding it stays a root
    root.child("step-1").delete([MANIFEST_NAME])
    assert survey(root).kind == OURS  # holding only it: a leftover of cloudckpt's


def test_a_big_manifest_is_read_in_one_get_of_the_size_the_index_records(s3, s3_server):
    """A 3 MiB manifest (over the 1 MiB a manifest of unknown size is first read in)
    opened from the root's listing: the index's record gives its size, so it is one GET
    of exactly its bytes, no HEAD, no second read."""
    with CheckpointWriter(s3.uri("step-1"), step=1, storage_options=s3.options, index=True,
                          metadata={"notes": "n" * (3 * 2**20)}) as w:
        w.put("model.bin", b"w" * 101)
    size = open_store(s3.uri("step-1"), s3.options).size(MANIFEST_NAME)
    assert size > 3 * 2**20
    assert recorded(s3).checkpoints["step-1"].manifest_bytes == size
    with FaultProxy(s3_server.endpoint) as proxy:
        found = latest_checkpoint(s3.root, {**s3.options, "endpoint_url": proxy.endpoint})
        manifest_reqs = [r for r in proxy.request_log if r.target.split("?")[0].endswith(
            f"step-1/{MANIFEST_NAME}")]
        body = proxy.bytes_out
    assert found is not None and found.step == 1
    assert [r.method for r in manifest_reqs] == ["GET"], manifest_reqs
    assert size <= body < size + 64 * 1024  # the manifest once, and the small index


def test_a_stale_manifest_size_in_the_index_still_reads_the_whole_manifest(s3):
    """The index's size is a hint: a manifest bigger than it records (the checkpoint
    replaced behind its back) is read whole, and the record is fixed."""
    commit(s3, "step-1", 1, index=True)
    root = open_store(s3.root, s3.options)
    size = open_store(s3.uri("step-1"), s3.options).size(MANIFEST_NAME)

    def shrink(index: rootindex.Index) -> bool:
        e = index.checkpoints["step-1"]
        index.checkpoints["step-1"] = rootindex.Entry(e.step, e.created, e.size, e.files,
                                                      e.kind, size // 2)
        return True

    rootindex.update(root, shrink)
    assert recorded(s3).checkpoints["step-1"].manifest_bytes == size // 2
    found = latest_checkpoint(s3.root, s3.options)
    assert found is not None and found.step == 1 and "model.bin" in found.manifest.files
    assert recorded(s3).checkpoints["step-1"].manifest_bytes == size
