"""Tests for cloudckpt_testkit: real local servers and the fault proxy.

These helpers underpin the retry/crash tests, so they are verified here against
the real clients (s3fs, gcsfs, boto3) over real HTTP.
"""

from __future__ import annotations

import http.client
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

# gcsfs reads this at import time; without it every call stalls ~60 s.
os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"

import botocore.exceptions
import pytest
import s3fs
from cloudckpt_testkit import FakeGcsServer, FaultPlan, FaultProxy, MotoServer
from helpers import boto3_s3

BUCKET = "ckpt-test"


@pytest.fixture(scope="module")
def moto() -> Iterator[MotoServer]:
    with MotoServer(part_min_size=256 * 1024) as server:
        yield server


@pytest.fixture()
def s3(moto: MotoServer) -> MotoServer:
    """Moto with fresh state and one bucket."""
    moto.reset()
    moto.create_bucket(BUCKET)
    return moto


@pytest.fixture(scope="module")
def gcs() -> Iterator[FakeGcsServer]:
    with FakeGcsServer() as server:
        yield server


@pytest.fixture()
def proxy(s3: MotoServer) -> Iterator[FaultProxy]:
    with FaultProxy(s3.endpoint) as p:
        yield p


def _keys(server: MotoServer) -> set[str]:
    client = boto3_s3(server.endpoint)
    resp = client.list_objects_v2(Bucket=BUCKET)
    return {o["Key"] for o in resp.get("Contents", [])}


def test_moto_server_with_s3fs(s3: MotoServer, tmp_path: Path) -> None:
    fs = s3fs.S3FileSystem(**s3.storage_options(), skip_instance_cache=True)
    src = tmp_path / "src.bin"
    src.write_bytes(b"hello moto")
    fs.put_file(str(src), f"{BUCKET}/dir/a.bin")
    assert fs.ls(f"{BUCKET}/dir") == [f"{BUCKET}/dir/a.bin"]
    dst = tmp_path / "dst.bin"
    fs.get_file(f"{BUCKET}/dir/a.bin", str(dst))
    assert dst.read_bytes() == b"hello moto"

    env = s3.env()
    assert env["AWS_ENDPOINT_URL"] == s3.endpoint
    assert env["AWS_DEFAULT_REGION"] == "us-east-1"

    s3.reset()
    fs.invalidate_cache()
    assert fs.ls("") == []


def test_moto_small_multipart_parts(s3: MotoServer) -> None:
    """part_min_size reaches the child: 256 KiB parts are accepted."""
    client = boto3_s3(s3.endpoint)
    mpu = client.create_multipart_upload(Bucket=BUCKET, Key="mp")
    parts = []
    for n in (1, 2):
        r = client.upload_part(
            Bucket=BUCKET, Key="mp", UploadId=mpu["UploadId"], PartNumber=n, Body=b"p" * 300_000
        )
        parts.append({"PartNumber": n, "ETag": r["ETag"]})
    client.complete_multipart_upload(
        Bucket=BUCKET, Key="mp", UploadId=mpu["UploadId"], MultipartUpload={"Parts": parts}
    )
    assert client.head_object(Bucket=BUCKET, Key="mp")["ContentLength"] == 600_000


def test_fake_gcs_server_with_gcsfs(gcs: FakeGcsServer, tmp_path: Path) -> None:
    import gcsfs

    gcs.reset()
    gcs.create_bucket("gbucket")
    fs = gcsfs.GCSFileSystem(**gcs.storage_options(), skip_instance_cache=True)
    src = tmp_path / "src.bin"
    src.write_bytes(b"hello gcs")
    start = time.monotonic()
    fs.put_file(str(src), "gbucket/dir/a.bin")
    assert fs.ls("gbucket/dir") == ["gbucket/dir/a.bin"]
    dst = tmp_path / "dst.bin"
    fs.get_file("gbucket/dir/a.bin", str(dst))
    assert dst.read_bytes() == b"hello gcs"
    assert time.monotonic() - start < 10, "gcsfs stalled: HNS probing enabled?"

    gcs.reset()
    fs.invalidate_cache()
    assert fs.ls("") == []


def test_fault_proxy_injects_slowdown_and_reset(s3: MotoServer, proxy: FaultProxy) -> None:
    proxy.set_plan(FaultPlan(error_rate=0.5, kinds=("slowdown", "reset"), seed=7))
    # botocore's "max_attempts" counts *retries* (max_attempts=1 means two
    # attempts); total_max_attempts=1 disables retries so every fault surfaces.
    client = boto3_s3(proxy.endpoint, total_max_attempts=1, mode="standard")
    ok, slowdowns, conn_errors = set(), 0, 0
    for i in range(40):
        try:
            client.put_object(Bucket=BUCKET, Key=f"k{i}", Body=b"x" * 64)
            ok.add(f"k{i}")
        except botocore.exceptions.ClientError as exc:
            assert exc.response["Error"]["Code"] == "SlowDown"
            assert exc.response["ResponseMetadata"]["HTTPStatusCode"] == 503
            slowdowns += 1
        except (botocore.exceptions.ConnectionError, botocore.exceptions.HTTPClientError):
            conn_errors += 1
    assert slowdowns > 0 and conn_errors > 0
    assert proxy.requests == 40
    assert proxy.faults == {"slowdown": slowdowns, "reset": conn_errors}
    # Faulted requests never reached moto; the rest did.
    assert _keys(s3) == ok


def test_fault_proxy_roundtrips_3mib_via_s3fs(proxy: FaultProxy) -> None:
    fs = s3fs.S3FileSystem(endpoint_url=proxy.endpoint, key="testing", secret="testing",
                           skip_instance_cache=True)  # fmt: skip
    data = os.urandom(3 * 1024 * 1024)
    fs.pipe(f"{BUCKET}/big.bin", data)
    assert fs.cat(f"{BUCKET}/big.bin") == data
    assert fs.cat_file(f"{BUCKET}/big.bin", start=1000, end=2000) == data[1000:2000]
    assert fs.info(f"{BUCKET}/big.bin")["size"] == len(data)
    assert fs.ls(BUCKET) == [f"{BUCKET}/big.bin"]
    assert proxy.requests >= 4
    assert proxy.faults == {}


def test_fault_proxy_permanent_access_denied(s3: MotoServer, proxy: FaultProxy) -> None:
    boto3_s3(s3.endpoint).put_object(Bucket=BUCKET, Key="k", Body=b"v")
    proxy.set_plan(FaultPlan(permanent_status=403))
    client = boto3_s3(proxy.endpoint)
    for _ in range(3):
        with pytest.raises(botocore.exceptions.ClientError) as info:
            client.get_object(Bucket=BUCKET, Key="k")
        assert info.value.response["Error"]["Code"] == "AccessDenied"
        assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403
    fs = s3fs.S3FileSystem(endpoint_url=proxy.endpoint, key="testing", secret="testing",
                           skip_instance_cache=True)  # fmt: skip
    with pytest.raises(PermissionError):
        fs.cat(f"{BUCKET}/k")
    assert proxy.faults["permanent"] == proxy.requests


def test_fault_proxy_truncate_is_retried_by_s3fs(s3: MotoServer, proxy: FaultProxy) -> None:
    data = os.urandom(200_000)
    boto3_s3(s3.endpoint).put_object(Bucket=BUCKET, Key="t", Body=data)
    proxy.set_plan(FaultPlan(error_rate=1.0, kinds=("truncate",), match="/t", max_faults=1))
    fs = s3fs.S3FileSystem(endpoint_url=proxy.endpoint, key="testing", secret="testing",
                           skip_instance_cache=True)  # fmt: skip
    assert fs.cat(f"{BUCKET}/t") == data
    assert proxy.faults == {"truncate": 1}


def test_fault_proxy_raw_http_semantics(s3: MotoServer, proxy: FaultProxy) -> None:
    """Chunked + Expect bodies are forwarded; reset is an RST; truncate is short."""
    # moto answers anonymous reads with 403, so reads use presigned URLs
    # (query-string SigV4 made for the proxy's host, passed through as-is).
    signer = boto3_s3(proxy.endpoint)

    def presigned(method: str) -> str:
        url = signer.generate_presigned_url(
            "get_object", Params={"Bucket": BUCKET, "Key": "chunked"}, HttpMethod=method
        )
        return url[len(proxy.endpoint) :]

    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
    conn.putrequest("PUT", f"/{BUCKET}/chunked")
    conn.putheader("Transfer-Encoding", "chunked")
    conn.putheader("Expect", "100-continue")
    conn.endheaders(iter([b"hello ", b"chunked ", b"world"]), encode_chunked=True)
    resp = conn.getresponse()
    resp.read()
    assert resp.status == 200
    # Same keep-alive connection; HEAD keeps the real Content-Length.
    conn.request("HEAD", presigned("HEAD"))
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("Content-Length") == "19"
    assert resp.read() == b""
    conn.request("GET", presigned("GET"))
    assert conn.getresponse().read() == b"hello chunked world"
    conn.close()

    proxy.set_plan(FaultPlan(error_rate=1.0, kinds=("reset",)))
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
        sock.sendall(f"GET {presigned('GET')} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        with pytest.raises(ConnectionResetError):
            sock.recv(1024)

    proxy.set_plan(FaultPlan(error_rate=1.0, kinds=("truncate",)))
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
    conn.request("GET", presigned("GET"))
    resp = conn.getresponse()
    assert resp.status == 200
    with pytest.raises(http.client.IncompleteRead) as info:
        resp.read()
    assert info.value.partial == b"hello chu"  # 19 // 2 bytes
    conn.close()


def test_fault_proxy_hold_lets_test_kill_client_mid_request(
    s3: MotoServer, proxy: FaultProxy
) -> None:
    seen: list[tuple[str, str]] = []
    proxy.on_request = lambda method, path: seen.append((method, path))
    proxy.hold = f"/{BUCKET}/victim"
    proxy.hold_action = "drop"
    env = {**os.environ, **s3.env(), "AWS_ENDPOINT_URL": proxy.endpoint}
    code = (
        "import boto3; boto3.client('s3').put_object("
        f"Bucket={BUCKET!r}, Key='victim', Body=b'x' * 1000)"
    )
    child = subprocess.Popen([sys.executable, "-c", code], env=env)
    try:
        assert proxy.held.wait(20), "client request never reached the proxy"
        assert seen[-1] == ("PUT", f"/{BUCKET}/victim")
        child.send_signal(signal.SIGKILL)
        assert child.wait(10) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    proxy.release.set()
    assert "victim" not in _keys(s3)


def test_fault_proxy_stop_is_prompt_with_idle_keepalive(moto: MotoServer) -> None:
    proxy = FaultProxy(moto.endpoint)
    proxy.start()
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
    conn.request("GET", "/")
    conn.getresponse().read()  # connection now idle in keep-alive
    start = time.monotonic()
    proxy.stop()
    assert time.monotonic() - start < 2
    conn.close()


def test_fault_proxy_in_front_of_fake_gcs(gcs: FakeGcsServer) -> None:
    """Resumable uploads stay on the proxy (Location is rewritten); GCS faults are JSON."""
    import gcsfs

    gcs.reset()
    gcs.create_bucket("gproxy")
    seen: list[str] = []
    with FaultProxy(gcs.endpoint, on_request=lambda m, p: seen.append(f"{m} {p}")) as proxy:
        fs = gcsfs.GCSFileSystem(endpoint_url=proxy.endpoint, token="anon",
                                 skip_instance_cache=True)  # fmt: skip
        data = os.urandom(3 * 1024 * 1024)
        with fs.open("gproxy/resumable.bin", "wb", block_size=1024 * 1024) as f:
            f.write(data)
        # Chunk PUTs/POSTs go to the session URL from Location: it must be us.
        assert any("upload_id=" in s for s in seen), seen
        assert fs.cat("gproxy/resumable.bin") == data

        proxy.set_plan(FaultPlan(error_rate=1.0, kinds=("slowdown",), max_faults=1))
        assert fs.cat("gproxy/resumable.bin") == data  # retried by gcsfs
        assert proxy.faults == {"slowdown": 1}

        proxy.set_plan(FaultPlan(permanent_status=403))
        with pytest.raises(OSError, match="Access Denied"):
            fs.cat("gproxy/resumable.bin")


def test_moto_conditional_writes_are_checked_and_applied_under_one_lock() -> None:
    """moto checks If-None-Match before it stores the object; on a busy machine two
    racing create-only writes could both pass the check. The test server runs each
    conditional request's check and write under one lock, as S3 applies them."""
    import threading

    from cloudckpt_testkit.moto_atomic import _atomic

    class Request:
        def __init__(self, headers: dict[str, str]) -> None:
            self.headers = headers

    inside, most = 0, 0
    guard = threading.Lock()

    def handler(self: Request) -> None:
        nonlocal inside, most
        with guard:
            inside += 1
            most = max(most, inside)
        time.sleep(0.05)  # the gap between moto's check and its write
        with guard:
            inside -= 1

    def race(headers: dict[str, str]) -> int:
        nonlocal most
        most = 0
        wrapped = _atomic(handler, threading.Lock())
        threads = [threading.Thread(target=wrapped, args=(Request(headers),)) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return most

    assert race({"If-None-Match": "*"}) == 1 and race({"If-Match": '"e1"'}) == 1
    assert race({}) == 4  # unconditional requests still run side by side
    with MotoServer() as server:  # and the server runs with it
        assert "cloudckpt_testkit.moto_atomic" in server._command(0)
        server.create_bucket("atomic")
        client = boto3_s3(server.endpoint)
        client.put_object(Bucket="atomic", Key="k", Body=b"1", IfNoneMatch="*")
        with pytest.raises(botocore.exceptions.ClientError, match="PreconditionFailed"):
            client.put_object(Bucket="atomic", Key="k", Body=b"2", IfNoneMatch="*")
