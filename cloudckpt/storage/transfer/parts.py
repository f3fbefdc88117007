"""Streamed uploads in parts: the buffering and parallelism every object store shares.

A :class:`PartWriter` cuts the stream into parts, sends a few at once on a
thread pool, each under the store's retry policy. The bytes it holds (the part
being filled and the parts in flight) are taken from the store's upload window
(:mod:`.window`), shared by every streamed write of the process, so many objects
written at once cannot hold more than the window. An object under two parts goes
up as a single request on commit: parts would gain at most one in flight for extra
requests and server-side assembly. Until it outgrows that, the writer keeps what it
was lent (:meth:`PartWriter.lend`: a tensor's own bytes) and small copies as
:class:`Pieces` and sends them as they are: no copy of the tensor (the window
still counts them, as bytes in flight). Backends say *how* a part is stored and
how the parts become one object (S3 multipart upload, GCS compose).
"""

from __future__ import annotations

import mmap
import threading
from abc import abstractmethod
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from cloudckpt.errors import StorageError
from cloudckpt.storage.backend import Backend, Host
from cloudckpt.storage.retry import ONE_TRY
from cloudckpt.storage.transfer.bodies import Pieces
from cloudckpt.storage.transfer.window import ByteWindow, exported
from cloudckpt.storage.writers import RawWriter
from cloudckpt.util.crc import Buffer

#: Window bytes each thread holds in the buffers of its open writers.
_thread = threading.local()

#: Clean-up after an abort: one try each, so a dead endpoint does not hold the
#: caller's error back for another retry deadline.


def part_copy(data: Buffer, window: ByteWindow | None = None,
              capacity: int | None = None) -> memoryview:
    """A copy of ``data`` in an anonymous mapping (the window's, when given: see
    :meth:`ByteWindow.keep`) of ``capacity`` bytes (default: the data's), so that it
    is one of the part-sized mappings the window keeps and hands out again (one of
    another size would be mapped afresh, a page fault per page written). Not malloc:
    it would keep freed 16 MiB parts in its arenas, and a save's memory would grow
    with the state."""
    view = memoryview(data).cast("B")
    if not len(view):
        return memoryview(b"")
    size = max(capacity or 0, len(view))
    mapped = window.mapping(size) if window is not None else mmap.mmap(-1, size)
    mapped[:len(view)] = view
    return memoryview(mapped)[:len(view)]


def _mapping_of(part: memoryview | Pieces) -> mmap.mmap | None:
    """The window mapping a part was copied into (its first segment's), to go back to
    the window once the part is sent; None for bytes of the caller's."""
    first = part.views[0] if isinstance(part, Pieces) else part
    return first.obj if isinstance(first.obj, mmap.mmap) else None


class _Fill:
    """The bytes not sent yet, in one anonymous mapping of ``capacity`` bytes from the
    window's kept ones (a fresh mapping costs a page fault per page written): pages
    past what is held are given back, and the mapping goes back to the window on
    close."""

    def __init__(self, capacity: int, window: ByteWindow) -> None:
        self._capacity = capacity
        self._window = window
        self._map: mmap.mmap | None = None
        self.n = 0

    def __len__(self) -> int:
        return self.n

    def append(self, data: memoryview) -> None:
        if self._map is None:
            self._map = self._window.mapping(self._capacity)
        self._map[self.n:self.n + len(data)] = data
        self.n += len(data)

    def copy(self, size: int | None = None, capacity: int | None = None) -> memoryview:
        """A copy of the first ``size`` bytes (all by default), which then leave, in a
        mapping of ``capacity`` bytes (see :func:`part_copy`)."""
        size = self.n if size is None else size
        assert self._map is not None
        with memoryview(self._map) as whole:
            part = part_copy(whole[:size], self._window, capacity)
        self._map.move(0, size, self.n - size)
        self.n -= size
        self.drop_tail(self.n)  # an open writer holds only what it has not sent
        return part

    def drop_tail(self, keep: int) -> None:
        """Give back the pages past ``keep`` bytes (written once, not needed again)."""
        if self._map is not None and keep < self._capacity:
            start = -(-keep // mmap.PAGESIZE) * mmap.PAGESIZE
            if start < self._capacity:
                self._map.madvise(mmap.MADV_DONTNEED, start, self._capacity - start)

    def view(self) -> memoryview:
        assert self._map is not None
        return memoryview(self._map)[:self.n]

    def detach(self) -> mmap.mmap | None:
        """Empty the buffer; its mapping, for the window to keep, unless an HTTP
        client still holds a view of it (then it is unmapped once that goes)."""
        mapped, self._map, self.n = self._map, None, 0
        return mapped if mapped is not None and not exported(mapped) else None


class PartWriter(RawWriter):
    """Parallel, retried part uploads of ``backend``'s, for ``host`` (the store that
    opened the writer: its retry policy, upload window and bucket check);
    subclasses implement the hooks below."""

    #: Parts in flight per object (memory: this many parts, plus one being filled).
    IN_FLIGHT = 8
    #: The most parts one object may have (None: no limit of ours).
    MAX_PARTS: int | None = None
    #: Bytes of small writes a writer copies and keeps beside what it was lent, before
    #: it moves to a buffer (the pickles and headers between tensors).
    SMALL_COPIES = 256 * 1024

    def __init__(self, backend: Backend, host: Host, path: str, part_size: int) -> None:
        self._backend = backend
        self._store = host
        self._path = path
        self._part_size = part_size
        self._single_limit = 2 * part_size
        self._buf = _Fill(self._single_limit, host.upload_window)
        self._started = False
        self._parts: list[Future[Any]] = []
        self._pool: ThreadPoolExecutor | None = None
        self._aborted = False
        # Window bytes held for the buffer: two parts until the upload starts (it may
        # still go up as one request), then one part at a time. A writer waits for
        # the window only when it holds none of it, so writers never deadlock.
        self._window = host.upload_window
        self._held = 0
        # Until the object outgrows one request or its small copies: what it was lent
        # and copies of small writes, in order, sent as they are (see lend()).
        self._pieces: list[memoryview] | None = []
        self._pieces_size = 0
        self._copied = 0

    # ------------------------------------------------------------------ hooks

    def _start(self) -> None:
        """Begin a multi-part upload (one attempt; retried by the caller)."""

    def part_size_of(self, number: int) -> int:
        """The size of part ``number`` (1-based); all but the last have it."""
        return self._part_size

    @abstractmethod
    def _upload(self, number: int, part: memoryview | Pieces) -> Any:
        """Store part ``number``; return what :meth:`_finish` needs of it (one attempt)."""

    @abstractmethod
    def _finish(self, tokens: list[Any], size: int, crc32c: str) -> None:
        """Make one object of the parts; ``size``/``crc32c`` are of the whole (one attempt)."""

    @abstractmethod
    def _single(self, data: memoryview | Pieces, size: int, crc32c: str) -> None:
        """Store a small object in one request (one attempt); ``data`` may be in
        :class:`Pieces` (send them one after the other, see :class:`PartBody`)."""

    def _abort_upload(self, store: Host) -> None:
        """Best effort: drop what the parts left on the server (through ``store``,
        which makes one try per request)."""

    def _cleanup(self, tokens: list[Any]) -> None:
        """After :meth:`_finish`: remove what only the parts needed."""

    # -------------------------------------------------------------- streaming

    def _retry(self, op: str, fn: Any) -> Any:
        def attempt() -> Any:
            if self._aborted:  # stop retrying parts of a write being discarded
                raise StorageError(f"write of {self._path} was aborted")
            return fn()

        try:
            return self._store.retry.call(attempt, op=op, key=self._path, errors=self._backend)
        except FileNotFoundError as exc:
            # Not found, on a write: the bucket is gone (check_bucket raises
            # BucketNotFoundError), or the store forgot the upload (a restart).
            self._store.check_bucket()
            raise StorageError(f"{op} {self._path} failed: the store no longer knows this "
                               f"upload ({exc}); was it restarted? Save again") from exc

    def _reserve(self, n: int) -> None:
        if self._held == 0:
            # A thread that holds window bytes in another open writer must not wait:
            # only this thread can let those go.
            busy = getattr(_thread, "held", 0) > 0
            self._held = self._window.acquire(n, wait=not busy)
            _thread.held = getattr(_thread, "held", 0) + self._held

    def _give_up(self, n: int) -> None:
        """``n`` of the buffer's window bytes stop being this writer's (sent or freed)."""
        self._held -= n
        _thread.held = max(0, getattr(_thread, "held", 0) - n)

    def _release_held(self) -> None:
        """Give back the buffer's window bytes and its mapping, in one step."""
        held = self._held
        self._give_up(held)
        self._window.release(held, keep=self._buf.detach())

    def lend(self, data: Buffer) -> None:
        """Send ``data`` as it is, without a copy: kept while the object may go up in
        one request, and once it has outgrown one, every whole part that lies within
        ``data`` is sent as a view of it, and so are the bytes of it that complete a
        part begun before (that part goes up as the buffered bytes, copied, then the
        view: :class:`Pieces`); only the bytes left after the last whole part are
        copied, as :meth:`write` copies.
        Lent bytes hold window bytes as a buffer would, though they are not copies:
        the window also bounds what the process has in flight."""
        view = memoryview(data).cast("B")
        if self._fits(len(view)):
            self._keep(view)
        else:
            self._stream(view, lent=True)

    def _fits(self, n: int) -> bool:
        """Whether ``n`` more bytes keep the object among the pieces (one request)."""
        return self._pieces is not None and self._pieces_size + n < self._single_limit

    def _keep(self, view: memoryview) -> None:
        assert self._pieces is not None
        self._reserve(self._single_limit)
        self._pieces.append(view)
        self._pieces_size += len(view)

    def _to_buffer(self) -> None:
        """Copy the pieces kept so far into the buffer, from the window: the object is
        streamed as usual from now on."""
        pieces, self._pieces = self._pieces, None
        if pieces:
            for piece in pieces:
                self._buf.append(piece)

    def write(self, data: Buffer) -> None:
        self._stream(memoryview(data).cast("B"), lent=False)

    def _stream(self, view: memoryview, *, lent: bool) -> None:
        if not len(view):
            return
        if self._pieces is not None:
            if self._copied + len(view) <= self.SMALL_COPIES and self._fits(len(view)):
                self._keep(memoryview(bytes(view)))  # the caller may reuse its buffer
                self._copied += len(view)
                return
            self._to_buffer()
        if not self._started:
            self._reserve(self._single_limit)
            if len(self._buf) + len(view) < self._single_limit:
                self._buf.append(view)  # may still go up as one request
                return
            self._started = True
            self._retry("start upload", self._start)
        pos = 0
        while True:
            size = self.part_size_of(len(self._parts) + 1)
            if len(self._buf) >= size:  # held while it could still be a single request
                self._send(self._buf.copy(size))
            elif self._buf:  # top up the part being filled
                self._reserve(size)
                take = min(size - len(self._buf), len(view) - pos)
                if lent and len(self._buf) + take == size:
                    # what was buffered, then the lent bytes as they are: not copied
                    self._send(Pieces([self._buf.copy(capacity=size), view[pos:pos + take]]))
                    pos += take
                    continue
                self._buf.append(view[pos:pos + take])
                pos += take
                if len(self._buf) < size:
                    return
                self._send(self._buf.copy())
            elif len(view) - pos >= size:  # whole parts straight from the caller's buffer
                self._reserve(size)
                part = view[pos:pos + size]
                self._send(part if lent else part_copy(part, self._window))
                pos += size
            elif pos < len(view):
                self._reserve(size)
                self._buf.append(view[pos:])
                return
            else:
                return

    def _send(self, part: memoryview | Pieces) -> None:
        number = len(self._parts) + 1
        if self.MAX_PARTS is not None and number > self.MAX_PARTS:
            raise StorageError(
                f"{self._path} needs more than {self.MAX_PARTS} parts, the most one object may "
                "have here; raise the store's part_size")
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.IN_FLIGHT, thread_name_prefix="cloudckpt-part")
        # A part that failed for good fails the write now, not after the whole stream.
        for f in self._parts:
            if f.done() and f.exception() is not None:
                f.result()
        # Bound memory: wait for the oldest part when too many are in flight.
        pending = [f for f in self._parts if not f.done()]
        if len(pending) >= self.IN_FLIGHT:
            pending[0].result()
        # The part's bytes leave the buffer's share of the window with it: released
        # when it is stored (or fails, or is cancelled).
        held = min(self._held, len(part))
        self._give_up(held)
        exporter = _mapping_of(part)
        # The request holds the part's only view, dropped once it is over: a mapping
        # with a view left could not be unmapped when the window evicts it.
        holder = [part]
        del part
        future = self._pool.submit(self._retry, "upload part",
                                   lambda: self._upload(number, holder[0]))

        def done(f: Future[Any], n: int = held) -> None:
            holder.clear()
            sent = exporter is not None and not f.cancelled() and f.exception() is None
            self._window.release(n, keep=exporter if sent else None)  # sent: it serves again

        future.add_done_callback(done)
        self._parts.append(future)

    def commit(self, size: int, crc32c: str) -> None:
        if self._pieces is not None:
            data: memoryview | Pieces = Pieces(self._pieces)
            try:
                self._retry("put", lambda: self._single(data, size, crc32c))
            finally:
                self._pieces = None  # the caller's buffers are its own again
                self._release_held()
            return
        if not self._started:
            try:
                with self._buf.view() if len(self._buf) else memoryview(b"") as data:
                    self._retry("put", lambda: self._single(data, size, crc32c))
            finally:
                self._release_held()
            return
        if self._buf:
            self._send(self._buf.copy())
        self._release_held()
        tokens = [f.result() for f in self._parts]
        self._retry("finish upload", lambda: self._finish(tokens, size, crc32c))
        self._shutdown()
        self._cleanup(tokens)

    def abort(self) -> None:
        self._pieces = None
        self._release_held()
        self._aborted = True
        for f in self._parts:
            f.cancel()
        self._shutdown()
        if self._started:
            try:
                self._abort_upload(self._store.with_retry(ONE_TRY))
            except Exception:  # noqa: BLE001 - best effort; lifecycle rules clean up the rest
                pass
            self._started = False

    def _shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
