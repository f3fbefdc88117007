"""Writer claims: one writer per checkpoint URI, and a dead writer's claim is no obstacle."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from cloudckpt import CheckpointWriter, CommitConflictError, open_checkpoint, open_store
from cloudckpt.claim import CLAIM_NAME


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


def test_claim_of_another_host_blocks_until_takeover(local):
    uri = local.uri("step-4")
    store = open_store(uri, local.options)
    store.put(CLAIM_NAME, json.dumps({"writer": "x", "host": "other-node", "pid": 1,
                                      "since": 0}).encode())
    with pytest.raises(CommitConflictError, match="other-node.*cloudckpt rm --force"):
        CheckpointWriter(uri, step=4, storage_options=local.options).put("a.bin", b"a")
    assert store.list() and [o.key for o in store.list()] == [CLAIM_NAME]  # nothing written
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
