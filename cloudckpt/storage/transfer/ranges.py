"""Ranged reads streamed to a sink a piece at a time, resumed where they stopped.

:class:`RangedRead` does a :class:`~cloudckpt.storage.Store`'s ``read_range_to``
and ``read_range_into``, on top of the backend's ``iter_range``
(one S3, GCS or Azure GET read as it arrives; ranged reads of a piece elsewhere).
Backends whose GET is a response on the fsspec event loop (:class:`StreamedRanges`)
can also hand each piece to a sink there, as it arrives (``stream_range``).
:func:`read_upto` reads the pieces of a streamed response body.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from fsspec.asyn import sync

from cloudckpt.errors import CloudCkptError, StorageError
from cloudckpt.storage.backend import Backend
from cloudckpt.storage.retry import describe, is_transient, status_of
from cloudckpt.storage.transfer.httpget import (
    DirectGet,
    Room,
    Unanswered,
    direct_gets_option,
    get_range,
    proxies_in_environment,
    receivable,
)
from cloudckpt.util.crc import Crc32c

log = logging.getLogger(__name__)

#: Bytes of a response body held at once while it is copied into a caller's buffer.
READ_PIECE = 2 << 20


class _SinkError(CloudCkptError):
    """Carries a failure of a :meth:`RangedRead.to` sink through the retry
    loop untouched (it is the caller's, not the store's)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


class _Resume(_SinkError):
    """A transient failure of a ranged read after progress: resumed where it
    stopped, under a fresh retry budget."""


class Filling:
    """Buffers filled in turn from the first byte of a range, with the CRC32C of the
    bytes put so far (the sink of :meth:`RangedRead.into`)."""

    def __init__(self, outs: Sequence[Any]) -> None:
        self.views = [memoryview(o).cast("B") for o in outs]
        self.bounds = list(itertools.accumulate((v.nbytes for v in self.views), initial=0))
        self.total = self.bounds[-1]
        self.done = 0
        self.crc = Crc32c()

    def __call__(self, offset: int, data: Any) -> None:
        self.put(data)

    def space(self, offset: int, n: int) -> memoryview | None:
        """Where the range's next bytes go: the rest of the buffer being filled, up
        to ``n`` bytes (see :meth:`RangedRead.to`)."""
        i = bisect.bisect_right(self.bounds, self.done) - 1
        if i >= len(self.views):
            return None
        at = self.done - self.bounds[i]
        return self.views[i][at:at + n]

    def put(self, data: Any) -> None:
        """The range's next bytes, copied where they go (unless they were received
        there, into the memory :meth:`space` gave)."""
        got = memoryview(data).cast("B")
        self.crc.update(got)
        pos = self.done
        i = bisect.bisect_right(self.bounds, pos) - 1
        if got.obj is self.views[i].obj and got.nbytes <= self.bounds[i + 1] - pos:
            self.done = pos + got.nbytes
            return
        while got.nbytes:
            at = pos - self.bounds[i]
            n = min(got.nbytes, self.views[i].nbytes - at)
            self.views[i][at:at + n] = got[:n]
            got, pos, i = got[n:], pos + n, i + 1
        self.done = pos


class RangedRead:
    """The ranged reads of one object of a store: ``path`` on ``backend``, named
    ``uri`` in messages, every attempt run by ``call`` (the store's retry policy)."""

    def __init__(self, backend: Backend, path: str, uri: str,
                 call: Callable[[Callable[[], None]], None]) -> None:
        self.backend = backend
        self.path = path
        self.uri = uri
        self.call = call

    def to(self, start: int, end: int, sink: Callable[[int, bytes], Any], *,
           chunk: int, on_loop: bool) -> None:
        """Stream bytes ``[start, end)`` into ``sink(offset, data)``, resumed where a
        transient failure stopped it (:meth:`Store.read_range_to
        <cloudckpt.storage.Store.read_range_to>` says what the caller may expect)."""
        path, uri = self.path, self.uri
        stream = getattr(self.backend, "stream_range", None) if on_loop else None

        def give(done: list[int], data: bytes) -> None:
            if not data:
                return
            if len(data) > end - done[0]:
                raise StorageError(f"{uri}: the store sent more bytes than "
                                   f"the range [{start}, {end}) asked for")
            try:
                sink(done[0], data)
            except BaseException as exc:
                raise _SinkError(exc) from exc
            done[0] += len(data)

        space = getattr(sink, "space", None)

        def room(done: list[int], n: int) -> memoryview | None:
            assert space is not None  # passed on only where the sink has one
            try:
                offered = space(done[0], min(n, end - done[0]))
                return None if offered is None else receivable(offered)
            except BaseException as exc:
                raise _SinkError(exc) from exc

        def attempt(done: list[int]) -> None:
            if stream is not None:
                stream(path, done, end, lambda data: give(done, data),
                       None if space is None else functools.partial(room, done))
                return
            pieces = self.backend.iter_range(path, done[0], end, min(chunk, end - done[0]))
            try:
                for data in pieces:
                    give(done, data)
            finally:
                close = getattr(pieces, "close", None)
                if close is not None:
                    close()

        self._resumably(start, end, attempt)

    def _resumably(self, start: int, end: int, attempt: Callable[[list[int]], None]) -> None:
        """Run ``attempt(done)``, which reads on from byte ``done[0]`` and moves it on,
        under the retry policy until ``[start, end)`` is read (see :meth:`to`)."""
        done = [start]
        uri = self.uri

        def once() -> None:
            first = done[0]
            try:
                attempt(done)
            except _SinkError:
                raise
            except Exception as exc:
                if status_of(exc, self.backend) == 416:  # shorter than the range
                    raise EOFError(f"{uri} ends before byte {end}") from exc
                if done[0] > first and is_transient(exc, self.backend):
                    raise _Resume(exc) from exc
                raise
            if done[0] < end:
                raise EOFError(f"short read of {uri} [{start}, {end}): the "
                               f"object ends at byte {done[0]}")

        failure: BaseException | None = None
        while done[0] < end:
            try:
                self.call(once)
            except _Resume as exc:
                log.warning("resuming get_range %s at byte %d of [%d, %d) after: %s",
                            uri, done[0], start, end, describe(exc.error, self.backend))
            except _SinkError as exc:
                failure = exc.error
                break
        if failure is not None:
            raise failure  # outside the handler: the sink's error, as it was raised

    def into(self, start: int, outs: Sequence[Any]) -> int:
        """Fill the writable buffers ``outs`` in turn with the bytes from ``start`` on
        (one ranged read, resumed like :meth:`to`), with no buffer of its own beyond
        a network piece; return the CRC32C value of the bytes read, computed as they
        arrive. ``EOFError`` if the object is shorter."""
        filling = Filling(outs)
        if filling.total == 0:
            return 0
        readinto = getattr(self.backend, "readinto_range", None)
        if readinto is not None:  # a local file: straight into the buffers
            path = self.path
            self.call(lambda: readinto(path, start, filling.views))
            for v in filling.views:
                filling.crc.update(v)
            return filling.crc.value
        self.to(start, start + filling.total, filling, chunk=READ_PIECE, on_loop=True)
        return filling.crc.value


class StreamedRanges:
    """``iter_range`` and ``stream_range`` for a backend whose ranged GET is an HTTP
    response on the fsspec event loop (S3, GCS, Azure): the backend opens it
    (:meth:`open_range`), these read it."""

    fs: Any

    def _read_options(self, scheme: str, options: dict[str, Any]) -> dict[str, Any]:
        self.direct_gets = direct_gets_option(scheme, options)
        return super()._read_options(scheme, options)  # type: ignore[misc]

    async def direct_get(self, path: str) -> DirectGet | None:
        """The GET of ``path`` as a URL for the lean client (:mod:`.httpget`), or None
        where only the backend's own client may send it (credentials a URL cannot
        carry, settings of the user's that client honours)."""
        return None

    async def open_range(self, path: str, start: int, end: int
                         ) -> tuple[Any, Callable[[], None]]:
        """A GET of bytes ``[start, end)``: its body (``await body.read(n)``, and
        ``readany()`` where it has it) and what releases it (called on the loop)."""
        raise NotImplementedError

    def iter_range(self, path: str, start: int, end: int, chunk: int) -> Iterator[bytes]:
        # One ranged GET whose body is read a piece at a time: one request however
        # long the range, one piece in memory.
        body, release = sync(self.fs.loop, self.open_range, path, start, end)
        try:
            while pieces := sync(self.fs.loop, read_upto, body, chunk):
                yield from pieces
        finally:
            sync(self.fs.loop, _call_async, release)

    def stream_range(self, path: str, done: list[int], end: int,
                     give: Callable[[memoryview], None], room: Room | None = None) -> None:
        """One ranged GET from byte ``done[0]`` to ``end``, each piece given to ``give``
        on the loop as it arrives (``give`` moves ``done`` on). A piece may be a view
        of the client's buffer, valid only during the call, or of the memory ``room``
        offered for it (:data:`.httpget.Room`)."""
        sync(self.fs.loop, self.range_pieces, path, done, end, give, room)

    async def range_pieces(self, path: str, done: list[int], end: int,
                           give: Callable[[memoryview], None], room: Room | None = None
                           ) -> None:
        """:meth:`stream_range` on the loop: on the lean client where the backend puts
        the GET as a URL (:meth:`direct_get`; each piece lands in the loop's one
        receive buffer, not in a ``bytes`` object behind aiohttp's parser and stream
        reader), unless the storage option ``direct_gets=False`` or a proxy in the
        environment says otherwise; else, and for an answer that client does not
        read (an error), through the response of :meth:`open_range`, whose client
        says what it was."""
        if self.direct_gets and not proxies_in_environment():
            get = await self.direct_get(path)
            if get is not None:
                try:
                    await get_range(get.url, done[0], end, give, room=room,
                                    headers=get.headers, context=get.context,
                                    timeout=get.timeout)
                    return
                except Unanswered:
                    pass
        body, release = await self.open_range(path, done[0], end)
        read = getattr(body, "readany", None)  # a buffered piece, not joined ones
        try:
            while done[0] < end:
                data = await (read() if read is not None else body.read(READ_PIECE))
                if not data:
                    return
                give(memoryview(data))
        finally:
            release()


async def _call_async(fn: Callable[[], None]) -> None:
    fn()  # on the loop's thread: aiohttp is not thread-safe


async def read_upto(stream: Any, n: int) -> list[bytes]:
    """Up to ``n`` bytes of a response body (anything with ``async read(n)``, which
    may return less), fewer only at its end, as the pieces the client handed over:
    one call per piece of a streamed read, and no copy to join them."""
    pieces: list[bytes] = []
    got = 0
    while got < n:
        data = await stream.read(n - got)
        if not data:
            break
        pieces.append(data)
        got += len(data)
    return pieces
