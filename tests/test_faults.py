"""Retries against real HTTP faults: a proxy between s3fs and the S3 server (moto,
LocalStack) breaks requests."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import replace

import pytest
from cloudckpt_testkit import FaultPlan, FaultProxy

from cloudckpt import (
    MANIFEST_NAME,
    CheckpointWriter,
    RetryPolicy,
    StorageError,
    open_checkpoint,
    open_store,
)
from cloudckpt.storage import is_transient


@pytest.fixture
def proxied(s3, s3_server):
    with FaultProxy(s3_server.endpoint) as proxy:
        yield replace(s3, options={**s3.options, "endpoint_url": proxy.endpoint}), proxy


def test_transient_faults_are_absorbed(proxied, s3, caplog):
    via, proxy = proxied
    # The bucket's conditional-write probe first, fault-free (it runs once per bucket
    # and process): the seeded faults then fall on the checkpoint's own requests.
    open_store(via.uri("probe-first"), via.options).put_if_absent("k", b"k")
    proxy.set_plan(FaultPlan(error_rate=0.2, kinds=("slowdown", "reset"), seed=7))
    objs = {f"obj-{i:02d}.bin": os.urandom(4096 + i) for i in range(50)}
    uri = via.uri("step-1")
    with caplog.at_level(logging.WARNING, logger="cloudckpt"):
        with CheckpointWriter(uri, step=1, storage_options=via.options) as w:
            w.put_many(dict(list(objs.items())[:25]))
            for name, data in list(objs.items())[25:]:
                w.put(name, data)
        ckpt = open_checkpoint(uri, via.options)
        ckpt.verify(deep=True)
        assert dict(ckpt.iter_objects()) == objs
    faults = proxy.faults
    assert faults.get("slowdown", 0) > 5 and faults.get("reset", 0) > 5, faults
    retries = [r.getMessage() for r in caplog.records if "retrying" in r.getMessage()]
    # botocore's own retries are off, so every 503 reaches our policy and is logged
    # (resets on an idle pooled connection are sometimes re-sent by aiohttp itself).
    assert sum("HTTP 503" in m for m in retries) == faults["slowdown"]
    assert any("Connection" in m for m in retries)
    assert any("put " in m and "obj-" in m for m in retries)
    assert not any(s3.options["secret"] in m for m in caplog.messages if m)
    # What the faulty path committed is what a clean path reads back.
    open_checkpoint(s3.uri("step-1"), s3.options).verify(deep=True)


def test_permanent_403_fails_fast_and_commits_nothing(proxied, s3):
    via, proxy = proxied
    deadline = 5.0
    opts = {**via.options, "retry": RetryPolicy(max_attempts=10, initial_backoff=0.05,
                                                 max_backoff=0.5, deadline=deadline)}
    open_store(s3.uri("step-1"), s3.options).put("obj-00.bin", b"written before the outage")
    proxy.set_plan(FaultPlan(permanent_status=403))
    t0 = time.monotonic()
    with pytest.raises(StorageError, match="access was denied; check the credentials"):
        with CheckpointWriter(via.uri("step-2"), step=2, storage_options=opts) as w:
            for i in range(50):
                w.put(f"obj-{i:02d}.bin", b"x" * 100)
    assert time.monotonic() - t0 < deadline
    assert proxy.faults["permanent"] >= 1
    assert not open_store(s3.uri("step-2"), s3.options).exists(MANIFEST_NAME)


def test_throttling_that_never_ends_hits_the_deadline(proxied):
    via, proxy = proxied
    proxy.set_plan(FaultPlan(error_rate=1.0, kinds=("slowdown",)))
    opts = {**via.options, "retry": RetryPolicy(max_attempts=1000, initial_backoff=0.05,
                                                 max_backoff=0.2, deadline=2.0)}
    t0 = time.monotonic()
    with pytest.raises(StorageError, match="transient errors.*RetryPolicy.deadline"):
        open_store(via.root, opts).put("a.bin", b"a")
    assert 1.5 < time.monotonic() - t0 < 6.0
    assert proxy.faults["slowdown"] >= 3  # retried until the deadline (fewer on a busy machine)


def test_unreachable_endpoint_is_a_clear_error():
    opts = {"endpoint_url": "http://127.0.0.1:9", "key": "k", "secret": "s",
            "retry": RetryPolicy(initial_backoff=0.05, max_backoff=0.2, deadline=2.0)}
    t0 = time.monotonic()
    with pytest.raises(StorageError, match="check that the endpoint is reachable"):
        open_store("s3://bucket/x", opts).put("a", b"a")
    assert time.monotonic() - t0 < 15


def test_transient_classification():
    from botocore.exceptions import ClientError

    def client_error(code: str, status: int) -> ClientError:
        return ClientError({"Error": {"Code": code, "Message": "m"},
                            "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")

    assert is_transient(client_error("SlowDown", 503))
    assert is_transient(client_error("InternalError", 500))
    assert is_transient(client_error("Throttling", 429))
    assert not is_transient(client_error("AccessDenied", 403))
    assert not is_transient(client_error("PreconditionFailed", 412))
    wrapped = OSError(16, "busy")
    wrapped.__cause__ = client_error("SlowDown", 503)
    assert is_transient(wrapped)
    assert is_transient(ConnectionResetError())
    assert is_transient(TimeoutError())
    assert not is_transient(PermissionError("denied"))
    assert not is_transient(FileNotFoundError("x"))
    assert not is_transient(ValueError("bad"))
    # gcsfs: a failed token refresh becomes a 401; bad credentials stay permanent
    from gcsfs.retry import HttpError
    from google.auth.exceptions import RefreshError

    refresh = HttpError({"code": 401, "message": "Invalid Credentials"})
    refresh.__cause__ = RefreshError("metadata server busy")
    assert is_transient(refresh)
    assert not is_transient(HttpError({"code": 401, "message": "Invalid Credentials"}))


def test_truncated_responses_are_retried(proxied, s3):
    """A body cut short (aiohttp ContentLengthError, code=400) is transient, not a 400."""
    via, proxy = proxied
    data = {f"t{i}.bin": os.urandom(200_000) for i in range(8)}
    open_store(s3.root, s3.options).put_many(data)
    proxy.set_plan(FaultPlan(error_rate=0.5, kinds=("truncate",), seed=3, match="/t"))
    store = open_store(via.root, via.options)
    assert store.get_many(sorted(data)) == {k: data[k] for k in sorted(data)}
    assert store.get_range("t1.bin", 1000, 90_000) == data["t1.bin"][1000:90_000]
    assert proxy.faults.get("truncate", 0) >= 2


def test_a_range_read_into_buffers_on_the_event_loop_resumes_where_it_was_cut(
        proxied, s3, caplog, monkeypatch):
    """read_range_into puts each piece into the buffers where it arrives, the event
    loop's thread, most of them received there in place; a body cut short resumes
    at its first missing byte, and the buffers and the CRC32C are those of the
    whole range."""
    import threading

    from cloudckpt.storage.transfer import ranges
    from cloudckpt.util.crc import Crc32c

    via, proxy = proxied
    data = os.urandom(3 << 20)
    open_store(s3.root, s3.options).put("big.bin", data)
    where: set[str] = set()
    in_place = [0]
    real = ranges.Filling.put

    def put(self, piece):
        where.add(threading.current_thread().name)
        in_place[0] += piece.nbytes if any(piece.obj is v.obj for v in self.views) else 0
        return real(self, piece)

    monkeypatch.setattr(ranges.Filling, "put", put)
    proxy.set_plan(FaultPlan(error_rate=1.0, kinds=("truncate",), max_faults=2, match="big"))
    outs = [bytearray(1 << 20), memoryview(bytearray(2 << 20))[:(2 << 20) - 100]]
    with caplog.at_level(logging.WARNING, logger="cloudckpt"):
        crc = open_store(via.root, via.options).read_range_into("big.bin", 100, outs)
    assert bytes(outs[0]) + bytes(outs[1]) == data[100:]
    whole = Crc32c()
    whole.update(data[100:])
    assert crc == whole.value
    assert proxy.faults.get("truncate", 0) == 2
    assert any("resuming get_range" in r.getMessage() for r in caplog.records)
    assert where == {"fsspecIO"}, where
    assert in_place[0] >= len(data) // 2, in_place



def test_a_manifest_committed_during_the_open_is_read(proxied, s3):
    """A reader whose manifest GET lands just before a racing writer's commit (the
    404 here), and whose listing lands just after, reads the checkpoint: it does not
    fail on a checkpoint that is committed (ROLL's parts commit concurrently)."""
    via, proxy = proxied
    with CheckpointWriter(s3.uri("raced"), step=1, storage_options=s3.options) as w:
        w.put("obj.bin", b"x" * 10)
    proxy.set_plan(FaultPlan(permanent_status=404, match=MANIFEST_NAME, methods=("GET",),
                             max_faults=1))
    ckpt = open_checkpoint(via.uri("raced"), via.options)
    assert ckpt.manifest.step == 1 and ckpt.read("obj.bin") == b"x" * 10
    assert proxy.faults["permanent"] == 1
