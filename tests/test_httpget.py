"""The lean HTTP client of ranged GETs (cloudckpt/storage/transfer/httpget.py): over moto and
fake-gcs-server through the S3 and GCS backends, and against a small HTTP server on
loopback for what they never do (a kept connection closed under it, a stall, a
chunked answer)."""

from __future__ import annotations

import asyncio
import os
import ssl
from collections.abc import Awaitable, Callable

import pytest

from cloudckpt import open_store
from cloudckpt.storage.transfer import httpget
from cloudckpt.storage.transfer.httpget import Unanswered, get_range


@pytest.mark.parametrize("where", ["s3", "gcs", "azure"])
def test_ranged_reads_take_the_lean_client(where, request, monkeypatch):
    """read_range_into on S3 (presigned GETs), GCS (media GETs with gcsfs's headers)
    and Azure (a read-only SAS from the account key) goes through the lean client,
    bit-exact; ``direct_gets=False`` keeps the full client; an error status is asked
    again through the full client, which says what it was."""
    backend = request.getfixturevalue(where)
    used: list[tuple[int, int]] = []
    real = httpget.get_range

    async def counted(url, start, end, give, **kw):
        used.append((start, end))
        return await real(url, start, end, give, **kw)

    monkeypatch.setattr("cloudckpt.storage.transfer.ranges.get_range", counted)
    data = os.urandom(3 * httpget.PIECE + 12345)
    store = open_store(backend.root, backend.options)
    store.put("obj.bin", data)
    outs = [bytearray(1000), bytearray(len(data) - 1000 - 7)]
    store.read_range_into("obj.bin", 7, outs)
    assert bytes(outs[0]) + bytes(outs[1]) == data[7:]
    assert used == [(7, len(data))]

    plain = open_store(backend.root, {**backend.options, "direct_gets": False})
    out = bytearray(100)
    plain.read_range_into("obj.bin", 5, [out])
    assert bytes(out) == data[5:105] and len(used) == 1

    with pytest.raises(FileNotFoundError):
        store.read_range_into("missing.bin", 0, [bytearray(10)])
    assert len(used) == 2  # tried on the lean client, answered 404: the full one said so
    with pytest.raises(EOFError):
        store.read_range_into("obj.bin", len(data) + 10, [bytearray(10)])


@pytest.mark.parametrize("where", ["s3", "gcs", "azure"])
def test_a_bad_direct_gets_option_is_refused(where, request):
    from cloudckpt.errors import ConfigError

    backend = request.getfixturevalue(where)
    with pytest.raises(ConfigError, match="direct_gets"):
        open_store(backend.root, {**backend.options, "direct_gets": "yes"})


class _Landing:
    """A sink that offers its own memory for the bytes from ``skip`` on, and counts the
    bytes it was handed there (received in place) and elsewhere (copied in)."""

    def __init__(self, n: int, skip: int = 0) -> None:
        self.dest = bytearray(n)
        self.view = memoryview(self.dest)
        self.skip = skip
        self.in_place = self.copied = 0

    def space(self, offset: int, n: int) -> memoryview | None:
        return None if offset < self.skip else self.view[offset:offset + n]

    def __call__(self, offset: int, piece: memoryview) -> None:
        if piece.obj is self.dest:
            self.in_place += piece.nbytes
        else:
            self.view[offset:offset + piece.nbytes] = piece
            self.copied += piece.nbytes


@pytest.mark.parametrize("where", ["s3", "gcs", "azure"])
def test_a_sink_that_offers_memory_receives_the_bytes_there(where, request):
    """read_range_to with a sink that says where the bytes go (``space``) has the
    lean client receive them straight into that memory on every backend: the sink
    is handed views of it, and only bytes before the memory it offers are copied."""
    backend = request.getfixturevalue(where)
    data = os.urandom(4 * httpget.PIECE + 4321)
    store = open_store(backend.root, backend.options)
    store.put("obj.bin", data)
    sink = _Landing(len(data), skip=1000)
    store.read_range_to("obj.bin", 0, len(data), sink, on_loop=True)
    assert bytes(sink.dest) == data
    assert sink.copied >= 1000 and sink.in_place >= len(data) - 2 * httpget.PIECE


def test_filling_offers_its_buffers_and_takes_views_of_them_as_in_place():
    """``Filling`` (read_range_into's sink) offers the rest of the buffer being filled,
    never past its end; a piece that is a view of that buffer is taken as received
    there (not copied: here a view of other bytes of it, which a copy would have
    written over the slot), any other piece is copied in, and the CRC32C covers
    both."""
    from cloudckpt.storage.transfer.ranges import Filling
    from cloudckpt.util.crc import crc32c_value

    first, second = bytearray(b"abcdefghij"), bytearray(b"-" * 6)
    filling = Filling([first, second])
    room = filling.space(0, 100)
    assert room is not None and room.obj is first and room.nbytes == 10
    filling(0, memoryview(first)[2:6])  # "in place": bytes 0-3 left as they are
    filling(4, b"XYZ")  # copied
    assert filling.space(7, 100).nbytes == 3
    filling(7, b"123456789")  # copied across both buffers
    assert filling.space(16, 100) is None
    assert bytes(first) == b"abcdXYZ123" and bytes(second) == b"456789"
    assert filling.crc.value == crc32c_value(b"cdef" + b"XYZ" + b"123456789")


class Refused(Exception):
    pass


@pytest.mark.parametrize("error", [Refused("no room"), ConnectionError("no room")])
def test_an_error_of_the_sinks_space_comes_out_as_raised(s3, error):
    """What a sink's ``space`` raises is the caller's error: it stops the read and
    comes out unchanged, not taken for the store's (a ConnectionError is not
    retried as a dropped connection would be)."""
    data = os.urandom(3 * httpget.PIECE)
    store = open_store(s3.root, s3.options)
    store.put("obj.bin", data)
    calls = []

    class Sink(_Landing):
        def space(self, offset: int, n: int) -> memoryview | None:
            calls.append(offset)
            raise error

    with pytest.raises(type(error)) as caught:
        store.read_range_to("obj.bin", 0, len(data), Sink(len(data)), on_loop=True)
    assert caught.value is error and len(calls) == 1


Handler = Callable[[bytes, asyncio.StreamWriter, int], Awaitable[bool]]


async def _serve(handler: Handler, tls: ssl.SSLContext | None = None
                 ) -> tuple[asyncio.base_events.Server, str, list[int]]:
    """A loopback HTTP server: ``handler(head, writer, n)`` answers the ``n``-th
    request of a connection (``head``: its request head) and says whether to keep
    the connection open. Returns the server, a URL (``https://localhost`` with
    ``tls``) and the number of connections made so far (in a list)."""
    connections = [0]

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections[0] += 1
        n = 0
        try:
            while await handler(await reader.readuntil(b"\r\n\r\n"), writer, n):
                n += 1
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0, ssl=tls)
    port = server.sockets[0].getsockname()[1]
    where = f"https://localhost:{port}" if tls else f"http://127.0.0.1:{port}"
    return server, f"{where}/obj", connections


def _answer(body: bytes) -> bytes:
    return (f"HTTP/1.1 206 Partial Content\r\nContent-Length: {len(body)}\r\n"
            f"Content-Range: bytes 0-{len(body) - 1}/{len(body)}\r\n\r\n").encode() + body


async def _read(url: str, n: int, **kw) -> bytes:
    got = bytearray()
    await get_range(url, 0, n, lambda piece: got.extend(piece), **kw)
    return bytes(got)


def test_a_kept_connection_the_server_closed_is_replaced_once():
    """A server may close a kept connection just as a request goes out on it: the
    request is sent once more on a fresh connection, not failed."""
    body = os.urandom(5000)

    async def once_per_connection(head, writer, n):
        if n > 0:
            return False  # closes the kept connection without answering
        writer.write(_answer(body))
        await writer.drain()
        return True

    async def run() -> tuple[bytes, bytes, int]:
        server, url, connections = await _serve(once_per_connection)
        async with server:
            first = await _read(url, len(body))
            second = await _read(url, len(body))
            return first, second, connections[0]

    first, second, made = asyncio.run(run())
    assert first == body and second == body and made == 2


def test_a_silent_server_times_out_and_a_cut_body_is_a_reset():
    """A response that stops coming is a TimeoutError after ``timeout``; one whose
    connection closes early a ConnectionResetError (both transient: the caller
    resumes from the bytes it was given)."""
    async def stall(head, writer, n):
        writer.write(_answer(b"x" * 1000)[:-500])
        await writer.drain()
        await asyncio.sleep(5)
        return False

    async def cut(head, writer, n):
        writer.write(_answer(b"x" * 1000)[:-500])
        await writer.drain()
        return False

    async def run(handler: Handler, **kw) -> BaseException:
        server, url, _ = await _serve(handler)
        async with server:
            with pytest.raises((TimeoutError, ConnectionResetError)) as caught:
                await _read(url, 1000, **kw)
            return caught.value

    assert isinstance(asyncio.run(run(stall, timeout=0.3)), TimeoutError)
    assert isinstance(asyncio.run(run(cut)), ConnectionResetError)


def test_what_the_lean_client_does_not_read_is_unanswered():
    """An error status or a chunked body is Unanswered (the full client asks again);
    an exception of ``give`` comes out as it was raised."""
    async def error(head, writer, n):
        writer.write(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 5\r\n\r\nnope!")
        await writer.drain()
        return True

    async def chunked(head, writer, n):
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"5\r\nhello\r\n0\r\n\r\n")
        await writer.drain()
        return True

    async def fine(head, writer, n):
        writer.write(_answer(b"y" * 100))
        await writer.drain()
        return True

    class Stop(Exception):
        pass

    def refuse(piece: memoryview) -> None:
        raise Stop

    async def run() -> None:
        for handler, status in ((error, 403), (chunked, 200)):
            server, url, _ = await _serve(handler)
            async with server:
                with pytest.raises(Unanswered) as caught:
                    await _read(url, 5)
                assert caught.value.status == status
        server, url, _ = await _serve(fine)
        async with server:
            with pytest.raises(Stop):
                await get_range(url, 0, 100, refuse)

    asyncio.run(run())


def _self_signed(tmp_path) -> tuple[str, str]:
    """A certificate for localhost and its key, as PEM files."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
            .sign(key, hashes.SHA256()))
    cert_file, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_file), str(key_file)


def test_https_bodies_land_through_tls_and_an_unknown_certificate_is_refused(tmp_path):
    """Over TLS the pieces land the same way (asyncio's TLS transport fills the
    protocol's buffer); a server whose certificate the context does not trust is
    refused, not read."""
    cert, key = _self_signed(tmp_path)
    server_side = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_side.load_cert_chain(cert, key)
    body = os.urandom(3 * httpget.PIECE + 77)

    async def answer(head, writer, n):
        writer.write(_answer(body))
        await writer.drain()
        return True

    async def run() -> bytes:
        server, url, _ = await _serve(answer, server_side)
        async with server:
            got = await _read(url, len(body), context=ssl.create_default_context(cafile=cert))
            with pytest.raises(ssl.SSLCertVerificationError):
                await _read(url, len(body), context=ssl.create_default_context())
            return got

    assert asyncio.run(run()) == body


def test_concurrent_responses_share_the_loops_buffer_and_keep_their_own_bytes():
    """Every connection of a loop receives into one buffer (memory does not grow with
    the connections a load opens): responses read at once each get their own
    bytes, in order."""
    bodies = [os.urandom(2 * httpget.PIECE + 1000 * i) for i in range(8)]

    async def in_bits(head, writer, n):
        body = bodies[int(head.split(b" ", 2)[1].rsplit(b"/", 1)[1])]
        for k in range(0, len(body), 300_000):  # in bits, interleaved with the others
            writer.write((_answer(body)[:-len(body)] if k == 0 else b"") + body[k:k + 300_000])
            await writer.drain()
            await asyncio.sleep(0)
        return True

    async def run() -> list[bytes]:
        server, url, _ = await _serve(in_bits)
        async with server:
            return list(await asyncio.gather(*(_read(f"{url}/{i}", len(b))
                                               for i, b in enumerate(bodies))))

    assert asyncio.run(run()) == bodies
    buffers = {id(p.buffer.obj) for p in httpget._pools.values()}
    conns = [c for p in httpget._pools.values() for kept in p.idle.values() for c in kept]
    assert conns and all(id(c._buf.obj) in buffers for c in conns)


@pytest.mark.parametrize("tls", [False, True])
def test_bodies_land_in_the_memory_room_offers_and_its_error_comes_out(tls, tmp_path):
    """``room`` has the body received into the caller's memory (over TLS too, where
    asyncio's transport copies the decrypted bytes into it): ``give`` is handed views
    of that memory. An exception ``room`` raises comes out of get_range as raised,
    not as a cut connection that would be retried."""
    server_side = client_side = None
    if tls:
        cert, key = _self_signed(tmp_path)
        server_side = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        server_side.load_cert_chain(cert, key)
        client_side = ssl.create_default_context(cafile=cert)
    body = os.urandom(3 * httpget.PIECE + 5)

    async def answer(head, writer, n):
        writer.write(_answer(body))
        await writer.drain()
        return True

    class Full(Exception):
        pass

    def no_room(n: int) -> memoryview:
        raise Full

    async def run() -> _Landing:
        sink = _Landing(len(body))
        server, url, _ = await _serve(answer, server_side)
        async with server:
            await get_range(url, 0, len(body), lambda piece: sink(sink.in_place + sink.copied,
                                                                  piece),
                            room=lambda n: sink.space(sink.in_place + sink.copied, n),
                            context=client_side)
            with pytest.raises(Full):
                await get_range(url, 0, len(body), lambda piece: None, room=no_room,
                                context=client_side)
        return sink

    sink = asyncio.run(run())
    assert bytes(sink.dest) == body
    assert sink.in_place >= len(body) - httpget.PIECE


def test_room_is_taken_as_bytes_and_memory_that_cannot_take_them_is_refused():
    """Memory ``room`` offers is received into as bytes, whatever its item type (a
    view of 4-byte items takes 4 bytes an item); read-only memory is a TypeError of
    the caller's, not a failed connection."""
    import array

    body = os.urandom(2 * httpget.PIECE + 8)

    async def answer(head, writer, n):
        whole = _answer(body)
        writer.write(whole[:-len(body)])  # the head alone: the body starts in the room
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(body)
        await writer.drain()
        return True

    dest = array.array("I", bytes(len(body)))
    items, raw = memoryview(dest), memoryview(dest).cast("B")
    got, in_place = [0], [0]

    def give(piece: memoryview) -> None:
        if piece.obj is dest:
            in_place[0] += piece.nbytes
        else:  # the bytes that came with the head
            raw[got[0]:got[0] + piece.nbytes] = piece
        got[0] += piece.nbytes

    def room(n: int) -> memoryview | None:  # whole items only
        return None if got[0] % 4 else items[got[0] // 4:(got[0] + n) // 4]

    async def run() -> None:
        server, url, _ = await _serve(answer)
        async with server:
            await get_range(url, 0, len(body), give, room=room)
            with pytest.raises(TypeError, match="writable"):
                await get_range(url, 0, len(body), lambda piece: None,
                                room=lambda n: memoryview(bytes(n)))

    asyncio.run(run())
    assert got[0] == len(body) and dest.tobytes() == body
    assert in_place[0] > 0
