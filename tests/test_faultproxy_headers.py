"""The fault proxy's header-level behaviours against real S3 servers (moto, LocalStack) and
fake-gcs-server.

``strip_headers``/``strip_query`` make a store ignore conditional writes,
``refuse_headers``/``refuse_query`` make it answer them with an error, and the
request log lets a test count what the client really sent.
"""

from __future__ import annotations

import base64
import http.client
import json
import uuid
from collections.abc import Iterator
from typing import Any

import botocore.exceptions
import google_crc32c
import pytest
from cloudckpt_testkit import FaultPlan, FaultProxy
from cloudckpt_testkit.faultplan import RequestRecord, without_query
from helpers import boto3_s3

# -- helpers -------------------------------------------------------------------


def _bucket(backend: Any) -> str:
    return backend.root.split("/")[2]


def _key() -> str:
    return f"hdr/{uuid.uuid4().hex[:8]}"


def _error(call: Any) -> tuple[int, dict[str, str]]:
    with pytest.raises(botocore.exceptions.ClientError) as info:
        call()
    resp = info.value.response
    return resp["ResponseMetadata"]["HTTPStatusCode"], resp["Error"]


def _put_status(client: Any, bucket: str, key: str, body: bytes, **kwargs: Any) -> int:
    """The HTTP status of one PutObject, success or not."""
    try:
        resp = client.put_object(Bucket=bucket, Key=key, Body=body, **kwargs)
    except botocore.exceptions.ClientError as exc:
        resp = exc.response
    return int(resp["ResponseMetadata"]["HTTPStatusCode"])


def _crc32c_b64(data: bytes) -> str:
    return base64.b64encode(google_crc32c.value(data).to_bytes(4, "big")).decode()


def _http(
    port: int, method: str, target: str, body: bytes = b"", headers: dict[str, str] | None = None
) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(method, target, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _gcs_upload(port: int, bucket: str, name: str, data: bytes, query: str) -> tuple[int, bytes]:
    """A GCS JSON-API multipart upload (the kind fake-gcs-server applies preconditions to)."""
    b = "cloudckpt-boundary"
    body = (
        (
            f"--{b}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n"
            f"{json.dumps({'name': name})}\r\n--{b}\r\n"
            "Content-Type: application/octet-stream\r\n\r\n"
        ).encode()
        + data
        + f"\r\n--{b}--\r\n".encode()
    )
    headers = {"Content-Type": f'multipart/related; boundary="{b}"'}
    return _http(port, "POST", f"/upload/storage/v1/b/{bucket}/o?{query}", body, headers)


def _gcs_read(port: int, bucket: str, name: str) -> tuple[int, bytes]:
    return _http(port, "GET", f"/storage/v1/b/{bucket}/o/{name.replace('/', '%2F')}?alt=media")


@pytest.fixture
def s3_proxy(s3: Any, s3_server: Any) -> Iterator[tuple[FaultProxy, Any, Any, str]]:
    """(proxy, client through it, client straight to the S3 server, bucket)."""
    with FaultProxy(s3_server.endpoint) as proxy:
        yield (proxy, boto3_s3(proxy.endpoint, max_attempts=0),
               boto3_s3(s3_server.endpoint, max_attempts=0), _bucket(s3))


@pytest.fixture
def gcs_proxy(gcs: Any, gcs_server: Any) -> Iterator[tuple[FaultProxy, str, int]]:
    """(proxy, bucket, fake-gcs-server's port)."""
    with FaultProxy(gcs_server.endpoint) as proxy:
        yield proxy, _bucket(gcs), gcs_server.port


# -- S3: stripping ---------------------------------------------------------------


def test_s3_strip_conditional_headers_makes_moto_ignore_them(s3_proxy: Any) -> None:
    proxy, c, direct, bucket = s3_proxy
    key = _key()
    # Baseline: moto honours If-None-Match and If-Match on PutObject.
    c.put_object(Bucket=bucket, Key=key, Body=b"one", IfNoneMatch="*")
    assert _put_status(c, bucket, key, b"two", IfNoneMatch="*") == 412
    assert _put_status(c, bucket, key, b"two", IfMatch='"nope"') == 412
    assert direct.get_object(Bucket=bucket, Key=key)["Body"].read() == b"one"

    proxy.set_plan(FaultPlan(strip_headers=("If-None-Match", "if-match")))
    c.put_object(Bucket=bucket, Key=key, Body=b"two", IfNoneMatch="*")  # overwrites
    assert direct.get_object(Bucket=bucket, Key=key)["Body"].read() == b"two"
    c.put_object(Bucket=bucket, Key=key, Body=b"three", IfMatch='"nope"')  # swaps blindly
    assert direct.get_object(Bucket=bucket, Key=key)["Body"].read() == b"three"

    puts = [r for r in proxy.request_log if r.method == "PUT"]
    assert [r.stripped for r in puts] == [(), (), (), ("If-None-Match",), ("If-Match",)]
    # The log shows what the client sent, before stripping.
    assert all("if-none-match" in r.headers or "if-match" in r.headers for r in puts)


def test_s3_strip_is_scoped_by_match_and_methods(s3_proxy: Any) -> None:
    proxy, c, direct, bucket = s3_proxy
    kept, stripped = _key() + "/data", _key() + "/manifest.json"
    for key in (kept, stripped):
        c.put_object(Bucket=bucket, Key=key, Body=b"v1")
    proxy.set_plan(FaultPlan(strip_headers=("If-None-Match",), match="manifest"))
    assert _put_status(c, bucket, kept, b"v2", IfNoneMatch="*") == 412
    c.put_object(Bucket=bucket, Key=stripped, Body=b"v2", IfNoneMatch="*")
    assert direct.get_object(Bucket=bucket, Key=stripped)["Body"].read() == b"v2"

    proxy.set_plan(FaultPlan(strip_headers=("If-None-Match",), methods=("POST",)))
    assert _put_status(c, bucket, stripped, b"v3", IfNoneMatch="*") == 412


def test_s3_strip_reaches_complete_multipart_upload(s3_proxy: Any) -> None:
    """CompleteMultipartUpload carries If-None-Match in its headers: the proxy sees it."""
    proxy, c, direct, bucket = s3_proxy
    key = _key()
    c.put_object(Bucket=bucket, Key=key, Body=b"existing")

    def complete() -> Any:
        mpu = c.create_multipart_upload(Bucket=bucket, Key=key)
        part = c.upload_part(
            Bucket=bucket, Key=key, UploadId=mpu["UploadId"], PartNumber=1, Body=b"multipart"
        )
        parts = {"Parts": [{"PartNumber": 1, "ETag": part["ETag"]}]}
        return c.complete_multipart_upload(
            Bucket=bucket, Key=key, UploadId=mpu["UploadId"], MultipartUpload=parts,
            IfNoneMatch="*",
        )  # fmt: skip

    assert _error(complete)[0] == 412
    proxy.set_plan(FaultPlan(strip_headers=("If-None-Match",), methods=("POST",),
                             match="uploadId="))  # fmt: skip
    complete()
    assert direct.get_object(Bucket=bucket, Key=key)["Body"].read() == b"multipart"
    (rec,) = [r for r in proxy.request_log if r.stripped]
    assert rec.method == "POST" and "uploadId=" in rec.target
    assert rec.headers["if-none-match"] == "*"


# -- S3: refusing ----------------------------------------------------------------


def test_s3_refuse_if_none_match_answers_501_without_forwarding(s3_proxy: Any) -> None:
    proxy, c, direct, bucket = s3_proxy
    key = _key()
    proxy.set_plan(FaultPlan(refuse_headers=("if-none-match",)))
    status, error = _error(lambda: c.put_object(Bucket=bucket, Key=key, Body=b"x" * 4096,
                                                IfNoneMatch="*"))  # fmt: skip
    assert status == 501
    assert error["Code"] == "NotImplemented" and error["Header"] == "If-None-Match"
    with pytest.raises(botocore.exceptions.ClientError):  # never reached moto
        direct.head_object(Bucket=bucket, Key=key)
    # The same client (and pooled connection) goes on working.
    c.put_object(Bucket=bucket, Key=key, Body=b"plain")
    assert direct.get_object(Bucket=bucket, Key=key)["Body"].read() == b"plain"
    assert [r.refused for r in proxy.request_log] == ["If-None-Match", None]
    assert proxy.faults == {}  # refusals are store behaviour, not faults


def test_s3_refuse_checksum_header_with_400(s3_proxy: Any) -> None:
    proxy, c, direct, bucket = s3_proxy
    key, data = _key(), b"checksummed"
    proxy.set_plan(FaultPlan(refuse_headers=("x-amz-checksum-crc32c",), refuse_status=400))
    # ChecksumAlgorithm="CRC32C" needs awscrt; a precomputed value sends the same header.
    status, error = _error(lambda: c.put_object(Bucket=bucket, Key=key, Body=data,
                                                ChecksumCRC32C=_crc32c_b64(data)))  # fmt: skip
    assert status == 400
    assert error["Code"] == "InvalidArgument"
    assert error["ArgumentName"].lower() == "x-amz-checksum-crc32c"
    c.put_object(Bucket=bucket, Key=key, Body=data)  # botocore's default CRC32 passes
    assert direct.get_object(Bucket=bucket, Key=key)["Body"].read() == data
    assert proxy.count_requests(key, header="x-amz-checksum-crc32c") == 1
    assert proxy.count_requests(key, header="x-amz-checksum-crc32") == 1


def test_refusal_drains_the_body_and_keeps_the_connection(s3_proxy: Any) -> None:
    """Chunked (with Expect: 100-continue) and sized bodies are read in full before
    the refusal, so the next request on the same connection is parsed correctly."""
    proxy, _, direct, bucket = s3_proxy
    proxy.set_plan(FaultPlan(refuse_headers=("If-None-Match",)))
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
    try:
        conn.putrequest("PUT", f"/{bucket}/chunked")
        for name, value in (("If-None-Match", "*"), ("Transfer-Encoding", "chunked"),
                            ("Expect", "100-continue")):  # fmt: skip
            conn.putheader(name, value)
        conn.endheaders(iter([b"a" * 70_000, b"b" * 1000]), encode_chunked=True)
        resp = conn.getresponse()
        assert resp.status == 501 and b"<Code>NotImplemented</Code>" in resp.read()
        conn.request("PUT", f"/{bucket}/sized", body=b"c" * 300_000,
                     headers={"If-None-Match": "*"})  # fmt: skip
        resp = conn.getresponse()
        assert resp.status == 501 and resp.read().startswith(b"<?xml")
        conn.request("PUT", f"/{bucket}/after", body=b"forwarded")
        resp = conn.getresponse()
        resp.read()
        assert resp.status == 200
    finally:
        conn.close()
    assert direct.get_object(Bucket=bucket, Key="after")["Body"].read() == b"forwarded"
    assert "Contents" not in direct.list_objects_v2(Bucket=bucket, Prefix="chunked")
    assert "Contents" not in direct.list_objects_v2(Bucket=bucket, Prefix="sized")


def test_faults_take_precedence_over_refusals(s3_proxy: Any) -> None:
    proxy, c, direct, bucket = s3_proxy
    key = _key()
    proxy.set_plan(FaultPlan(error_rate=1.0, kinds=("slowdown",), max_faults=1,
                             refuse_headers=("If-None-Match",)))  # fmt: skip
    assert _put_status(c, bucket, key, b"x", IfNoneMatch="*") == 503
    assert _put_status(c, bucket, key, b"x", IfNoneMatch="*") == 501
    assert [(r.fault, r.refused) for r in proxy.request_log] == [
        ("slowdown", None),
        ("", "If-None-Match"),
    ]
    # truncate cuts the refusal's body like any response.
    proxy.set_plan(FaultPlan(error_rate=1.0, kinds=("truncate",),
                             refuse_headers=("If-None-Match",)))  # fmt: skip
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
    conn.request("PUT", f"/{bucket}/{key}", body=b"x", headers={"If-None-Match": "*"})
    resp = conn.getresponse()
    assert resp.status == 501
    with pytest.raises(http.client.IncompleteRead):
        resp.read()
    conn.close()


# -- GCS -------------------------------------------------------------------------


def test_gcs_strip_if_generation_match_makes_create_only_overwrite(gcs_proxy: Any) -> None:
    proxy, bucket, _ = gcs_proxy
    name = _key()
    query = "ifGenerationMatch=0&uploadType=multipart"  # uploadType must survive stripping
    assert _gcs_upload(proxy.port, bucket, name, b"one", query)[0] == 200
    status, body = _gcs_upload(proxy.port, bucket, name, b"two", query)
    assert status == 412 and json.loads(body)["error"]["code"] == 412

    proxy.set_plan(FaultPlan(strip_query=("ifGenerationMatch", "ifMetagenerationMatch")))
    assert _gcs_upload(proxy.port, bucket, name, b"two", query)[0] == 200
    assert _gcs_read(proxy.port, bucket, name) == (200, b"two")
    assert proxy.request_log[-2].stripped == ("ifGenerationMatch",)
    assert proxy.request_log[-2].target.endswith("?" + query)  # logged as sent


def test_gcs_refuse_if_generation_match_answers_json(gcs_proxy: Any) -> None:
    proxy, bucket, upstream_port = gcs_proxy
    name = _key()
    proxy.set_plan(FaultPlan(refuse_query=("ifGenerationMatch",)))
    status, body = _gcs_upload(proxy.port, bucket, name, b"x", "uploadType=multipart&"
                               "ifGenerationMatch=0")  # fmt: skip
    assert status == 501
    error = json.loads(body)["error"]
    assert error["code"] == 501 and "ifGenerationMatch" in error["message"]
    assert _gcs_read(upstream_port, bucket, name)[0] == 404  # never forwarded
    assert _gcs_upload(proxy.port, bucket, name, b"y", "uploadType=multipart")[0] == 200
    assert _gcs_read(upstream_port, bucket, name) == (200, b"y")


# -- counters --------------------------------------------------------------------


def test_request_log_and_counters(s3_proxy: Any) -> None:
    proxy, c, _, bucket = s3_proxy
    probe = f"probe-{uuid.uuid4().hex[:8]}"
    c.put_object(Bucket=bucket, Key=f"a/{probe}", Body=b"1", IfNoneMatch="*")
    c.put_object(Bucket=bucket, Key="a/other", Body=b"2")
    c.get_object(Bucket=bucket, Key=f"a/{probe}")["Body"].read()
    c.head_object(Bucket=bucket, Key="a/other")

    assert proxy.requests == 4
    assert proxy.requests_by_method == {"PUT": 2, "GET": 1, "HEAD": 1}
    assert proxy.count_requests() == 4
    assert proxy.count_requests(probe) == 2
    assert proxy.count_requests(probe, method="put") == 1
    assert proxy.count_requests(header="If-None-Match") == 1
    log = proxy.request_log
    assert all(isinstance(r, RequestRecord) for r in log)
    assert [(r.method, r.target) for r in log] == [
        ("PUT", f"/{bucket}/a/{probe}"),
        ("PUT", f"/{bucket}/a/other"),
        ("GET", f"/{bucket}/a/{probe}"),
        ("HEAD", f"/{bucket}/a/other"),
    ]
    assert log[0].headers["if-none-match"] == "*" and log[0].fault == ""
    log.clear()  # a copy
    assert len(proxy.request_log) == 4

    proxy.reset_counters()
    assert (proxy.requests, proxy.requests_by_method, proxy.request_log) == (0, {}, [])


def test_request_log_is_bounded(s3_server: Any) -> None:
    with FaultProxy(s3_server.endpoint, log_limit=2) as proxy:
        for _ in range(3):
            assert _http(proxy.port, "GET", "/")[0] == 200
        assert proxy.requests == 3 and len(proxy.request_log) == 2


# -- plan validation and query stripping ----------------------------------------------


def test_plan_validation() -> None:
    plan = FaultPlan(strip_headers="If-None-Match", refuse_query="ifGenerationMatch")
    assert plan.strip_headers == ("if-none-match",)
    assert plan.refuse_query == ("ifGenerationMatch",)
    with pytest.raises(ValueError, match="content-length"):
        FaultPlan(strip_headers=("Content-Length",))
    with pytest.raises(ValueError, match="refuse_status"):
        FaultPlan(refuse_status=200)


def test_strip_query_keeps_other_parameters_verbatim() -> None:
    names = ("ifGenerationMatch", "ifMetagenerationMatch")
    assert without_query("/o?ifGenerationMatch=0", names) == ("/o", ["ifGenerationMatch"])
    assert without_query("/o?a=%2F&ifGenerationMatch=5&b", names) == (
        "/o?a=%2F&b",
        ["ifGenerationMatch"],
    )
    assert without_query("/o?ifGeneration%4Datch=1&ifMetagenerationMatch=2&x=1", names) == (
        "/o?x=1",
        ["ifGenerationMatch", "ifMetagenerationMatch"],
    )
    assert without_query("/o?IFGENERATIONMATCH=0", names) == ("/o?IFGENERATIONMATCH=0", [])
    assert without_query("/o", names) == ("/o", [])
