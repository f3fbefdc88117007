"""Ranged GETs on a minimal HTTP/1.1 client, for a backend whose GET can be put as a
URL (S3: a presigned one), run on the backend's event loop.

A load's CPU goes to its pieces. Through aiohttp every piece of a response is a
fresh ``bytes`` (allocated, faulted in, copied into), parsed, queued in a stream
reader and awaited, before the caller copies it where it goes. Here asyncio's
:class:`~asyncio.BufferedProtocol` has the kernel copy each piece into one buffer
per event loop, and the caller's ``give`` is handed a view of it on the loop,
where it copies the bytes on: no object per piece, no wake-up of a coroutine. One
buffer serves every connection of a loop, as the loop runs one callback at a time
and each piece is used up within its callback. A caller that knows where the body's
bytes go (``room``: a tensor's memory) has the kernel copy them there instead, and
``give`` is handed a view of its own memory: no copy of them on the loop at all.

Only what a ranged GET of an object store needs: a body of a known length in a
200 or 206 response. Any other answer (an error status, a chunked body, a head
h11 refuses) is :class:`Unanswered`, and the caller asks again through its full
client, which reads and classifies the error. h11 writes the request and parses
the response head, and no more: the body's bytes go past it, from the kernel
straight to where they are used. Connections are kept per host and reused; a
request on a kept connection that the server had closed meanwhile is sent once
more on a fresh one; a response silent for ``timeout`` seconds is a
``TimeoutError``, and one cut short a ``ConnectionResetError`` (both transient:
the caller resumes where the bytes stopped).
"""

from __future__ import annotations

import asyncio
import functools
import os
import re
import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import h11

from cloudckpt.errors import ConfigError, StorageError

#: Bytes the kernel may copy into the loop's receive buffer at a time.
PIECE = 1 << 20
#: The longest response head read.
_HEAD_LIMIT = 64 << 10
#: Where h11 ends a head: the first empty line.
_HEAD_END = re.compile(rb"\n\r?\n")
#: The longest error body read before the connection is dropped.
_ERROR_BODY_LIMIT = 1 << 20
#: Idle connections kept per host.
_KEPT = 64

#: Where the next bytes of a body go, given how many may come: writable memory of
#: the caller's (a view of at most that many bytes), or None for the loop's buffer.
Room = Callable[[int], "memoryview | None"]


def receivable(memory: Any) -> memoryview:
    """``memory`` as the bytes a socket may receive into: a writable, contiguous
    buffer, viewed as bytes (a typed view counts its bytes, not its items);
    ``TypeError`` for any other."""
    view = memoryview(memory)
    if view.readonly or not view.c_contiguous:
        raise TypeError("memory to receive into must be writable and contiguous, got a "
                        f"{'read-only' if view.readonly else 'non-contiguous'} "
                        f"{type(memory).__name__}")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class Unanswered(Exception):
    """A response this client does not read (``status``: an error, or a body without
    a length; 0 where there was no status to read, or no request this client could
    send): ask again through the full client, which says what it was."""

    def __init__(self, status: int, why: str) -> None:
        super().__init__(f"HTTP {status}: {why}")
        self.status = status


class _Connection(asyncio.BufferedProtocol):
    """One keep-alive connection, one request at a time."""

    def __init__(self, buffer: memoryview) -> None:
        self._buf = buffer  # the loop's: each piece is used up in buffer_updated
        self._transport: asyncio.Transport | None = None
        self._parser: h11.Connection | None = None  # the current request's, until its head
        self._state = "idle"  # "head", "body", "error", "idle" or "closed"
        self._done: asyncio.Future[None] | None = None
        self._give: Callable[[memoryview], None] | None = None
        self._room: Room | None = None
        self._lent: memoryview | None = None  # the caller's memory the next piece lands in
        self._start = 0
        self._want = 0
        self._left = 0
        self._keep = True
        self._error: BaseException | None = None
        self._answered = False  # a byte of the current response came
        self._last = 0.0
        self._timer: asyncio.TimerHandle | None = None

    # -- the request ----------------------------------------------------------
    @property
    def usable(self) -> bool:
        return self._state == "idle" and self._transport is not None and \
            not self._transport.is_closing()

    def request(self, head: h11.Request, start: int, want: int,
                give: Callable[[memoryview], None], timeout: float,
                room: Room | None = None) -> asyncio.Future[None]:
        """Send ``head``; the body's bytes (``want`` of them, from ``start``) go to
        ``give``, received where ``room`` says when it offers memory. The future is
        done when the body is whole."""
        assert self._transport is not None and self._state == "idle"
        parser = h11.Connection(h11.CLIENT, max_incomplete_event_size=_HEAD_LIMIT)
        sent = parser.send(head) + parser.send(h11.EndOfMessage())
        self._state, self._parser, self._answered = "head", parser, False
        self._start, self._want, self._give, self._room = start, want, give, room
        loop = asyncio.get_running_loop()
        self._done = loop.create_future()
        self._last = loop.time()
        self._watch(timeout)
        self._transport.write(sent)
        return self._done

    @property
    def answered(self) -> bool:
        return self._answered

    def close(self) -> None:
        self._state = "closed"
        if self._transport is not None:
            self._transport.abort()

    # -- the protocol ---------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def get_buffer(self, sizehint: int) -> memoryview:
        self._lent = None
        if self._state == "body" and self._room is not None and self._left:
            try:
                offered = self._room(min(self._left, PIECE))
                lent = None if offered is None else receivable(offered)
            except BaseException as exc:  # noqa: BLE001 - the caller's, raised where awaited
                self._fail(exc)
                return self._buf
            if lent is not None and 0 < lent.nbytes <= self._left:
                self._lent = lent
                return lent
        return self._buf

    def buffer_updated(self, nbytes: int) -> None:
        self._last = asyncio.get_running_loop().time()
        self._answered = True
        lent, self._lent = self._lent, None
        data = (self._buf if lent is None else lent)[:nbytes]
        try:
            if self._state == "head":
                self._read_head(data)
            elif self._state == "body":
                self._read_body(data)
            elif self._state == "error":
                self._read_error(data)
            else:
                raise StorageError("the server sent bytes no request asked for")
        except BaseException as exc:  # noqa: BLE001 - the request's, raised where awaited
            self._fail(exc)

    def eof_received(self) -> bool:
        return False  # close: connection_lost says what it cut short

    def connection_lost(self, exc: Exception | None) -> None:
        state, self._state = self._state, "closed"
        if state in ("head", "body", "error"):
            got = self._want - self._left if state == "body" else 0
            cut = ConnectionResetError(f"the server closed the connection after {got} of "
                                       f"{self._want} bytes")
            cut.__cause__ = exc
            self._finish(cut)

    # -- reading --------------------------------------------------------------
    def _read_head(self, data: memoryview) -> None:
        parser = self._parser
        assert parser is not None
        event, rest = self._parse_head(parser, data)
        if event is None:
            return
        self._parser = None
        status = event.status_code
        headers = {name.decode("latin-1"): value.decode("latin-1")
                   for name, value in event.headers}  # names lower-cased; the last one wins
        closing = any(b"close" in (token.strip() for token in value.lower().split(b","))
                      for name, value in event.headers if name == b"connection")
        self._keep = not closing and event.http_version == b"1.1"
        length = headers.get("content-length")  # digits, one value: h11 checked
        if status in (200, 206) and length is not None and \
                "transfer-encoding" not in headers:
            self._check_range(status, headers, int(length))
            self._state, self._left = "body", int(length)
        else:
            self._state = "error"
            self._error = Unanswered(status, event.reason.decode("latin-1"))
            self._left = int(length) if length is not None else _ERROR_BODY_LIMIT
            if self._left > _ERROR_BODY_LIMIT or length is None:
                self._finish(self._error)  # not worth reading: the connection goes
                self.close()
                return
        if rest or self._left == 0:
            (self._read_body if self._state == "body" else self._read_error)(rest)

    @staticmethod
    def _parse_head(parser: h11.Connection, data: memoryview
                    ) -> tuple[h11.Response | h11.InformationalResponse | None, memoryview]:
        """The response head once ``data`` completes it (None until then), and the
        bytes of ``data`` past it. A head h11 refuses is :class:`Unanswered`, one
        longer than the limit a ``StorageError``.

        h11 is given ``data`` up to the head's end only: the body's first bytes stay
        where they were received (h11 would copy them in, and out again), unless
        the end lay across two reads, where h11 finds it first."""
        found = _HEAD_END.search(data)
        cut = len(data) if found is None else found.end()
        parser.receive_data(bytes(data[:cut]))  # a copy: the loop's buffer is used again
        try:
            event = parser.next_event()
            if event is h11.NEED_DATA and cut < len(data):  # not an end to h11: read on
                parser.receive_data(bytes(data[cut:]))
                cut, event = len(data), parser.next_event()
        except h11.RemoteProtocolError as exc:
            if exc.error_status_hint == 431:  # h11's "buffer too long": no head end yet
                raise StorageError("a response head longer than 64 KiB") from None
            raise Unanswered(0, f"a response head this client does not read: {exc}") from None
        if event is h11.NEED_DATA:
            return None, data[:0]
        assert isinstance(event, (h11.Response, h11.InformationalResponse)), event
        early = parser.trailing_data[0]
        return event, memoryview(early + bytes(data[cut:])) if early else data[cut:]

    def _check_range(self, status: int, headers: dict[str, str], length: int) -> None:
        if status == 206:
            spec = headers.get("content-range", "")
            first = spec.removeprefix("bytes ").split("-", 1)[0]
            if not (first.isascii() and first.isdigit()) or int(first) != self._start or \
                    length > self._want:
                raise StorageError(f"the server answered the byte range from {self._start} "
                                   f"with {spec!r}")
        elif self._start > 0 or length > self._want:
            raise StorageError(f"the server ignored the byte range [{self._start}, "
                               f"{self._start + self._want}) and sent {length} bytes")

    def _read_body(self, data: memoryview) -> None:
        n = min(len(data), self._left)
        if n:
            self._left -= n
            assert self._give is not None
            self._give(data[:n])
        if len(data) > n:
            raise StorageError("the server sent more bytes than its Content-Length")
        if self._left == 0:
            self._state = "idle"
            self._finish(None)
            if not self._keep:
                self.close()

    def _read_error(self, data: memoryview) -> None:
        self._left -= len(data)
        if self._left <= 0:
            self._state = "idle"
            self._finish(self._error)
            self.close()  # its body may not have been all of it

    # -- ending ---------------------------------------------------------------
    def _fail(self, exc: BaseException) -> None:
        self._finish(exc)
        self.close()

    def _finish(self, exc: BaseException | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._give = self._room = self._lent = None
        done, self._done = self._done, None
        if done is not None and not done.done():
            if exc is None:
                done.set_result(None)
            else:
                done.set_exception(exc)

    def _watch(self, timeout: float) -> None:
        loop = asyncio.get_running_loop()

        def check() -> None:
            if self._done is None:
                return
            idle = loop.time() - self._last
            if idle >= timeout:
                self._fail(TimeoutError(f"no byte of the response for {idle:.0f} s"))
            else:
                self._timer = loop.call_later(timeout - idle, check)

        self._timer = loop.call_later(timeout, check)


_Key = tuple[str, str, int, "ssl.SSLContext | None"]


class _Pool:
    """Kept connections of one event loop, per (scheme, host, port, TLS context): a
    connection verified under one context serves no request made under another."""

    def __init__(self) -> None:
        self.idle: dict[_Key, list[_Connection]] = {}
        self.buffer = memoryview(bytearray(PIECE))

    async def connect(self, key: _Key) -> tuple[_Connection, bool]:
        """A connection to ``key``, and whether it was kept from before."""
        kept = self.idle.get(key, [])
        while kept:
            conn = kept.pop()
            if conn.usable:
                return conn, True
        loop = asyncio.get_running_loop()
        scheme, host, port, context = key
        _, conn = await loop.create_connection(
            lambda: _Connection(self.buffer), host, port,
            ssl=context if scheme == "https" else None,
            server_hostname=host if scheme == "https" else None)
        return conn, False

    def keep(self, key: _Key, conn: _Connection) -> None:
        kept = self.idle.setdefault(key, [])
        if conn.usable and len(kept) < _KEPT:
            kept.append(conn)
        else:
            conn.close()


#: The pools of the event loops that read; those of closed loops are dropped.
_pools: dict[asyncio.AbstractEventLoop, _Pool] = {}


def _forget_pools() -> None:
    _pools.clear()  # a forked child must not use its parent's connections


os.register_at_fork(after_in_child=_forget_pools)


def direct_gets_option(scheme: str, options: dict[str, Any]) -> bool:
    """Take the storage option ``direct_gets`` (default True) out of ``options``:
    False has a backend read through its full client instead of this one."""
    direct = options.pop("direct_gets", True)
    if not isinstance(direct, bool):
        raise ConfigError(f"{scheme}:// storage option direct_gets must be True or False, "
                          f"got {direct!r}")
    return direct


@dataclass(frozen=True)
class DirectGet:
    """A backend's ranged GET put as a URL, for this client: ``headers`` sent besides
    the range (credentials), ``context`` the TLS context of an ``https`` URL (None:
    the system's CAs), ``timeout`` the seconds a response may go without a byte."""

    url: str
    headers: Mapping[str, str] | None = None
    context: ssl.SSLContext | None = None
    timeout: float = 60.0


#: Environment variables that send requests through a proxy.
_PROXY_VARIABLES = ("http_proxy", "https_proxy", "all_proxy")


def proxies_in_environment() -> bool:
    """Whether the environment names a proxy (this client does not go through one:
    a backend then reads through its full client, which does)."""
    return any(os.environ.get(v) or os.environ.get(v.upper()) for v in _PROXY_VARIABLES)


@functools.cache
def default_tls() -> ssl.SSLContext:
    """The system's trusted CAs, as aiohttp verifies servers by default."""
    return ssl.create_default_context()


def _pool_of(loop: asyncio.AbstractEventLoop) -> _Pool:
    pool = _pools.get(loop)
    if pool is None:
        for closed in [k for k in _pools if k.is_closed()]:
            del _pools[closed]
        pool = _pools[loop] = _Pool()
    return pool


async def get_range(url: str, start: int, end: int, give: Callable[[memoryview], None], *,
                    room: Room | None = None, headers: Mapping[str, str] | None = None,
                    context: ssl.SSLContext | None = None, timeout: float = 60.0) -> None:
    """GET bytes ``[start, end)`` of ``url``, each piece handed to ``give`` in order as
    a view valid only during the call (on this event loop: it must not block).
    :class:`Unanswered` for a response this client does not read. ``room``: where
    the next bytes go (see :data:`Room`); a piece received there is handed to
    ``give`` as a view of that memory. ``headers``: sent besides the range
    (credentials); ``context``: the TLS context of an ``https`` URL (None:
    :func:`default_tls`)."""
    parts = urlsplit(url)
    scheme = parts.scheme
    if scheme not in ("http", "https") or not parts.hostname:
        raise Unanswered(0, f"not an http(s) URL: {scheme}")
    port = parts.port or (443 if scheme == "https" else 80)
    if scheme == "https" and context is None:
        context = default_tls()
    key = (scheme, parts.hostname, port, context if scheme == "https" else None)
    target = parts.path + (f"?{parts.query}" if parts.query else "")
    fields = [("Host", parts.netloc), ("Range", f"bytes={start}-{end - 1}"),
              ("Accept-Encoding", "identity"), ("User-Agent", "cloudckpt"),
              *((k, v) for k, v in (headers or {}).items()
                if k.lower() not in ("host", "range", "accept-encoding", "user-agent"))]
    try:
        head = h11.Request(method=b"GET", target=target.encode("latin-1"),
                           headers=[(k.encode("latin-1"), v.encode("latin-1"))
                                    for k, v in fields])
    except h11.LocalProtocolError as exc:
        raise Unanswered(0, f"a request this client does not send: {exc}") from None
    pool = _pool_of(asyncio.get_running_loop())
    for attempt in range(2):
        conn, kept = await pool.connect(key)
        try:
            await conn.request(head, start, end - start, give, timeout, room)
        except ConnectionResetError:
            if kept and attempt == 0 and not conn.answered:
                continue  # the server had closed the kept connection: once more, afresh
            raise
        except BaseException:
            conn.close()
            raise
        pool.keep(key, conn)
        return
