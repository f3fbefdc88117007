"""The one coordinated multi-part save: a part handler of the caller's own, on real
gloo ranks against moto S3. A failure on one rank raises on every rank, commits
nothing and leaves the prefix provably cloudckpt's; the next save replaces it."""

from __future__ import annotations

import pytest
from dist_run import run_ranks

from cloudckpt import open_checkpoint, open_store
from cloudckpt.core.ownership import OURS, survey
from cloudckpt.errors import StorageError
from cloudckpt.names import MANIFEST_NAME
from cloudckpt.training import multipart


def test_a_part_failing_on_one_rank_fails_every_rank_then_a_retry_commits(s3):
    uri = s3.uri("parts")
    failed = run_ranks("multipart_workers.save", 2, uri, s3.options, 1)
    assert {r: failed[r][:2] for r in failed} == {0: ("raised", "StorageError"),
                                                  1: ("raised", "StorageError")}
    assert all("the disk went away" in failed[r][2] for r in failed), failed
    store = open_store(uri, s3.options)
    assert not store.exists(MANIFEST_NAME)
    assert survey(store).kind == OURS  # rank 0's shard stays, under the abandoned claim

    done = run_ranks("multipart_workers.save", 2, uri, s3.options, None)
    assert done[1] == ("committed", None)
    assert done[0] == ("committed", ["shards/0.bin", "shards/1.bin", "shared.json"])
    ckpt = open_checkpoint(uri, s3.options)
    assert (ckpt.manifest.step, ckpt.manifest.kind) == (3, "test-parts")
    assert ckpt.read("shards/1.bin") == b"\x01\x01" and ckpt.read("shared.json") == b'{"n": 1}'
    ckpt.verify(deep=True)


def test_a_driver_commits_what_its_worker_groups_committed_below_it(s3):
    """``multipart.drive``: the driver claims the step, each group commits its part
    below it, the shared bytes go in last; a group failing leaves no commit, and the
    retry replaces what it left."""

    store = open_store(s3.uri("step"), s3.options)
    order = []

    def group(name: str, fail: bool = False):
        def save(uri: str) -> None:
            order.append(name)
            multipart.save(open_store(uri, s3.options),
                           [multipart.SharedBytes("w.bin", name.encode())], kind="test-role")
            if fail:
                raise StorageError(f"{name}'s workers lost a node")
        return save

    def data() -> bytes:
        order.append("data")
        return b"loader"

    with pytest.raises(StorageError, match="critic's workers lost a node"):
        multipart.drive(store, [("actor", group("actor")), ("critic", group("critic", True))],
                        {"data.pt": data}, step=7, kind="test-step")
    assert not store.exists(MANIFEST_NAME) and survey(store).kind == OURS
    assert order == ["actor", "critic"]  # the shared bytes are made after every part

    ckpt = multipart.drive(store, [("actor", group("actor")), ("critic", group("critic"))],
                           {"data.pt": data}, step=7, kind="test-step")
    assert (ckpt.manifest.step, ckpt.manifest.kind) == (7, "test-step")
    assert ckpt.read("data.pt") == b"loader" and ckpt.read("critic/w.bin") == b"critic"
    assert order[2:] == ["actor", "critic", "data"]
    ckpt.verify(deep=True)
