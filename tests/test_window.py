"""The upload window bounds the bytes streamed writes hold, over real S3 and GCS."""

from __future__ import annotations

import os
import threading

import pytest

from cloudckpt import open_store
from cloudckpt.storage.transfer.parts import PartWriter
from cloudckpt.storage.transfer.window import ByteWindow, shared_window

PART = 256 * 1024  # fake-gcs-server takes parts this small


@pytest.mark.parametrize("where", ["gcs", "s3", "azure"])
def test_parallel_writes_stay_within_the_window(where, request, monkeypatch):
    from cloudckpt.storage.backends.azure import backend as azure
    from cloudckpt.storage.backends.gcs import backend as gcs
    from cloudckpt.storage.backends.s3 import backend as s3

    cls = {"gcs": gcs._ComposeWriter, "s3": s3._MultipartWriter,
           "azure": azure._BlockWriter}[where]
    sending, most, lock = [0], [0], threading.Lock()
    real = cls._upload

    def counted(self, number, part):  # the part bytes held by requests in flight
        with lock:
            sending[0] += len(part)
            most[0] = max(most[0], sending[0])
        try:
            return real(self, number, part)
        finally:
            with lock:
                sending[0] -= len(part)

    monkeypatch.setattr(cls, "_upload", counted)
    backend = request.getfixturevalue(where)
    part = PART if where == "gcs" else 5 * 1024 * 1024  # S3's smallest part
    window = 4 * part + 1  # its own window: no other test shares it
    store = open_store(backend.root, {**backend.options, "part_size": part,
                                      "upload_window": window})
    blobs = {f"obj-{i}": os.urandom(3 * part + 1000 * i) for i in range(6)}

    def write(key: str) -> None:
        data = memoryview(blobs[key])
        with store.open_write(key) as out:
            for start in range(0, len(data), 100_000):
                out.write(data[start:start + 100_000])

    store.map(write, list(blobs))
    assert store.upload_window is shared_window(window)
    assert 0 < store.upload_window.peak <= window
    assert 0 < most[0] <= window  # 6 objects x 3+ parts would be 18 parts at once
    assert store.upload_window.used == 0  # every byte given back
    assert store.upload_window.kept <= window
    for key, data in blobs.items():
        assert store.get(key) == data


def test_sent_parts_come_back_to_the_window_for_reuse(s3):
    """A part's mapping serves again once its request succeeded (a fresh mapping costs
    a page fault per page); kept mappings never exceed what the window leaves free."""
    part = 5 * 1024 * 1024
    window = 4 * part + 3  # a window of its own
    store = open_store(s3.root, {**s3.options, "part_size": part, "upload_window": window})
    data = os.urandom(3 * part)
    with store.open_write("parts") as out:
        out.write(data)  # three whole parts, each sent from a window mapping
    assert store.get("parts") == data
    assert part <= store.upload_window.kept <= window - store.upload_window.used


def test_writers_in_a_full_window_take_over_each_others_mappings(gcs, monkeypatch):
    """Single-request writes side by side, as many as the window holds: each takes
    the mapping of one that finished (writing into a fresh one costs a page fault per
    page, and was most of a save's CPU), rather than evicting it and mapping anew."""
    store = open_store(gcs.root, {**gcs.options, "part_size": PART,
                                  "upload_window": 4 * PART + 5})  # 2 writers at once
    fresh, real = [0], ByteWindow.mapping

    def counted(self, size):
        fresh[0] += not self._kept.get(size)
        return real(self, size)

    monkeypatch.setattr(ByteWindow, "mapping", counted)
    # Each over SMALL_COPIES: one of it or less is kept as a heap copy, not in a
    # mapping, so the writer it lets in would find none kept and map one.
    blobs = {f"obj-{i:02d}": os.urandom(PART + 1000 * (i + 1)) for i in range(12)}
    assert min(map(len, blobs.values())) > PartWriter.SMALL_COPIES

    def write(key: str) -> None:
        with store.open_write(key) as out:
            out.write(blobs[key])

    store.map(write, list(blobs))
    assert store.get_many(list(blobs)) == blobs
    assert fresh[0] <= 2  # one per writer the window lets run at once
    assert store.upload_window.used == 0
    assert store.upload_window.kept <= store.upload_window.capacity


def test_one_thread_with_two_open_writers_does_not_wait_for_itself(gcs):
    """A thread filling two objects at once (each holding window bytes) goes on: only
    it could free what the window waits for."""
    store = open_store(gcs.root, {**gcs.options, "part_size": PART,
                                  "upload_window": 2 * PART + 7})
    a, b = os.urandom(5 * PART), os.urandom(5 * PART)
    done = threading.Event()

    def both() -> None:
        with store.open_write("a") as wa, store.open_write("b") as wb:
            for i in range(0, 5 * PART, PART // 2):
                wa.write(a[i:i + PART // 2])
                wb.write(b[i:i + PART // 2])
        done.set()

    t = threading.Thread(target=both, daemon=True)
    t.start()
    t.join(120)
    assert done.is_set(), "a thread waited for window bytes only it could release"
    assert store.get("a") == a and store.get("b") == b
    assert store.upload_window.used == 0


def test_an_aborted_write_gives_its_bytes_back(gcs):
    store = open_store(gcs.root, {**gcs.options, "part_size": PART,
                                  "upload_window": 3 * PART + 11})
    with pytest.raises(RuntimeError), store.open_write("torn") as out:
        out.write(os.urandom(4 * PART))
        raise RuntimeError("the caller fails mid-write")
    assert store.upload_window.used == 0
    assert not store.exists("torn")


def test_window_waits_and_lets_an_oversized_request_run_alone():
    w = ByteWindow(10)
    assert w.acquire(6) == 6
    got: list[int] = []
    t = threading.Thread(target=lambda: got.append(w.acquire(8)))
    t.start()
    t.join(0.2)
    assert t.is_alive() and not got  # 6 + 8 > 10: waits
    w.release(6)
    t.join(5)
    assert got == [8] and w.used == 8
    w.release(8)
    assert w.acquire(50) == 50 and w.used == 50  # larger than the window: alone


def test_part_body_reads_its_segments_as_one_file():
    """The request body over several buffers: what botocore and aiohttp read of it is
    the concatenation, from any position, again after a seek (a retried request)."""
    import io

    from cloudckpt.storage.transfer.bodies import PartBody

    segments = [b"head-", memoryview(bytearray(b"0123456789")), b"", b"-tail"]
    whole = b"head-0123456789-tail"
    body = PartBody(*segments)
    assert len(body) == len(whole)
    with body.getbuffer() as buf:
        assert len(buf) == len(whole)
    assert body.read(3) == whole[:3] and body.tell() == 3
    assert body.read(9) == whole[3:12]
    out = bytearray(6)
    assert body.readinto(out) == 6 and bytes(out) == whole[12:18]
    assert body.read() == whole[18:] and body.read(4) == b""
    assert body.seek(0) == 0 and body.read() == whole
    assert body.seek(-5, io.SEEK_END) == len(whole) - 5 and body.read() == b"-tail"
    # a read within one segment is a read-only view of it: aiohttp reads a 16 MiB
    # body 64 KiB at a time, and copying each piece cost a tenth of a save's CPU
    big = bytearray(range(256)) * 1024
    body = PartBody(big)
    piece = body.read(65536)
    assert isinstance(piece, memoryview) and piece.readonly and piece == big[:65536]
    assert piece.obj is big


@pytest.mark.parametrize("where", ["gcs", "s3", "azure"])
def test_lent_bytes_go_up_as_they_are(where, request, monkeypatch):
    """Bytes lent to a writer (a tensor's own memory) are sent from the caller's buffer
    while the object fits one request: no part mapping is filled, the window counts
    them while they are in flight, and the object is the writes in order."""
    backend = request.getfixturevalue(where)
    part = PART if where == "gcs" else 5 * 1024 * 1024
    store = open_store(backend.root, {**backend.options, "part_size": part,
                                      "upload_window": 8 * part + 13})
    mapped = [0]
    real = ByteWindow.mapping
    monkeypatch.setattr(ByteWindow, "mapping",
                        lambda self, size: mapped.__setitem__(0, mapped[0] + 1) or real(self, size))
    big, other = bytearray(os.urandom(part)), bytearray(os.urandom(part // 2))
    with store.open_write("lent") as out:
        out.write(b"header")
        out.lend(big)
        assert store.upload_window.used > 0  # in flight: counted, though not a copy
        out.write(b"between")
        out.lend(memoryview(other))
        out.write(b"tail")
    assert store.get("lent") == b"header" + big + b"between" + other + b"tail"
    assert out.info is not None and out.info.size == len(big) + len(other) + 17
    assert mapped[0] == 0, "lent bytes were copied into a part mapping"
    assert store.upload_window.used == 0


@pytest.mark.parametrize("where", ["gcs", "s3"])
def test_lent_bytes_that_outgrow_one_request_are_streamed_in_parts(where, request):
    backend = request.getfixturevalue(where)
    part = PART if where == "gcs" else 5 * 1024 * 1024
    store = open_store(backend.root, {**backend.options, "part_size": part,
                                      "upload_window": 6 * part + 17})
    pieces = [os.urandom(part // 2 + i) for i in range(6)]  # three parts in all
    with store.open_write("grown") as out:
        for i, piece in enumerate(pieces):
            out.write(b"%d" % i)
            out.lend(piece)
    assert store.get("grown") == b"".join(b"%d" % i + p for i, p in enumerate(pieces))
    assert store.upload_window.used == 0


@pytest.mark.parametrize("where", ["gcs", "s3", "azure"])
def test_whole_parts_of_lent_bytes_are_sent_from_them(where, request, monkeypatch):
    """Lent bytes several parts long (a large tensor): every part that lies within
    them goes up as a view of them, not copied into a mapping of the window, and so
    does their share of the part begun before them (sent as the bytes buffered
    before, copied, then a view of the lent ones); only what is left after the last
    whole part is copied."""
    import numpy as np

    from cloudckpt.storage.transfer import parts
    from cloudckpt.storage.transfer.bodies import segments_of

    backend = request.getfixturevalue(where)
    part = PART if where == "gcs" else 5 * 1024 * 1024
    store = open_store(backend.root, {**backend.options, "part_size": part,
                                      "upload_window": 4 * part + 7})
    big = bytearray(os.urandom(4 * part + 1000))
    start = np.frombuffer(big, np.uint8).ctypes.data
    copied, views = [], []
    real_copy, real_send = parts.part_copy, parts.PartWriter._send

    def send(self, data):
        for segment in segments_of(data):
            at = np.frombuffer(segment, np.uint8).ctypes.data - start
            if 0 <= at < len(big):
                views.append((at, len(segment)))
        return real_send(self, data)

    monkeypatch.setattr(parts, "part_copy",
                        lambda data, *a: copied.append(len(data)) or real_copy(data, *a))
    monkeypatch.setattr(parts.PartWriter, "_send", send)
    with store.open_write("lent-parts") as out:
        out.write(b"header")
        out.lend(big)
        out.write(b"tail")
    assert store.get("lent-parts") == b"header" + big + b"tail"
    # Part 1: the header (copied) and a view of the first bytes lent; 2-4: views;
    # 5: the rest, copied.
    assert views == [(0, part - 6)] + [(part - 6 + k * part, part) for k in range(3)]
    assert copied == [6, 1006 + 4]
    assert store.upload_window.used == 0
    # The header's copy went up in a part-sized mapping, which the window keeps to
    # hand out again (one of its own size would be mapped afresh every time).
    assert part in store.upload_window._kept


def test_an_aborted_lending_write_gives_its_bytes_back(s3):
    store = open_store(s3.root, {**s3.options, "upload_window": 3 * 5 * 1024 * 1024 + 19})
    with pytest.raises(RuntimeError), store.open_write("torn") as out:
        out.lend(os.urandom(1024 * 1024))
        raise RuntimeError("the caller fails mid-write")
    assert store.upload_window.used == 0
    assert not store.exists("torn")


def test_part_body_sends_large_pieces_as_views_and_joins_small_ones():
    """A body of headers between tensors: each tensor's bytes go out as views of the
    tensor (a read stops short at its end rather than copy across), small pieces
    between them in one read; read on until empty, the bytes are the pieces in order."""
    from cloudckpt.storage.transfer.bodies import PartBody, Pieces

    tensors = [bytearray(os.urandom(300_000)), bytearray(os.urandom(100_000))]
    pieces = [b"zip-head", tensors[0], b"dir", b"pickle", tensors[1], b"end"]
    body = PartBody(b"multipart-head", Pieces([memoryview(p) for p in pieces]))
    reads = []
    while chunk := body.read(256 * 1024):
        reads.append(chunk)
    assert b"".join(reads) == b"multipart-head" + b"".join(pieces)
    from_tensors = [r for r in reads if isinstance(r, memoryview)]
    assert {id(r.obj) for r in from_tensors} == {id(t) for t in tensors}
    assert sum(len(r) for r in from_tensors) == sum(len(t) for t in tensors)
    assert reads[0] == b"multipart-headzip-head" and reads[-1] == b"end"


def test_bytes_and_their_mapping_come_back_in_one_step():
    """A writer let in by bytes given back finds their mapping kept for it: kept
    after the bytes, it could map afresh in between (a page fault per page); kept
    before, it would not fit beside the bytes still counted, and be unmapped."""
    import mmap

    w = ByteWindow(10)
    w.acquire(10)
    mine = mmap.mmap(-1, 10)
    got: list[mmap.mmap] = []
    t = threading.Thread(target=lambda: (w.acquire(10), got.append(w.mapping(10))))
    t.start()
    t.join(0.2)
    assert t.is_alive() and not got  # the window is full: it waits
    w.release(10, keep=mine)
    t.join(5)
    assert got and got[0] is mine
    assert w.used == 10 and w.kept == 0
