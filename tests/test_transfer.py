"""Copies between stores (cloudckpt.movement.checkpoint_copy): server-side within one
store, parallel ranges into local disk, streamed across stores; every route verified end
to end."""

from __future__ import annotations

import base64
import logging
import os
from typing import Any

import google_crc32c
import pytest

from cloudckpt import CheckpointWriter, open_checkpoint, open_store
from cloudckpt.core.manifest import MANIFEST_NAME
from cloudckpt.errors import CommitConflictError, CorruptCheckpointError
from cloudckpt.movement.checkpoint_copy import _copy_objects, copy_checkpoint
from cloudckpt.storage import ObjectInfo
from cloudckpt.storage.backend import Backend, Host
from cloudckpt.storage.backends.s3 import S3Backend
from cloudckpt.storage.backends.s3.copy import whole_crc32c
from cloudckpt.util.crc import Crc32c, crc32c_combine, crc32c_hex

PART = 256 * 1024  # the test moto server accepts parts this small (conftest)
#: Objects of zero, one and several parts, the last one ragged.
SIZES = {"empty.bin": 0, "tiny.bin": 10, "one-part.bin": 200_000,
         "three-parts.bin": 3 * PART + 17, "model.safetensors": 5 * PART}


def payloads(sizes: dict[str, int] = SIZES) -> dict[str, bytes]:
    return {name: os.urandom(size) for name, size in sizes.items()}


def with_parts(backend: Any) -> dict[str, Any]:
    return {**backend.options, "part_size": PART}


def write(uri: str, options: dict[str, Any], objs: dict[str, bytes]) -> Any:
    """A committed checkpoint of ``objs``; large ones streamed (multipart/composed)."""
    with CheckpointWriter(uri, step=7, metadata={"run": "t"}, storage_options=options) as w:
        for name, data in objs.items():
            if len(data) > 2 * PART:
                with w.open(name) as f:
                    for i in range(0, len(data), 100_000):
                        f.write(data[i:i + 100_000])
            else:
                w.put(name, data)
    return open_checkpoint(uri, options)


def record_reads(monkeypatch: pytest.MonkeyPatch, cls: type[Backend]) -> list[str]:
    """Every path whose bytes a backend of ``cls`` reads from now on (whole, ranged,
    streamed or versioned)."""
    reads: list[str] = []
    for name in ("get", "iter_range", "get_versioned"):
        original = getattr(cls, name)

        def wrapper(self: Backend, path: str, *args: Any, _original: Any = original) -> Any:
            reads.append(path)
            return _original(self, path, *args)

        monkeypatch.setattr(cls, name, wrapper)
    return reads


def data_reads(reads: list[str], objs: dict[str, bytes]) -> list[str]:
    return [p for p in reads if p.rsplit("/", 1)[-1] in objs]


def assert_same(ckpt: Any, src: Any, objs: dict[str, bytes]) -> None:
    assert ckpt.manifest.to_json() == src.manifest.to_json()  # same commit, same entries
    ckpt.verify(deep=True)
    assert {p: ckpt.read(p) for p in ckpt.files} == objs


def copy_parts(request: pytest.FixtureRequest) -> tuple[int, dict[str, int]]:
    """S3 part copies as small as the test server allows (moto here: ``PART``; LocalStack,
    as S3: 5 MiB), and objects of the shapes of ``SIZES`` in parts of that size."""
    part = request.getfixturevalue("s3_server").part_min_size
    request.getfixturevalue("monkeypatch").setattr(
        "cloudckpt.storage.backends.s3.copy.MIN_PART_SIZE", part)
    return part, {name: size * part // PART for name, size in SIZES.items()}


# ------------------------------------------------------------ crc32c combination


def test_crc32c_combine_matches_the_whole() -> None:
    data = os.urandom(100_003)
    for cut in (0, 1, 4096, 50_000, 99_999, 100_003):
        a, b = data[:cut], data[cut:]
        combined = crc32c_combine(google_crc32c.value(a), google_crc32c.value(b), len(b))
        assert combined == google_crc32c.value(data)
    whole = Crc32c()
    for i in range(0, len(data), 7777):
        piece = data[i:i + 7777]
        whole.append(google_crc32c.value(piece), len(piece))
    assert (whole.hexdigest(), whole.size) == (crc32c_hex(data), len(data))
    mixed = Crc32c()  # add: hashed where no CRC is given, combined where one is
    for k, i in enumerate(range(0, len(data), 7777)):
        piece = memoryview(data)[i:i + 7777]
        mixed.add(piece, google_crc32c.value(bytes(piece)) if k % 2 else None)
    assert (mixed.hexdigest(), mixed.size) == (crc32c_hex(data), len(data))


def test_a_writer_combines_the_crcs_it_is_given_with_those_it_computes() -> None:
    """Writes that come with their CRC32C (a DCP tensor's, computed once for its item
    and its file) are combined, not hashed again: the object's CRC32C is still that
    of every byte, and a wrong one given would show in it."""
    store = open_store("memory://combine")
    pieces = [os.urandom(n) for n in (10, 70_000, 3, 1 << 20, 5)]
    with store.open_write("obj") as out:
        for i, piece in enumerate(pieces):
            given = google_crc32c.value(piece) if i % 2 else None
            (out.lend if i == 3 else out.write)(piece, given)
    whole = b"".join(pieces)
    assert out.info is not None and out.info.crc32c == crc32c_hex(whole)
    assert out.info.size == len(whole) and store.get("obj") == whole
    with store.open_write("wrong") as out:
        out.write(pieces[1], google_crc32c.value(pieces[3]))
    assert out.info is not None and out.info.crc32c != crc32c_hex(pieces[1])


def test_composite_s3_checksums_become_the_whole_objects() -> None:
    data = os.urandom(3 * PART + 5)
    parts = [data[i:i + PART] for i in range(0, len(data), PART)]
    raw = [google_crc32c.value(p).to_bytes(4, "big") for p in parts]
    b64 = [base64.b64encode(r).decode() for r in raw]
    composite = base64.b64encode(google_crc32c.value(b"".join(raw)).to_bytes(4, "big")).decode()
    head = {"ChecksumCRC32C": f"{composite}-{len(parts)}", "ChecksumType": "COMPOSITE"}
    sized = [(c, len(p)) for c, p in zip(b64, parts, strict=True)]
    assert whole_crc32c(head, sized) == crc32c_hex(data)
    # Not made of these parts, or parts without checksums: unknown, never a guess.
    assert whole_crc32c(head, sized[:-1]) is None
    assert whole_crc32c(head, [(None, n) for _, n in sized]) is None
    assert whole_crc32c(head, None) is None
    full = base64.b64encode(google_crc32c.value(data).to_bytes(4, "big")).decode()
    assert whole_crc32c({"ChecksumCRC32C": full, "ChecksumType": "FULL_OBJECT"}, None) == \
        crc32c_hex(data)
    assert whole_crc32c({}, None) is None


# ------------------------------------------------------------ server-side copies


@pytest.mark.parametrize("name", ["s3", "gcs", "s3-part-copies"])
def test_copy_within_one_store_runs_on_the_server(name, request, monkeypatch) -> None:
    backend = request.getfixturevalue("s3" if name.startswith("s3") else "gcs")
    part, sizes = copy_parts(request) if name == "s3-part-copies" else (PART, SIZES)
    opts = with_parts(backend)
    objs = payloads(sizes)
    src = write(backend.uri("src"), opts, objs)
    dst = open_store(backend.uri("dst"), opts)
    calls: list[str] = []
    if name == "s3-part-copies":
        dst.backend.copy_part_threshold = part  # type: ignore[attr-defined]
        original = S3Backend.request

        def count(self: S3Backend, method: str, path: str, **kw: Any) -> Any:
            calls.append(method)
            return original(self, method, path, **kw)

        monkeypatch.setattr(S3Backend, "request", count)
    reads = record_reads(monkeypatch, type(src.store.backend))
    done: list[int] = []
    out = copy_checkpoint(src, dst, progress=done.append)
    assert data_reads(reads, objs) == []  # no object's bytes passed through this process
    assert sum(done) == src.total_size
    assert_same(out, src, objs)
    if name == "s3-part-copies":  # objects above the threshold went up in parts
        big = [n for n in sizes.values() if n > part]
        assert calls.count("copy_object") == len(sizes) - len(big)
        assert calls.count("complete_multipart_upload") == len(big)
        assert calls.count("upload_part_copy") == sum(-(-n // part) for n in big)


@pytest.mark.parametrize("reported", [None, "deadbeef"])
def test_a_copy_the_server_cannot_vouch_for_is_read_back(s3, monkeypatch, caplog, reported):
    """No whole-object CRC32C from the server (or a wrong one): each copy is read back
    and checksummed here; a good copy then passes, and a wrong server is not trusted."""
    opts = with_parts(s3)
    objs = payloads()
    src = write(s3.uri("src"), opts, objs)
    original = S3Backend.copy

    def unvouched(self: S3Backend, src_path: str, path: str, size: int,
                  host: Host) -> ObjectInfo:
        info = original(self, src_path, path, size, host)
        return ObjectInfo(info.key, info.size, reported, info.version)

    monkeypatch.setattr(S3Backend, "copy", unvouched)
    reads = record_reads(monkeypatch, S3Backend)
    with caplog.at_level(logging.DEBUG, logger="cloudckpt"):
        out = copy_checkpoint(src, s3.uri("dst"), dst_options=opts)
    copied = data_reads(reads, objs)
    read_back = {p.rsplit("/", 1)[-1] for p in copied if "/dst/" in p}
    assert read_back == {n for n, size in SIZES.items() if size}  # every non-empty copy
    assert not [p for p in copied if "/src/" in p]
    assert_same(out, src, objs)
    if reported is None:
        assert "reports no whole-object CRC32C" in caplog.text
    else:
        warned = [r for r in caplog.records if r.levelno == logging.WARNING
                  and "checksums are wrong" in r.getMessage()]
        assert len(warned) == 1


@pytest.mark.parametrize("route", ["s3-server", "s3-to-local-ranges"])
def test_copy_claims_the_destination_before_writing(route, s3, local) -> None:
    objs = payloads({"a.bin": 1000})
    src = write(s3.uri("src"), s3.options, objs)
    dst, options = ((s3.uri("dst"), s3.options) if route == "s3-server"
                    else (local.uri("dst"), local.options))
    other = CheckpointWriter(dst, storage_options=options)
    other.claim()  # another save holds the URI
    writer = CheckpointWriter(dst, storage_options=options)
    with pytest.raises(CommitConflictError, match="another save is writing"):
        _copy_objects(src, writer, src.files, None)
    assert open_store(dst, options).list() == []  # nothing written (claims are hidden)


# ------------------------------------------------------------ corrupted sources


ROUTES = {
    "s3-server": ("s3", "s3"),
    "s3-server-part-copies": ("s3", "s3"),
    "gcs-server": ("gcs", "gcs"),
    "s3-to-local-ranges": ("s3", "local"),
    "s3-to-gcs-streamed": ("s3", "gcs"),
}


@pytest.mark.parametrize("route", sorted(ROUTES))
@pytest.mark.parametrize("victim", ["one-part.bin", "model.safetensors"])
def test_a_source_corrupted_after_commit_is_refused(route, victim, request) -> None:
    """Other bytes of the same size in place of a committed object: the copy fails
    naming it, commits nothing, and leaves no copy of the bad bytes behind."""
    src_name, dst_name = ROUTES[route]
    src_backend = request.getfixturevalue(src_name)
    dst_backend = request.getfixturevalue(dst_name)
    parts = route == "s3-server-part-copies"
    part, sizes = copy_parts(request) if parts else (PART, SIZES)
    opts = with_parts(src_backend)
    objs = payloads(sizes)
    src_uri = src_backend.uri("src")
    write(src_uri, opts, objs)
    bad = bytearray(objs[victim])
    bad[len(bad) // 2] ^= 0xFF
    open_store(src_uri, opts).put(victim, bytes(bad))
    src = open_checkpoint(src_uri, opts)
    dst_uri = dst_backend.uri("dst") if dst_name != src_name else src_backend.uri("dst")
    dst = open_store(dst_uri, with_parts(dst_backend))
    if parts:
        dst.backend.copy_part_threshold = part  # type: ignore[attr-defined]
    with pytest.raises(CorruptCheckpointError, match=victim) as exc:
        copy_checkpoint(src, dst)
    assert victim in exc.value.problems
    assert not dst.exists(MANIFEST_NAME)
    assert not dst.exists(victim)
    if dst_name == "local":
        leftovers = [f for _, _, files in os.walk(dst_uri) for f in files]
        assert not [f for f in leftovers if f.startswith(".cloudckpt-tmp-")]


@pytest.mark.parametrize("route", ["s3-server", "s3-to-local-ranges"])
def test_a_source_object_deleted_after_commit_is_refused(route, s3, local) -> None:
    objs = payloads()
    src = write(s3.uri("src"), with_parts(s3), objs)
    open_store(s3.uri("src"), s3.options).delete(["three-parts.bin"])
    dst = s3.uri("dst") if route == "s3-server" else local.uri("dst")
    options = s3.options if route == "s3-server" else local.options
    with pytest.raises(CorruptCheckpointError, match="three-parts.bin"):
        copy_checkpoint(src, dst, dst_options=options)
    assert not open_store(dst, options).exists(MANIFEST_NAME)


# ------------------------------------------------------------ downloads


def test_download_writes_ranges_in_place(s3, local, monkeypatch) -> None:
    objs = payloads()
    src = write(s3.uri("src"), with_parts(s3), objs)
    reads = record_reads(monkeypatch, S3Backend)
    dest = local.uri("dl")
    done: list[int] = []
    out = copy_checkpoint(src, dest, progress=done.append)  # default options: fsync on
    assert sum(done) == src.total_size
    for name, data in objs.items():
        with open(os.path.join(dest, name), "rb") as f:
            assert f.read() == data
    assert_same(open_checkpoint(dest), src, objs)
    assert out.manifest.commit_id == src.manifest.commit_id
    # Objects of several parts came as several ranges, each one streamed request.
    ranged = data_reads(reads, objs)
    assert sum(p.endswith("/model.safetensors") for p in ranged) >= 2
    assert sorted(os.listdir(dest)) == sorted([*objs, MANIFEST_NAME])


def test_download_from_gcs_and_local_to_local(gcs, local) -> None:
    objs = payloads()
    src = write(gcs.uri("src"), with_parts(gcs), objs)
    first = copy_checkpoint(src, local.uri("a"), dst_options=local.options)
    assert_same(first, src, objs)
    second = copy_checkpoint(first, local.uri("b"), dst_options=local.options)
    assert_same(second, src, objs)


# ------------------------------------------------------------ across stores


@pytest.mark.parametrize("direction", ["s3-to-gcs", "gcs-to-s3"])
def test_copy_across_stores(direction, s3, gcs) -> None:
    src_backend, dst_backend = (s3, gcs) if direction == "s3-to-gcs" else (gcs, s3)
    objs = payloads()
    src = write(src_backend.uri("src"), with_parts(src_backend), objs)
    done: list[int] = []
    out = copy_checkpoint(src, dst_backend.uri("dst"), dst_options=with_parts(dst_backend),
                          progress=done.append)
    assert sum(done) == src.total_size
    assert_same(out, src, objs)
    assert_same(open_checkpoint(dst_backend.uri("dst"), dst_backend.options), src, objs)


def test_stores_on_one_endpoint_with_other_options_stream(s3, monkeypatch) -> None:
    """Server-side copies need the destination's credentials to read the source:
    only a store opened with the same options copies on the server."""
    objs = payloads({"a.bin": 1000})
    src = write(s3.uri("src"), s3.options, objs)
    same = open_store(s3.uri("x"), s3.options)
    other = open_store(s3.uri("y"), {**s3.options, "config_kwargs": {"connect_timeout": 5}})
    assert same.can_copy_from(src.store)
    assert not other.can_copy_from(src.store)
    reads = record_reads(monkeypatch, S3Backend)
    assert_same(copy_checkpoint(src, other), src, objs)
    assert data_reads(reads, objs)  # streamed through this process


# ------------------------------------------------------------ the engine


def test_copy_objects_copies_exactly_the_paths_given(s3, local) -> None:
    objs = payloads()
    src = write(s3.uri("src"), with_parts(s3), objs)
    names = src.files
    for dst_uri, options in ((s3.uri("dst"), s3.options), (local.uri("dst"), local.options)):
        writer = CheckpointWriter(dst_uri, step=src.step, metadata=src.metadata,
                                  storage_options=options)
        _copy_objects(src, writer, names[:2], None)
        assert set(writer.entries) == set(names[:2])
        assert {o.key for o in writer.store.list()} == {n for n in names[:2]}
        with pytest.raises(CorruptCheckpointError, match="does not list what was written"):
            writer.commit(src.manifest)
        _copy_objects(src, writer, names[2:], None)
        assert_same(writer.commit(src.manifest), src, objs)


# ------------------------------------------------------------ ranged reads


def test_a_ranged_read_resumes_where_it_broke(local, monkeypatch, caplog) -> None:
    """A reset after progress resumes at the first byte not delivered, with a fresh
    retry budget: even a policy of one attempt gets through a long range."""
    from cloudckpt.storage import RetryPolicy
    from cloudckpt.storage.backends.file import FileBackend

    data = os.urandom(1_000_000)
    store = open_store(local.root, local.options)
    store.put("big.bin", data)
    original = FileBackend.iter_range
    breaks = [3, 2]  # pieces delivered before each of two resets

    def flaky(self: FileBackend, path: str, start: int, end: int, chunk: int) -> Any:
        for i, piece in enumerate(original(self, path, start, end, chunk)):
            if breaks and i == breaks[0]:
                breaks.pop(0)
                raise ConnectionResetError("connection reset by peer")
            yield piece

    monkeypatch.setattr(FileBackend, "iter_range", flaky)
    got = bytearray(len(data))

    def sink(offset: int, piece: bytes) -> None:
        got[offset:offset + len(piece)] = piece

    one_try = store.with_retry(RetryPolicy(max_attempts=1))
    with caplog.at_level(logging.WARNING, logger="cloudckpt.storage"):
        one_try.read_range_to("big.bin", 10, len(data), sink, chunk=65_536)
    assert bytes(got[10:]) == data[10:] and not breaks
    assert caplog.text.count("resuming get_range") == 2


def test_a_ranged_read_passes_the_sinks_error_through(local) -> None:
    store = open_store(local.root, local.options)
    store.put("a.bin", b"x" * 1000)

    class Full(OSError):
        pass

    def sink(offset: int, piece: bytes) -> None:
        raise Full(28, "No space left on device")

    with pytest.raises(Full):
        store.read_range_to("a.bin", 0, 1000, sink, chunk=100)
    with pytest.raises(EOFError):
        store.read_range_to("a.bin", 0, 1001, lambda o, d: None)
    with pytest.raises(FileNotFoundError):
        store.read_range_to("missing.bin", 0, 10, lambda o, d: None)


@pytest.mark.parametrize("name", ["s3", "gcs", "local", "azure"])
def test_a_ranged_read_into_buffers_scatters_and_checksums(request, name) -> None:
    """``read_range_into`` fills the buffers in turn with the range's bytes and
    returns their CRC32C; a range past the end is an EOFError."""
    from cloudckpt.util.crc import crc32c_hex

    backend = request.getfixturevalue(name)
    data = os.urandom(3_000_000)
    store = open_store(backend.root, backend.options)
    store.put("scatter.bin", data)
    bufs = [bytearray(1_000_001), memoryview(bytearray(7)), bytearray(1_999_000)]
    crc = store.read_range_into("scatter.bin", 100, bufs)
    n = sum(len(b) for b in bufs)
    assert b"".join(bytes(b) for b in bufs) == data[100:100 + n]
    assert f"{crc:08x}" == crc32c_hex(data[100:100 + n])
    with pytest.raises(EOFError):
        store.read_range_into("scatter.bin", 10, [bytearray(len(data))])
