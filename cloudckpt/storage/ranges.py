"""Ranged reads streamed to a sink a piece at a time, resumed where they stopped.

:class:`RangeReadMixin` gives every :class:`~cloudckpt.storage.Store` its
``read_range_to``, on top of the backend's ``iter_range`` (one S3 or GCS GET
read as it arrives; ranged reads of a piece elsewhere). :func:`read_upto` reads
the pieces of a streamed response body.
"""

from __future__ import annotations

import bisect
import itertools
import logging
from collections.abc import Callable, Sequence
from typing import Any

from cloudckpt.errors import CloudCkptError, ConfigError, StorageError
from cloudckpt.storage.backend import Backend
from cloudckpt.storage.retry import describe, is_transient, status_of
from cloudckpt.util.crc import Crc32c

log = logging.getLogger("cloudckpt.storage")

#: Bytes of a response body held at once while it is copied into a caller's buffer.
READ_PIECE = 2 << 20


class _SinkError(CloudCkptError):
    """Carries a failure of a :meth:`Store.read_range_to` sink through the retry
    loop untouched (it is the caller's, not the store's)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


class _Resume(_SinkError):
    """A transient failure of a ranged read after progress: resumed where it
    stopped, under a fresh retry budget."""


class RangeReadMixin:
    """``read_range_to`` over the store's ``path``, ``backend``, ``_call`` and
    ``key_uri`` (see base.py)."""

    backend: Backend

    def read_range_to(self, key: str, start: int, end: int,
                      sink: Callable[[int, bytes], Any], *, chunk: int = 8 << 20) -> None:
        """Stream bytes ``[start, end)`` of ``key`` into ``sink(offset, data)``, in
        order, in pieces of at most ``chunk`` bytes: memory holds one piece, however
        long the range. A transient failure resumes at the first byte not yet given
        to ``sink``; one that comes after progress gets a fresh retry budget (a long
        range is not one short operation). ``EOFError`` if the object ends before
        ``end``; an exception raised by ``sink`` stops the read and passes through
        unchanged.
        """
        if start < 0 or end < start or chunk < 1:
            raise ConfigError(f"invalid byte range [{start}, {end}) for {key}")
        path = self.path(key)
        pos = start

        def attempt() -> None:
            nonlocal pos
            first = pos
            pieces = self.backend.iter_range(path, pos, end, min(chunk, end - pos))
            try:
                for data in pieces:
                    if not data:
                        continue
                    if len(data) > end - pos:
                        raise StorageError(f"{self.key_uri(key)}: the store sent more bytes "
                                           f"than the range [{start}, {end}) asked for")
                    try:
                        sink(pos, data)
                    except BaseException as exc:
                        raise _SinkError(exc) from exc
                    pos += len(data)
            except _SinkError:
                raise
            except Exception as exc:
                if status_of(exc, self.backend) == 416:  # shorter than the range
                    raise EOFError(f"{self.key_uri(key)} ends before byte {end}") from exc
                if pos > first and is_transient(exc, self.backend):
                    raise _Resume(exc) from exc
                raise
            finally:
                close = getattr(pieces, "close", None)
                if close is not None:
                    close()
            if pos < end:
                raise EOFError(f"short read of {self.key_uri(key)} [{start}, {end}): the "
                               f"object ends at byte {pos}")

        failure: BaseException | None = None
        while pos < end:
            try:
                self._call(attempt, "get_range", key)
            except _Resume as exc:
                log.warning("resuming get_range %s at byte %d of [%d, %d) after: %s",
                            self.key_uri(key), pos, start, end,
                            describe(exc.error, self.backend))
            except _SinkError as exc:
                failure = exc.error
                break
        if failure is not None:
            raise failure  # outside the handler: the sink's error, as it was raised

    def read_range_into(self, key: str, start: int, outs: Sequence[Any]) -> int:
        """Fill the writable buffers ``outs`` in turn with the bytes of ``key`` from
        ``start`` on (one ranged read, resumed like :meth:`read_range_to`), with no
        buffer of its own beyond a network piece; return the CRC32C value of the
        bytes read, computed as they arrive. ``EOFError`` if the object is shorter.
        """
        views = [memoryview(o).cast("B") for o in outs]
        total = sum(v.nbytes for v in views)
        if total == 0:
            return 0
        readinto = getattr(self.backend, "readinto_range", None)
        if readinto is not None:  # a local file: straight into the buffers
            path = self.path(key)
            self._call(lambda: readinto(path, start, views), "get_range", key)
            crc = Crc32c()
            for v in views:
                crc.update(v)
            return crc.value
        crc = Crc32c()
        bounds = list(itertools.accumulate((v.nbytes for v in views), initial=0))

        def sink(offset: int, data: bytes) -> None:
            crc.update(data)
            pos, got = offset - start, memoryview(data)
            i = bisect.bisect_right(bounds, pos) - 1
            while got.nbytes:
                at = pos - bounds[i]
                n = min(got.nbytes, views[i].nbytes - at)
                views[i][at:at + n] = got[:n]
                got, pos, i = got[n:], pos + n, i + 1

        self.read_range_to(key, start, start + total, sink, chunk=READ_PIECE)
        return crc.value


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
