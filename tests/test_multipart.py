"""The one coordinated multi-part save: a part handler of the caller's own, on real
gloo ranks against moto S3. A failure on one rank raises on every rank, commits
nothing and leaves the prefix provably cloudckpt's; the next save replaces it."""

from __future__ import annotations

from dist_run import run_ranks

from cloudckpt import open_checkpoint, open_store
from cloudckpt.core.ownership import OURS, survey
from cloudckpt.names import MANIFEST_NAME


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
