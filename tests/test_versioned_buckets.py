"""Deletes on a bucket that keeps versions say what stays (moto S3 with versioning
enabled, fake-gcs-server with versioning on; Azure's Blob API cannot tell, Azurite
included): ``rm`` and ``gc`` on their line, retention in one WARNING per bucket."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import torch
from cloudckpt_testkit import FaultPlan, FaultProxy
from helpers import boto3_s3, torn_save

from cloudckpt import (
    CheckpointManager,
    CheckpointWriter,
    ManagerOptions,
    StepInfo,
    list_checkpoints,
    open_store,
)
from cloudckpt.cli import main
from cloudckpt.cli.output import size
from cloudckpt.storage import versioning

STAYS = ("the bucket keeps versions (versioning enabled): their noncurrent versions stay "
         "and are billed until a lifecycle rule expires them")
DOCS = Path(__file__).parent.parent / "docs" / "storage.md"


def _bucket(backend) -> str:
    return backend.root.split("/")[2]


def _under(backend) -> str:
    """The root's prefix in its bucket, with a trailing slash."""
    return backend.root.split("/", 3)[3] + "/"


@pytest.fixture(autouse=True)
def fresh_answers():
    """Each test's bucket is new under the same name: no answer cached from another."""
    versioning.forget()
    yield
    versioning.forget()


@pytest.fixture
def versioned_s3(s3, s3_server):
    boto3_s3(s3_server.endpoint).put_bucket_versioning(
        Bucket=_bucket(s3), VersioningConfiguration={"Status": "Enabled"})
    return s3


@pytest.fixture
def versioned_gcs(gcs, gcs_server):
    status, body = gcs_server._request("PATCH", f"/storage/v1/b/{_bucket(gcs)}",
                                       json.dumps({"versioning": {"enabled": True}}).encode())
    assert status == 200 and json.loads(body)["versioning"]["enabled"], body
    return gcs


def _args(backend) -> list[str]:
    return [a for k, v in backend.options.items() if k != "retry" for a in ("-o", f"{k}={v}")]


def _checkpoint(backend, name: str, step: int) -> str:
    """A committed checkpoint of five objects; the end of the line ``rm`` prints for it."""
    with CheckpointWriter(backend.uri(name), step=step, storage_options=backend.options) as w:
        w.put_many({f"part-{i}.bin": bytes([i]) * 1000 for i in range(4)})
    stored = open_store(backend.uri(name), backend.options).list(internal=True)
    return f"(5 objects, {size(sum(o.size for o in stored))})"


def _noncurrent_s3(s3, s3_server, name: str) -> set[str]:
    prefix = _under(s3) + name + "/"
    listed = boto3_s3(s3_server.endpoint).list_object_versions(Bucket=_bucket(s3),
                                                                 Prefix=prefix)
    return {v["Key"][len(prefix):] for v in listed.get("Versions", []) if not v["IsLatest"]}


def _versions_gcs(gcs, gcs_server, name: str) -> set[str]:
    prefix = _under(gcs) + name + "/"
    status, body = gcs_server._request(
        "GET", f"/storage/v1/b/{_bucket(gcs)}/o?versions=true&prefix={prefix}")
    assert status == 200, body
    return {o["name"][len(prefix):] for o in json.loads(body).get("items") or []}


@pytest.mark.parametrize("which", ["s3", "gcs"])
def test_rm_says_the_deleted_objects_stay_as_noncurrent_versions(which, request, capsys,
                                                                 caplog):
    backend = request.getfixturevalue(f"versioned_{which}")
    deleted = _checkpoint(backend, "step-1", 1)
    capsys.readouterr()
    with caplog.at_level(logging.WARNING, logger="cloudckpt"):
        assert main([*_args(backend), "rm", backend.uri("step-1")]) == 0
    assert capsys.readouterr().out == f"deleted {backend.uri('step-1')} {deleted}; {STAYS}\n"
    assert "keeps versions" not in caplog.text  # said on the line, not again as a WARNING
    # What it says is so: every object deleted is still there as a version.
    kept = (_noncurrent_s3(backend, request.getfixturevalue("s3_server"), "step-1")
            if which == "s3" else
            _versions_gcs(backend, request.getfixturevalue("gcs_server"), "step-1"))
    assert kept >= {f"part-{i}.bin" for i in range(4)} | {"cloudckpt-manifest.json"}
    assert open_store(backend.uri("step-1"), backend.options).list() == []


def test_retention_says_it_once_per_bucket_not_at_every_save(versioned_s3, caplog):
    mgr = CheckpointManager(versioned_s3.root, ManagerOptions(every_steps=1, keep_last=1),
                            storage_options=versioned_s3.options)
    info = StepInfo()
    with caplog.at_level(logging.WARNING, logger="cloudckpt"):
        for g in range(4):
            mgr.save(info, {"w": torch.full((8,), float(g))})
            info = info.next()
        mgr.close()
    said = [r.getMessage() for r in caplog.records if "keeps versions" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith(f"deleted {versioned_s3.uri('step-0')} ")
    assert said[0].endswith(f"{STAYS} (said once per bucket)")
    kept = list_checkpoints(versioned_s3.root, versioned_s3.options)
    assert [c.name for c in kept] == ["step-3"]  # three deleted, as retention does


def test_gc_says_what_stays(versioned_gcs, capsys):
    torn_save(versioned_gcs.uri("step-9"), versioned_gcs.options, {"a.bin": b"x" * 100})
    assert main([*_args(versioned_gcs), "gc", "--grace", "0", "--yes", versioned_gcs.root]) == 0
    assert capsys.readouterr().out.rstrip().endswith(f"(2 objects); {STAYS}")


def test_an_unversioned_bucket_and_an_unanswered_question_say_nothing(s3, s3_server, capsys,
                                                                       caplog):
    first, second = _checkpoint(s3, "step-1", 1), _checkpoint(s3, "step-2", 2)
    capsys.readouterr()
    assert main([*_args(s3), "rm", s3.uri("step-1")]) == 0
    assert capsys.readouterr().out == f"deleted {s3.uri('step-1')} {first}\n"
    assert versioning.status(open_store(s3.root, s3.options)) == versioning.OFF
    # A store refusing GetBucketVersioning (no permission): unknown, and the rm stands.
    versioning.forget()
    boto3_s3(s3_server.endpoint).put_bucket_versioning(
        Bucket=_bucket(s3), VersioningConfiguration={"Status": "Enabled"})
    plan = FaultPlan(match="?versioning", permanent_status=403)
    with FaultProxy(s3_server.endpoint, plan) as proxy:
        opts = {**s3.options, "endpoint_url": proxy.endpoint}
        with caplog.at_level(logging.WARNING, logger="cloudckpt"):
            assert main([*_args(s3), "-o", f"endpoint_url={proxy.endpoint}", "rm",
                         s3.uri("step-2")]) == 0
        assert proxy.count_requests("?versioning") == 1  # asked once, refused, not retried
        assert versioning.status(open_store(s3.root, opts)) == versioning.UNKNOWN
    assert capsys.readouterr().out == f"deleted {s3.uri('step-2')} {second}\n"
    assert "versions" not in caplog.text


def test_local_disk_memory_and_azure_ask_nothing_and_say_nothing(local, memory, azure):
    assert versioning.status(open_store(local.root, local.options)) == versioning.OFF
    assert versioning.status(open_store(memory.root, memory.options)) == versioning.OFF
    # Blob versioning is an account setting the Blob API does not show.
    assert versioning.status(open_store(azure.root, azure.options)) == versioning.UNKNOWN
    assert versioning.what_stays(open_store(azure.root, azure.options)) is None


def test_the_documented_lifecycle_rules_are_what_the_services_take(s3, s3_server):
    s3_rule, gcs_rule = [json.loads(b) for b in re.findall(
        r"```json\n(.*?)```", DOCS.read_text(), flags=re.S) if "ule" in b]
    client = boto3_s3(s3_server.endpoint)
    client.put_bucket_lifecycle_configuration(Bucket=_bucket(s3),
                                              LifecycleConfiguration=s3_rule)
    [rule] = client.get_bucket_lifecycle_configuration(Bucket=_bucket(s3))["Rules"]
    assert rule["NoncurrentVersionExpiration"] == {"NoncurrentDays": 1}
    # fake-gcs-server keeps no lifecycle: the rule's shape is GCS's JSON API's.
    [g] = gcs_rule["rule"]
    assert g["action"] == {"type": "Delete"} and g["condition"]["isLive"] is False
