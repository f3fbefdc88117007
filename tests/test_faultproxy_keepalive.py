"""The fault proxy keeps connections alive as real S3 does, and lands faults on reused ones.

Every test runs on each of ``--s3-servers``. LocalStack keeps an upstream connection
alive when asked (the proxy asks), so a client connection's requests share one upstream
connection; moto answers every request with ``Connection: close``, so the proxy opens one
upstream connection per request there. Either way the client's own connection to the
proxy is kept alive, which is where ``FaultPlan(reused_only=True)`` puts its faults.
"""

from __future__ import annotations

import base64
import http.client
import http.server
import logging
import os
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import boto3
import botocore.config
import botocore.exceptions
import google_crc32c
import pytest
from cloudckpt_testkit import FaultPlan, FaultProxy, LocalStackServer, faultproxy
from cloudckpt_testkit.faultplan import RequestRecord
from helpers import boto3_s3

from cloudckpt import CheckpointWriter, open_checkpoint


def _bucket(backend: Any) -> str:
    return backend.root.split("/")[2]


def _key() -> str:
    return f"keepalive/{uuid.uuid4().hex[:8]}"


def _crc32c_b64(data: bytes) -> str:
    return base64.b64encode(google_crc32c.value(data).to_bytes(4, "big")).decode()


def _keeps_alive(server: Any) -> bool:
    """Whether ``server`` keeps an upstream connection for the next request."""
    return isinstance(server, LocalStackServer)


@pytest.fixture
def raw(s3: Any, s3_server: Any) -> Iterator[tuple[FaultProxy, Any, Any, str]]:
    """(proxy, boto3 client through it, boto3 client straight to the server, bucket);
    botocore's own retries off, so each call is one request."""
    with FaultProxy(s3_server.endpoint) as proxy:
        yield (proxy, boto3_s3(proxy.endpoint, max_attempts=0),
               boto3_s3(s3_server.endpoint, max_attempts=0), _bucket(s3))


# -- keep-alive -------------------------------------------------------------------


def test_a_client_connection_reuses_its_upstream_connection(raw: Any, s3_server: Any) -> None:
    """Empty bodies (PUT's answer, HEAD, 204 DELETE), errors and bodies alike are read
    to their end, so no request after them is refused with a 502."""
    proxy, c, _, bucket = raw
    key = _key()
    c.put_object(Bucket=bucket, Key=key + "/empty", Body=b"")
    assert c.head_object(Bucket=bucket, Key=key + "/empty")["ContentLength"] == 0
    assert c.get_object(Bucket=bucket, Key=key + "/empty")["Body"].read() == b""
    c.put_object(Bucket=bucket, Key=key + "/data", Body=b"x" * 100_000)
    assert c.get_object(Bucket=bucket, Key=key + "/data")["Body"].read() == b"x" * 100_000
    with pytest.raises(botocore.exceptions.ClientError, match="404|NoSuchKey"):
        c.get_object(Bucket=bucket, Key=key + "/missing")
    with pytest.raises(botocore.exceptions.ClientError, match="404|Not Found"):
        c.head_object(Bucket=bucket, Key=key + "/missing")
    c.delete_object(Bucket=bucket, Key=key + "/data")
    listed = c.list_objects_v2(Bucket=bucket, Prefix=key)
    assert [o["Key"] for o in listed["Contents"]] == [key + "/empty"]
    for i in range(10):
        c.put_object(Bucket=bucket, Key=f"{key}/{i}", Body=b"%d" % i)
        assert c.get_object(Bucket=bucket, Key=f"{key}/{i}")["Body"].read() == b"%d" % i
        c.delete_object(Bucket=bucket, Key=f"{key}/{i}")

    log = proxy.request_log
    assert len(log) == 39
    assert proxy.client_connections == 1
    assert [r.reused for r in log] == [False] + [True] * 38
    assert {r.connection for r in log} == {1}
    if _keeps_alive(s3_server):
        # One; a few more only if a busy machine stalled past the server's idle timeout.
        assert proxy.upstream_connections <= 3, proxy.upstream_connections
    else:  # moto closes each connection after its answer
        assert proxy.upstream_connections == len(log)


class _ClosesWhenIdle(http.server.BaseHTTPRequestHandler):
    """Answers 200 "ok" to anything, then closes the connection without saying so in
    its answer, as a server closes an idle kept-alive connection."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")
        self.close_connection = True

    def log_message(self, fmt: str, *args: Any) -> None:
        pass


@pytest.mark.parametrize("noticed", [True, False], ids=["noticed", "resent"])
def test_an_upstream_connection_closed_while_idle_is_replaced(
        noticed: bool, monkeypatch: Any, caplog: Any) -> None:
    """Noticed before reuse (its EOF is readable), or found dead when the request is
    sent on it, the closed connection is replaced by a fresh one: the client never
    sees a 502."""
    if not noticed:
        monkeypatch.setattr(faultproxy._UpstreamConnection, "gone", lambda self: False)
    upstream = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ClosesWhenIdle)
    thread = threading.Thread(target=upstream.serve_forever, daemon=True)
    thread.start()
    try:
        with FaultProxy(f"http://127.0.0.1:{upstream.server_port}") as proxy:
            conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
            answers = []
            caplog.set_level(logging.DEBUG, logger=faultproxy.__name__)
            for _ in range(3):
                conn.request("GET", "/x")
                resp = conn.getresponse()
                answers.append((resp.status, resp.read()))
                time.sleep(0.1)  # the upstream's close arrives while the connection idles
            conn.close()
            assert answers == [(200, b"ok")] * 3
            assert proxy.client_connections == 1
            assert proxy.upstream_connections == 3
            if not noticed:
                assert sum("stale upstream conn" in m for m in caplog.messages) == 2
    finally:
        upstream.shutdown()
        upstream.server_close()


# -- script, reused_only, new kinds -------------------------------------------------


def test_script_answers_in_order_on_reused_connections_only(raw: Any) -> None:
    proxy, c, direct, bucket = raw
    key = _key()
    proxy.set_plan(FaultPlan(methods=("PUT",), match=key, reused_only=True,
                             script=((409, "ConditionalRequestConflict"),
                                     (404, "NoSuchUpload"))))  # fmt: skip
    fresh = boto3_s3(proxy.endpoint, max_attempts=0)
    fresh.put_object(Bucket=bucket, Key=key, Body=b"one")  # a fresh connection: no fault
    for status, code in ((409, "ConditionalRequestConflict"), (404, "NoSuchUpload")):
        with pytest.raises(botocore.exceptions.ClientError) as info:
            fresh.put_object(Bucket=bucket, Key=key, Body=b"refused")
        assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == status
        assert info.value.response["Error"]["Code"] == code
    fresh.put_object(Bucket=bucket, Key=key, Body=b"two")  # the script is spent
    assert direct.get_object(Bucket=bucket, Key=key)["Body"].read() == b"two"
    assert proxy.faults == {"ConditionalRequestConflict": 1, "NoSuchUpload": 1}
    faulted = [r for r in proxy.request_log if r.fault]
    assert [r.fault for r in faulted] == ["ConditionalRequestConflict", "NoSuchUpload"]
    assert all(r.reused for r in faulted)
    assert proxy.client_connections == 1  # the error answers kept the connection


def test_script_validation() -> None:
    assert FaultPlan(script=(409, "ConditionalRequestConflict")).script == (
        (409, "ConditionalRequestConflict"),)
    assert FaultPlan(script="lose_response").script == ("lose_response",)
    assert FaultPlan(script=["reset", [503, "SlowDown"]]).script == ("reset", (503, "SlowDown"))
    with pytest.raises(ValueError, match="unknown fault kind 'lost'"):
        FaultPlan(script=("lost",))
    with pytest.raises(ValueError, match="status must be 400-599"):
        FaultPlan(script=((200, "OK"),))
    with pytest.raises(ValueError, match="neither a fault kind nor a"):
        FaultPlan(script=((409,),))


def test_lose_response_applies_the_request_and_answers_nothing(raw: Any) -> None:
    proxy, c, direct, bucket = raw
    key = _key()
    c.head_bucket(Bucket=bucket)
    proxy.set_plan(FaultPlan(methods=("PUT",), reused_only=True, script=("lose_response",)))
    with pytest.raises(botocore.exceptions.ConnectionClosedError):
        c.put_object(Bucket=bucket, Key=key, Body=b"applied")
    assert direct.get_object(Bucket=bucket, Key=key)["Body"].read() == b"applied"
    assert proxy.faults == {"lose_response": 1}
    (rec,) = [r for r in proxy.request_log if r.fault]
    assert rec.reused and rec.method == "PUT"


def test_corrupt_upload_flips_one_byte_in_flight(raw: Any) -> None:
    """With the body's CRC32C in a header, a verifying server (LocalStack, moto as
    moto_atomic wraps it) refuses the corrupted body and stores nothing."""
    proxy, c, direct, bucket = raw
    key, data = _key(), bytes(range(256)) * 64
    proxy.set_plan(FaultPlan(methods=("PUT",), match=key, script=("corrupt_upload",)))
    c.head_bucket(Bucket=bucket)  # bodyless: the script waits for a body
    put = {"Bucket": bucket, "Key": key, "Body": data, "ChecksumCRC32C": _crc32c_b64(data)}
    with pytest.raises(botocore.exceptions.ClientError) as info:
        c.put_object(**put)
    assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == 400
    assert info.value.response["Error"]["Code"] == "BadDigest"
    with pytest.raises(botocore.exceptions.ClientError, match="404|Not Found"):
        direct.head_object(Bucket=bucket, Key=key)
    assert proxy.faults == {"corrupt_upload": 1}
    c.put_object(**put)  # the script is spent: the same upload goes through whole
    assert direct.get_object(Bucket=bucket, Key=key)["Body"].read() == data
    # Without a checksum (nor a signed SHA-256 either server checks), the body is
    # stored as the proxy sent it: one byte off, in the middle.
    unchecked = boto3.client(
        "s3", endpoint_url=proxy.endpoint, region_name="us-east-1",
        aws_access_key_id="testing", aws_secret_access_key="testing",
        config=botocore.config.Config(retries={"max_attempts": 0},
                                      request_checksum_calculation="when_required"))
    proxy.set_plan(FaultPlan(methods=("PUT",), match=key, script=("corrupt_upload",)))
    unchecked.put_object(Bucket=bucket, Key=key, Body=data)
    stored = direct.get_object(Bucket=bucket, Key=key)["Body"].read()
    assert len(stored) == len(data)
    assert [i for i in range(len(data)) if stored[i] != data[i]] == [len(data) // 2]


# -- cloudckpt through faults on reused connections ------------------------------------


@pytest.fixture
def via(s3: Any, s3_server: Any) -> Iterator[tuple[Any, FaultProxy]]:
    """(the ``s3`` backend reached through a fault proxy, the proxy)."""
    with FaultProxy(s3_server.endpoint) as proxy:
        yield replace(s3, options={**s3.options, "endpoint_url": proxy.endpoint}), proxy


def _objects() -> dict[str, bytes]:
    return {f"obj-{i:02d}.bin": os.urandom(150_000 + i) for i in range(6)}


def _faulted(proxy: FaultProxy) -> RequestRecord:
    """The one faulted request, checked to have come on a connection that had served an
    earlier request."""
    log = proxy.request_log
    (at,) = [i for i, r in enumerate(log) if r.fault]
    rec = log[at]
    assert rec.reused, rec
    assert any(r.connection == rec.connection for r in log[:at]), rec
    return rec


@pytest.mark.parametrize("kind", ["reset", "slowdown", "lose_response"])
def test_a_save_recovers_from_a_fault_on_a_reused_connection(
        via: Any, s3: Any, s3_server: Any, kind: str, caplog: Any) -> None:
    """An object's PUT on a pooled connection is reset before its answer (never
    applied), answered 503 after its body was read, or applied with its answer lost:
    the save re-sends it and commits every byte."""
    backend, proxy = via
    objs = _objects()
    proxy.set_plan(FaultPlan(methods=("PUT",), match="obj-", reused_only=True, script=(kind,)))
    with caplog.at_level(logging.WARNING, logger="cloudckpt"):
        with CheckpointWriter(backend.uri("step-1"), step=1,
                              storage_options=backend.options) as w:  # fmt: skip
            for name, data in objs.items():
                w.put(name, data)
    assert proxy.faults == {kind: 1}
    rec = _faulted(proxy)
    assert proxy.count_requests(rec.target, method="PUT") == 2  # sent once more
    if _keeps_alive(s3_server):
        assert proxy.upstream_connections < proxy.requests // 4, proxy.upstream_connections
    if kind == "slowdown":  # botocore's retries are off: cloudckpt's policy retried
        assert any("retrying" in m and "HTTP 503" in m for m in caplog.messages)
    ckpt = open_checkpoint(s3.uri("step-1"), s3.options)  # straight to the server
    ckpt.verify(deep=True)
    assert {name: ckpt.read(name) for name in objs} == objs


@pytest.mark.parametrize("kind", ["reset_download", "reset", "slowdown"])
def test_a_load_recovers_from_a_fault_on_a_reused_connection(
        via: Any, s3: Any, kind: str) -> None:
    """An object's GET on a pooled connection is cut mid-body, reset before its
    answer, or answered 503: the read asks again and returns every byte."""
    backend, proxy = via
    objs = _objects()
    with CheckpointWriter(s3.uri("step-1"), step=1, storage_options=s3.options) as w:
        for name, data in objs.items():
            w.put(name, data)
    proxy.set_plan(FaultPlan(methods=("GET",), match="obj-", reused_only=True, script=(kind,)))
    ckpt = open_checkpoint(backend.uri("step-1"), backend.options)
    assert {name: ckpt.read(name) for name in objs} == objs
    assert proxy.faults == {kind: 1}
    rec = _faulted(proxy)
    assert proxy.count_requests(rec.target.partition("?")[0], method="GET") >= 2
    if kind == "reset_download":
        assert proxy.bytes_out > sum(map(len, objs.values()))  # half of one, then again
