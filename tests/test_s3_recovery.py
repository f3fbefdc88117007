"""Recovery from what S3 answers and moto alone never shows: a completion applied whose
answer was lost (then ``NoSuchUpload``), ``409 ConditionalRequestConflict`` to a
conditional write, a body damaged on the way (``400 BadDigest``).

Each runs on every server of ``--s3-servers`` (moto, LocalStack) with a fault proxy in
front; where a server does not give AWS's answer itself, the proxy gives it (a scripted
answer).
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace

import pytest
from cloudckpt_testkit import FaultPlan, FaultProxy, MotoServer
from helpers import boto3_s3

from cloudckpt import (
    MANIFEST_NAME,
    CheckpointWriter,
    CommitConflictError,
    open_checkpoint,
    open_store,
)
from cloudckpt.util.crc import crc32c_b64, crc32c_hex

MIB = 1024 * 1024
#: S3's smallest part (LocalStack enforces it, as S3 does).
PART = 5 * MIB


@pytest.fixture
def proxied(s3, s3_server):
    """The test's bucket through a fault proxy, with 5 MiB parts."""
    with FaultProxy(s3_server.endpoint) as proxy:
        yield replace(s3, options={**s3.options, "endpoint_url": proxy.endpoint,
                                   "part_size": PART}), proxy


def _probe_first(via) -> None:
    """The bucket's conditional-write probe, fault-free (once per bucket and process),
    so a plan's script falls on the save's own requests."""
    open_store(via.uri("probe-first"), via.options).put_if_absent("k", b"k")


def test_a_completion_applied_whose_answer_was_lost_is_ours(proxied, s3, s3_server, caplog):
    """CompleteMultipartUpload is applied, its answer lost; the retry finds the upload
    gone (NoSuchUpload: LocalStack says it, as AWS may; moto repeats its success, so
    the proxy answers for it). The object there is recognised as ours by its ETag:
    nothing is sent again, the checkpoint commits and reads back bit-exact."""
    via, proxy = proxied
    _probe_first(via)
    data = os.urandom(2 * PART + MIB)  # parts of 5, 5 and 1 MiB
    lost = ("lose_response", (404, "NoSuchUpload")) if isinstance(s3_server, MotoServer) \
        else ("lose_response",)
    proxy.reset_counters()
    proxy.set_plan(FaultPlan(match="uploadId=", methods=("POST",), script=lost))
    with caplog.at_level(logging.INFO, logger="cloudckpt"):
        with CheckpointWriter(via.uri("step-1"), step=1, storage_options=via.options) as w:
            with w.open("model.bin") as out:
                out.write(data)
    assert proxy.count_requests("?uploads", method="POST") == 1
    assert proxy.count_requests("uploadId=", method="PUT") == 3  # no part sent twice
    assert proxy.count_requests("uploadId=", method="POST") == 2  # completed, then asked again
    assert proxy.faults.get("lose_response") == 1
    assert any("its answer was lost" in m for m in caplog.messages)
    ckpt = open_checkpoint(s3.uri("step-1"), s3.options)  # straight from the server
    ckpt.verify(deep=True)
    assert ckpt.read("model.bin") == data


@pytest.mark.parametrize("write", ["create-only commit", "compare-and-swap"])
def test_a_conditional_write_answered_409_is_retried_not_lost(proxied, s3, write):
    """AWS answers 409 ConditionalRequestConflict to a conditional write racing another
    operation on the key, and says to retry: nothing was written, nobody won. The
    write is retried under the store's policy and succeeds; no CommitConflictError."""
    via, proxy = proxied
    _probe_first(via)
    conflict = (409, "ConditionalRequestConflict")
    if write == "create-only commit":
        proxy.set_plan(FaultPlan(methods=("PUT",), match=MANIFEST_NAME, script=(conflict,)))
        with CheckpointWriter(via.uri("step-1"), step=1, storage_options=via.options) as w:
            w.put("a.bin", b"weights")
        assert proxy.count_requests(MANIFEST_NAME, method="PUT", header="if-none-match") == 2
        ckpt = open_checkpoint(s3.uri("step-1"), s3.options)
        ckpt.verify(deep=True)
        assert ckpt.read("a.bin") == b"weights"
    else:
        store = open_store(via.uri("slot"), via.options)
        first = store.put_if_absent("pointer", b"generation 1")
        proxy.set_plan(FaultPlan(methods=("PUT",), match="pointer", script=(conflict,)))
        store.put_if_match("pointer", b"generation 2", first.version)
        assert proxy.count_requests("pointer", method="PUT", header="if-match") == 2
        assert open_store(s3.uri("slot"), s3.options).get("pointer") == b"generation 2"
    assert proxy.faults == {"ConditionalRequestConflict": 1}


def test_a_commit_applied_whose_answer_was_lost_is_ours(proxied, s3, caplog):
    """The manifest's create-only PUT is applied on a pooled connection and its answer
    lost: the retry is refused (412, the key exists), and the manifest there is
    recognised as ours by its bytes; the checkpoint is committed, not reported lost."""
    via, proxy = proxied
    _probe_first(via)
    proxy.set_plan(FaultPlan(methods=("PUT",), match=MANIFEST_NAME, reused_only=True,
                             script=("lose_response",)))
    with caplog.at_level(logging.INFO, logger="cloudckpt"):
        with CheckpointWriter(via.uri("step-1"), step=1, storage_options=via.options) as w:
            w.put("a.bin", b"weights")
    assert proxy.faults == {"lose_response": 1}
    assert proxy.count_requests(MANIFEST_NAME, method="PUT", header="if-none-match") == 2
    assert any("holds our bytes already" in m for m in caplog.messages)
    ckpt = open_checkpoint(s3.uri("step-1"), s3.options)
    ckpt.verify(deep=True)
    assert ckpt.read("a.bin") == b"weights"


def test_a_412_is_still_a_lost_race(proxied):
    """What 409 is not: a create-only write of a key that exists fails at once as a
    conflict, with no retry."""
    via, proxy = proxied
    store = open_store(via.uri("slot"), via.options)
    store.put_if_absent("pointer", b"theirs")
    proxy.reset_counters()
    with pytest.raises(CommitConflictError, match="Another writer got there first"):
        store.put_if_absent("pointer", b"ours")
    assert proxy.count_requests("pointer", method="PUT") == 1


def test_a_body_damaged_on_the_way_is_refused_and_sent_again(proxied, s3):
    """One byte of a PUT flipped in flight: the server checks the CRC32C we sent and
    refuses it (400 BadDigest), nothing is stored, and the PUT goes again with its
    checksum; what is committed is bit-exact."""
    via, proxy = proxied
    _probe_first(via)
    data = os.urandom(256 * 1024)
    proxy.set_plan(FaultPlan(methods=("PUT",), match="weights.bin", script=("corrupt_upload",)))
    with CheckpointWriter(via.uri("step-1"), step=1, storage_options=via.options) as w:
        w.put("weights.bin", data)
    assert proxy.faults.get("corrupt_upload") == 1
    puts = [r for r in proxy.request_log if r.method == "PUT" and "weights.bin" in r.target]
    assert len(puts) == 2
    assert all(r.headers.get("x-amz-checksum-crc32c") == crc32c_b64(crc32c_hex(data))
               for r in puts)
    ckpt = open_checkpoint(s3.uri("step-1"), s3.options)
    ckpt.verify(deep=True)
    assert ckpt.read("weights.bin") == data


def test_a_part_damaged_on_the_way_is_refused_and_sent_again(proxied, s3):
    """The same for a part of a multipart upload, which carries botocore's CRC32."""
    via, proxy = proxied
    _probe_first(via)
    data = os.urandom(2 * PART + MIB)
    proxy.set_plan(FaultPlan(methods=("PUT",), match="uploadId=", script=("corrupt_upload",)))
    with CheckpointWriter(via.uri("step-1"), step=1, storage_options=via.options) as w:
        with w.open("model.bin") as out:
            out.write(data)
    assert proxy.faults.get("corrupt_upload") == 1
    assert proxy.count_requests("uploadId=", method="PUT") == 4  # 3 parts, one twice
    ckpt = open_checkpoint(s3.uri("step-1"), s3.options)
    ckpt.verify(deep=True)
    assert ckpt.read("model.bin") == data


@pytest.mark.parametrize("header", ["ChecksumCRC32C", "ChecksumCRC32"])
def test_the_servers_refuse_a_body_its_checksum_does_not_match(s3, s3_server, header):
    """What the tests above rest on, on both servers (moto as moto_atomic wraps it):
    a PutObject or UploadPart whose checksum header disagrees with its body is
    refused with 400 BadDigest and nothing is stored."""
    import botocore.exceptions

    client = boto3_s3(s3_server.endpoint, total_max_attempts=1)
    bucket = s3.root.split("/")[2]
    wrong = {header: crc32c_b64(crc32c_hex(b"other bytes"))}
    with pytest.raises(botocore.exceptions.ClientError) as put:
        client.put_object(Bucket=bucket, Key="crc/put.bin", Body=b"some bytes", **wrong)
    upload = client.create_multipart_upload(Bucket=bucket, Key="crc/part.bin")["UploadId"]
    with pytest.raises(botocore.exceptions.ClientError) as part:
        client.upload_part(Bucket=bucket, Key="crc/part.bin", UploadId=upload, PartNumber=1,
                           Body=b"some bytes", **wrong)
    for refused in (put, part):
        error = refused.value.response
        assert (error["ResponseMetadata"]["HTTPStatusCode"], error["Error"]["Code"]) == (
            400, "BadDigest")
    assert "Contents" not in client.list_objects_v2(Bucket=bucket, Prefix="crc/")
    assert not client.list_parts(Bucket=bucket, Key="crc/part.bin",
                                 UploadId=upload).get("Parts")
    client.abort_multipart_upload(Bucket=bucket, Key="crc/part.bin", UploadId=upload)


def _client_error(operation: str, status: int, code: str) -> Exception:
    import botocore.exceptions

    return botocore.exceptions.ClientError(
        {"Error": {"Code": code, "Message": "..."},
         "ResponseMetadata": {"HTTPStatusCode": status}}, operation)


@pytest.mark.parametrize(("operation", "status", "code", "retried"), [
    ("PutObject", 409, "ConditionalRequestConflict", True),
    ("PutObject", 400, "BadDigest", True),
    ("UploadPart", 400, "BadDigest", True),
    ("PutObject", 400, "XAmzContentSHA256Mismatch", True),
    # A part list disagreeing with the parts: sending it again changes nothing.
    ("CompleteMultipartUpload", 400, "BadDigest", False),
    ("PutObject", 412, "PreconditionFailed", False),
    ("PutObject", 409, "FileAlreadyExists", False),
    ("PutObject", 400, "InvalidArgument", False),
])
def test_which_s3_answers_are_retried(operation, status, code, retried):
    from cloudckpt.storage import is_transient
    from cloudckpt.storage.backends.s3 import errors

    assert is_transient(_client_error(operation, status, code), errors) is retried
