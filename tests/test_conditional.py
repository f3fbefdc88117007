"""Stores that ignore or refuse conditional writes are detected, not trusted (issue 15).

moto (and fake-gcs-server) behind the fault proxy, which strips the conditional
headers (a store that ignores them), answers 501 to them (as Alibaba OSS does), or
400 to the CRC32C header (as some S3-compatible stores do).
"""

from __future__ import annotations

import logging
import threading

import pytest
import torch
from cloudckpt_testkit import FaultPlan, FaultProxy

import cloudckpt.dcp as cdcp
from cloudckpt import open_checkpoint, open_store
from cloudckpt.errors import CommitConflictError, ConfigError, CorruptCheckpointError
from cloudckpt.storage import conditional

CONDITIONAL = ("If-None-Match", "If-Match")


@pytest.fixture(autouse=True)
def fresh_probes():
    conditional.forget()
    yield
    conditional.forget()


@pytest.fixture
def proxy(s3_server):
    with FaultProxy(s3_server.endpoint) as p:
        yield p


def through(s3, proxy, **extra) -> dict:
    return {**s3.options, "endpoint_url": proxy.endpoint, **extra}


def errors_about(caplog, bucket: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("cloudckpt.storage.")
            and r.levelno == logging.ERROR and bucket in r.getMessage()]


def save_twice(uri: str, opts: dict, caplog) -> None:
    """A save that commits (verified), then a second save of the URI that must lose."""
    with caplog.at_level(logging.ERROR, logger="cloudckpt.storage"):
        ckpt = cdcp.save({"w": torch.arange(10.0)}, uri, storage_options=opts)
        with pytest.raises(CommitConflictError):
            cdcp.save({"w": torch.zeros(10)}, uri, storage_options=opts)
    assert ckpt is not None
    ckpt.verify(deep=True)


def test_a_conditional_store_passes_the_probe_in_a_few_requests_once(s3, proxy):
    opts = through(s3, proxy)
    store = open_store(s3.uri("a"), opts)
    store.put_if_absent("k", b"1")
    probes = proxy.count_requests("probe-")
    assert 1 <= probes <= 5
    open_store(s3.uri("b"), opts).put_if_absent("k", b"1")  # same bucket: no new probe
    assert proxy.count_requests("probe-") == probes
    with pytest.raises(CommitConflictError):
        store.put_if_absent("k", b"2")
    assert not [o for o in store.list(internal=True) if "probe" in o.key]  # probe deleted


def test_a_store_ignoring_the_headers_is_detected_and_emulated(s3, proxy, caplog):
    proxy.set_plan(FaultPlan(strip_headers=CONDITIONAL))
    opts = through(s3, proxy)
    with caplog.at_level(logging.ERROR, logger="cloudckpt.storage"):
        store = open_store(s3.uri("ign"), opts)
        info = store.put_if_absent("k", b"first")
        with pytest.raises(CommitConflictError):
            store.put_if_absent("k", b"second")  # the server would have let it overwrite
        with pytest.raises(CommitConflictError):
            store.put_if_match("k", b"third", "stale-version")
        store.put_if_match("k", b"fourth", info.version)  # the right version wins
        open_store(s3.uri("other"), opts).put_if_absent("k", b"x")
    assert store.get("k") == b"fourth"
    bucket = store.bucket_uri()
    assert len(errors_about(caplog, bucket)) == 1  # one ERROR per bucket and process
    assert "ignores conditional writes" in errors_about(caplog, bucket)[0]


def test_racing_commits_on_an_ignoring_store_never_both_succeed(s3, proxy):
    proxy.set_plan(FaultPlan(strip_headers=CONDITIONAL))
    opts = through(s3, proxy)
    uri = s3.uri("race")
    outcomes: dict[int, object] = {}
    start = threading.Barrier(2)

    def save(i: int) -> None:
        state = {"w": torch.full((64, 64), float(i)), "step": i}
        start.wait()
        try:
            outcomes[i] = cdcp.save(state, uri, storage_options=opts)
        except CommitConflictError as exc:
            outcomes[i] = exc

    threads = [threading.Thread(target=save, args=(i,)) for i in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    won = [i for i, o in outcomes.items() if not isinstance(o, BaseException)]
    assert len(outcomes) == 2 and len(won) <= 1
    if won:  # (both may lose: a write slower than the bound is never called a win)
        try:  # whatever stands verifies, or verify names the damaged object
            open_checkpoint(uri, s3.options).verify(deep=True)
        except CorruptCheckpointError as exc:
            assert ".distcp" in str(exc)
        got = {"w": torch.zeros(64, 64), "step": 0}
        cdcp.load(got, uri, storage_options=s3.options)
        assert torch.equal(got["w"], torch.full((64, 64), float(won[0])))


def test_require_refuses_an_ignoring_store_before_writing(s3, proxy):
    proxy.set_plan(FaultPlan(strip_headers=CONDITIONAL))
    opts = through(s3, proxy, conditional_writes="require")
    uri = s3.uri("req")
    with pytest.raises(ConfigError, match=r"s3://.*ignores conditional writes.*require"):
        cdcp.save({"w": torch.ones(8)}, uri, storage_options=opts)
    assert open_store(uri, s3.options).list(internal=True) == []


def test_assume_sends_no_probe(s3, proxy):
    proxy.set_plan(FaultPlan(strip_headers=CONDITIONAL))
    store = open_store(s3.uri("trust"), through(s3, proxy, conditional_writes="assume"))
    store.put_if_absent("k", b"1")
    store.put_if_absent("k", b"2")  # trusted: the stripped header lets it overwrite
    assert proxy.count_requests("probe-") == 0
    assert store.get("k") == b"2"
    with pytest.raises(ConfigError, match="conditional_writes"):
        open_store(s3.uri("x"), {**s3.options, "conditional_writes": "sometimes"})


def test_a_store_answering_501_to_the_headers_still_commits(s3, proxy, caplog):
    proxy.set_plan(FaultPlan(refuse_headers=CONDITIONAL, refuse_status=501))
    opts = through(s3, proxy)
    uri = s3.uri("oss")
    save_twice(uri, opts, caplog)
    assert len(errors_about(caplog, "s3://")) == 1
    assert "refuses conditional writes" in errors_about(caplog, "s3://")[0]
    got = {"w": torch.zeros(10)}
    cdcp.load(got, uri, storage_options=opts)
    assert torch.equal(got["w"], torch.arange(10.0))


def test_a_store_with_its_own_create_only_header(s3, proxy, caplog):
    """As Alibaba OSS: 501 to If-None-Match/If-Match, create-only through its own
    header (the proxy turns it into If-None-Match for moto, which then enforces it)."""
    proxy.set_plan(FaultPlan(refuse_headers=CONDITIONAL, refuse_status=501, rewrite_headers=(
        ("x-oss-forbid-overwrite", "If-None-Match", "*"),)))
    opts = through(s3, proxy, create_only_header="x-oss-forbid-overwrite: true")
    with caplog.at_level(logging.ERROR, logger="cloudckpt.storage"):
        store = open_store(s3.uri("oss"), opts)
        info = store.put_if_absent("k", b"1")
        with pytest.raises(CommitConflictError):
            store.put_if_absent("k", b"2")  # refused by the server, through its header
        store.put_if_match("k", b"3", info.version)  # compare-and-swap: emulated
        with pytest.raises(CommitConflictError):
            store.put_if_match("k", b"4", info.version)
    assert store.get("k") == b"3"
    assert proxy.count_requests(header="x-oss-forbid-overwrite") >= 3  # probe and puts
    assert proxy.count_requests(header="if-none-match") == 0
    [error] = errors_about(caplog, "s3://")
    assert "enforces create-only writes but not compare-and-swap" in error
    with pytest.raises(ConfigError, match="create_only_header"):
        open_store(s3.uri("x"), {**s3.options, "create_only_header": "no colon"})


def test_a_store_refusing_the_checksum_header_keeps_crc32c_in_the_manifest(
        s3, proxy, caplog):
    proxy.set_plan(FaultPlan(refuse_headers=("x-amz-checksum-crc32c",), refuse_status=400))
    opts = through(s3, proxy)
    uri = s3.uri("nocrc")
    with caplog.at_level(logging.WARNING, logger="cloudckpt.storage"):
        cdcp.save({"w": torch.arange(100.0)}, uri, storage_options=opts)
        cdcp.save({"w": torch.arange(100.0)}, s3.uri("nocrc2"), storage_options=opts)
    warned = [r for r in caplog.records if "x-amz-checksum-crc32c" in r.getMessage()]
    assert len(warned) == 1
    assert proxy.count_requests(header="x-amz-checksum-crc32c") >= 1  # it was tried once
    ckpt = open_checkpoint(uri, opts)
    ckpt.verify(deep=True)
    # The manifest's CRC32C still guards reads: a flipped byte is caught.
    name = next(f for f in ckpt.files if f.endswith(".distcp"))
    store = open_store(uri, s3.options)
    data = bytearray(store.get(name))
    data[len(data) // 2] ^= 0xFF
    store.put(name, bytes(data))
    with pytest.raises(CorruptCheckpointError, match="corrupt"):
        cdcp.load({"w": torch.zeros(100)}, uri, storage_options=opts)


def test_gcs_store_ignoring_if_generation_match_is_detected(gcs, gcs_server, caplog):
    with FaultProxy(gcs_server.endpoint) as proxy:
        proxy.set_plan(FaultPlan(strip_query=("ifGenerationMatch",)))
        opts = {**gcs.options, "endpoint_url": proxy.endpoint}
        with caplog.at_level(logging.ERROR, logger="cloudckpt.storage"):
            store = open_store(gcs.uri("ign"), opts)
            store.put_if_absent("k", b"1")
            with pytest.raises(CommitConflictError):
                store.put_if_absent("k", b"2")
        assert store.get("k") == b"1"
        assert len(errors_about(caplog, "gs://")) == 1


def test_gcs_store_refusing_if_generation_match_still_commits(gcs, gcs_server, caplog):
    with FaultProxy(gcs_server.endpoint) as proxy:
        proxy.set_plan(FaultPlan(refuse_query=("ifGenerationMatch",), refuse_status=501))
        opts = {**gcs.options, "endpoint_url": proxy.endpoint}
        save_twice(gcs.uri("refusing"), opts, caplog)
        [error] = errors_about(caplog, "gs://")
        assert "refuses conditional writes" in error
        assert proxy.count_requests("ifGenerationMatch") >= 1  # tried once, at the probe
