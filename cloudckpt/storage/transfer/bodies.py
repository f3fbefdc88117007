"""Request bodies over the caller's buffers: :class:`Pieces` (one object's bytes in
several buffers) and :class:`PartBody` (a file over them that HTTP clients stream),
so nothing is copied or joined to be sent."""

from __future__ import annotations

import bisect
import io
import itertools
from typing import Any

from cloudckpt.util.crc import Buffer, Crc32c


class _Length:
    """What aiohttp asks of ``getbuffer()``: a length, in a ``with`` block."""

    def __init__(self, n: int) -> None:
        self._n = n

    def __len__(self) -> int:
        return self._n

    def __enter__(self) -> _Length:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


class Pieces:
    """One object's bytes in several buffers, in order, never joined: what a
    :class:`PartWriter` sends in one request when it was lent the caller's buffers.
    ``len()`` is the number of bytes; :class:`PartBody` takes it as its segments."""

    def __init__(self, views: list[memoryview]) -> None:
        self.views = views
        self._size = sum(len(v) for v in views)

    def __len__(self) -> int:
        return self._size


def segments_of(data: Buffer | Pieces) -> list[memoryview]:
    """The byte views ``data`` is made of: one, or a :class:`Pieces`' several."""
    if isinstance(data, Pieces):
        return data.views
    return [memoryview(data).cast("B")]


def crc32c_hex_of(data: Buffer | Pieces) -> str:
    """The CRC32C of ``data``'s bytes, in hex, over its segments in turn."""
    crc = Crc32c()
    for view in segments_of(data):
        crc.update(view)
    return crc.hexdigest()


class PartBody(io.BytesIO):
    """A request body as a read-only in-memory file over the caller's buffers, one
    after the other (no copy, no concatenation). A BytesIO, so aiohttp streams it in
    chunks on its event loop (a bytes body it would copy whole; another file it would
    read through a thread per chunk).

    A read returns a view where the bytes lie in one segment, and stops short at the
    end of a large one rather than copy across it (as a file may; aiohttp and
    botocore read on until a read is empty); small segments (headers between
    tensors) are joined into one read."""

    #: A segment of at least this many bytes is read alone, as views of it.
    LARGE = 64 * 1024

    def __init__(self, *segments: Buffer | Pieces) -> None:
        super().__init__()
        self._views = [v for s in segments for v in segments_of(s) if len(v)]
        self._starts = list(itertools.accumulate((len(v) for v in self._views), initial=0))
        self._size = self._starts[-1]
        self._pos = 0

    def getbuffer(self) -> Any:
        return _Length(self._size)

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def _rest(self, i: int, pos: int) -> memoryview:
        """Segment ``i`` from ``pos`` (an offset in the whole body) on."""
        return self._views[i][pos - self._starts[i]:]

    def read(self, size: int | None = -1) -> bytes | memoryview:  # type: ignore[override]
        """Up to ``size`` bytes (all by default): a view where they lie in one segment
        (the buffers stay as they are until the request is over)."""
        if self._pos >= self._size:
            return b""
        if size is None or size < 0:
            size = self._size
        i = bisect.bisect_right(self._starts, self._pos) - 1
        rest = self._rest(i, self._pos)
        if len(rest) >= size or len(self._views[i]) >= self.LARGE:
            out: bytes | memoryview = rest[:size].toreadonly()
        else:  # a small piece: joined with the next ones, up to a large one
            pieces, n = [rest], len(rest)
            for view in self._views[i + 1:]:
                if n >= size or len(view) >= self.LARGE:
                    break
                pieces.append(view[:size - n])
                n += len(pieces[-1])
            out = b"".join(pieces)
        self._pos += len(out)
        return out

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        n = 0
        while n < len(out) and self._pos < self._size:
            i = bisect.bisect_right(self._starts, self._pos) - 1
            piece = self._rest(i, self._pos)[:len(out) - n]
            out[n:n + len(piece)] = piece
            n += len(piece)
            self._pos += len(piece)
        return n

    def __len__(self) -> int:
        return self._size
