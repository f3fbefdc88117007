"""Writer claims: one writer per checkpoint URI, and a dead writer's claim is no obstacle."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from cloudckpt import CheckpointWriter, CommitConflictError, open_checkpoint, open_store
from cloudckpt.core.claim import CLAIM_NAME
from cloudckpt.core.deletion import delete_checkpoint


def _claim(backend, uri: str) -> dict:
    return json.loads(open_store(uri, backend.options).get(CLAIM_NAME))


def test_claim_is_taken_on_first_write_and_removed_on_commit(backend):
    uri = backend.uri("step-1")
    w = CheckpointWriter(uri, step=1, storage_options=backend.options)
    store = open_store(uri, backend.options)
    assert not store.exists(CLAIM_NAME)  # opening a writer costs nothing
    w.put("a.bin", b"a")
    assert _claim(backend, uri)["writer"] == w._claim.writer
    w.commit()
    assert not store.exists(CLAIM_NAME)
    assert open_checkpoint(uri, backend.options).files == ["a.bin"]


def test_failed_save_in_this_process_can_be_retried(backend):
    uri = backend.uri("step-2")
    with pytest.raises(RuntimeError):
        with CheckpointWriter(uri, step=2, storage_options=backend.options) as w:
            w.put("a.bin", b"first try")
            raise RuntimeError("training code failed mid-save")
    abandoned = CheckpointWriter(uri, step=2, storage_options=backend.options)
    abandoned.put("a.bin", b"second try")  # never committed nor closed
    del abandoned
    with CheckpointWriter(uri, step=2, storage_options=backend.options) as w:
        w.put("a.bin", b"third try")
    assert open_checkpoint(uri, backend.options).read("a.bin") == b"third try"


def test_claim_of_a_dead_process_is_taken_over(s3):
    uri = s3.uri("step-3")
    code = ("import sys, json; from cloudckpt import CheckpointWriter; "
            "w = CheckpointWriter(sys.argv[1], step=3, storage_options=json.loads(sys.argv[2])); "
            "w.put('a.bin', b'dead'); import os; os._exit(0)")
    opts = json.loads(s3.options_json())
    subprocess.run([sys.executable, "-c", code, uri, json.dumps(opts)], check=True,
                   env={**os.environ, **s3.env})
    dead = _claim(s3, uri)
    with CheckpointWriter(uri, step=3, storage_options=s3.options) as w:
        w.put("a.bin", b"alive")
    assert dead["writer"] != w._claim.writer
    assert open_checkpoint(uri, s3.options).read("a.bin") == b"alive"


def _renewing(store, record: dict, seconds: float) -> threading.Thread:
    """A writer elsewhere, as its claim shows it: renewed every 0.2 s for ``seconds``."""
    def renew() -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            store.put(CLAIM_NAME, json.dumps({**record, "renewed": time.time()}).encode())
            time.sleep(0.2)

    store.put(CLAIM_NAME, json.dumps({**record, "renewed": time.time()}).encode())
    thread = threading.Thread(target=renew)  # claimed before this returns
    thread.start()
    return thread


def test_claim_of_another_host_blocks_until_takeover(local):
    uri = local.uri("step-4")
    store = open_store(uri, local.options)
    elsewhere = {"writer": "x", "host": "other-node", "pid": 1, "since": time.time(),
                 "lease": 1.0}
    renewing = _renewing(store, elsewhere, 3.0)
    with pytest.raises(CommitConflictError, match="other-node.*renewed its claim"):
        CheckpointWriter(uri, step=4, storage_options=local.options).put("a.bin", b"a")
    renewing.join()
    assert [o.key for o in store.list(internal=True)] == [CLAIM_NAME]  # nothing written
    assert store.list() == []  # claims are bookkeeping, hidden from listings
    with CheckpointWriter(uri, step=4, storage_options=local.options, takeover=True) as w:
        w.put("a.bin", b"a")
    assert open_checkpoint(uri, local.options).read("a.bin") == b"a"


def test_writer_taken_over_does_not_commit(gcs):
    uri = gcs.uri("step-5")
    old = CheckpointWriter(uri, step=5, storage_options=gcs.options)
    old.put("a.bin", b"old")
    new = CheckpointWriter(uri, step=5, storage_options=gcs.options, takeover=True)
    new.put("a.bin", b"new")
    with pytest.raises(CommitConflictError, match="taken over"):
        old.commit()
    new.commit()
    assert open_checkpoint(uri, gcs.options).read("a.bin") == b"new"


def test_same_hostname_in_another_pid_namespace_is_not_judged(local):
    """Containers sharing a hostname (host networking) do not share pids: a claim
    from another pid namespace or boot is never taken for dead by its pid, only once
    its lease runs out."""
    from cloudckpt.core.liveness import _whoami

    uri = local.uri("step-6")
    store = open_store(uri, local.options)
    here = _whoami()
    for other in ({"pid_ns": "4026531836-elsewhere"}, {"boot_id": "another-boot"}):
        store.put(CLAIM_NAME, json.dumps({**here, **other, "writer": "x", "pid": 2**22 + 7,
                                          "since": time.time(), "renewed": time.time(),
                                          "lease": 1.5}).encode())
        start = time.monotonic()
        with CheckpointWriter(uri, storage_options=local.options) as w:
            w.put("a.bin", b"a")
        assert time.monotonic() - start > 1.0  # waited out the lease: the pid was not judged
        delete_checkpoint(uri, local.options)
    store.put(CLAIM_NAME, json.dumps({**here, "writer": "x", "pid": 2**22 + 7,
                                      "since": time.time(), "renewed": time.time(),
                                      "lease": 600}).encode())  # same host, boot, namespace
    start = time.monotonic()
    with CheckpointWriter(uri, storage_options=local.options) as w:  # pid is dead: taken
        w.put("a.bin", b"a")
    assert time.monotonic() - start < 30  # not after its 600 s lease


def test_retry_while_the_failed_attempt_is_still_referenced(backend):
    """A retry loop that keeps the exception (and so the failed writer) alive can
    still save again: leaving the writer's block released its claim. (A bare writer
    dropped without commit() stays live while referenced: call abandon() on it.)"""
    uri = backend.uri("step-7")
    kept = []

    def save(data: bytes, fail: bool) -> None:
        with CheckpointWriter(uri, storage_options=backend.options) as w:
            w.put("a.bin", data)
            if fail:
                raise RuntimeError("failed after the first object")

    try:
        save(b"first", fail=True)
    except RuntimeError as exc:
        kept.append(exc)  # holds the traceback, the frames, the writer
    save(b"second", fail=False)
    assert open_checkpoint(uri, backend.options).read("a.bin") == b"second"
    assert kept


def test_copies_leave_no_claim(s3, local):
    from cloudckpt.movement.checkpoint_copy import copy_checkpoint

    src = s3.uri("step-8")
    with CheckpointWriter(src, step=8, storage_options=s3.options) as w:
        w.put("a.bin", b"a" * 1000)
    dest = local.uri("copy")
    copy_checkpoint(src, dest, src_options=s3.options, dst_options=local.options)
    assert not open_store(dest, local.options).exists(CLAIM_NAME)
    assert open_checkpoint(dest, local.options).read("a.bin") == b"a" * 1000


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_save_claims_before_any_rank_writes(s3):
    import torch

    from cloudckpt import dcp

    uri = s3.uri("dcp")
    other = CheckpointWriter(uri, storage_options=s3.options)
    other.claim()  # another save holds the URI
    with pytest.raises(CommitConflictError, match="another save is writing"):
        dcp.save({"w": torch.ones(1000)}, uri, storage_options=s3.options)
    assert open_store(uri, s3.options).list() == []  # no shard was written
    other.abandon()
    assert dcp.save({"w": torch.ones(1000)}, uri, storage_options=s3.options) is not None
    assert not open_store(uri, s3.options).exists(CLAIM_NAME)
