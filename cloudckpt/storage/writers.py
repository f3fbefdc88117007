"""Streamed writes: the caller's file-like writer and the backends' raw writers.

:class:`ObjectWriter` is what :meth:`Store.open_write` returns: it counts size and
CRC32C as data passes and hands the bytes to the backend's :class:`RawWriter`
(a multipart upload, a temporary file, or
:class:`~cloudckpt.storage.fsspec_backend.BufferedRawWriter`), which the Store's
backend opened. A :class:`RangeWriter` takes ranges at any offset
(:meth:`Store.open_write_at`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, TypeVar

from cloudckpt.storage.objects import ObjectInfo
from cloudckpt.storage.transfer.stopping import check_stop
from cloudckpt.util.crc import Buffer, Crc32c, nbytes

W = TypeVar("W", bound="CloseOnExit")


class RangeWriter(ABC):
    """An object written as ranges at any offset, in any order, from several threads
    (:meth:`Store.open_write_at`); it appears only on :meth:`commit`."""

    @abstractmethod
    def write_at(self, offset: int, data: Buffer) -> None: ...

    @abstractmethod
    def commit(self) -> None:
        """Make the object durable and visible (the caller has checked its bytes)."""

    @abstractmethod
    def abort(self) -> None:
        """Discard everything written; safe to call more than once."""


class RawWriter(ABC):
    """A backend's streamed upload: parts in, one object out on ``commit``."""

    @abstractmethod
    def write(self, data: Buffer) -> None: ...

    def lend(self, data: Buffer) -> None:
        """Like :meth:`write`, but the writer may send ``data`` itself, without a copy:
        the caller keeps it alive and unchanged until :meth:`commit` or :meth:`abort`
        returns. By default it is copied as any write is."""
        self.write(data)

    @abstractmethod
    def commit(self, size: int, crc32c: str) -> None:
        """Make the object durable and visible; ``size`` and ``crc32c`` (hex) are of
        everything written, for backends that have the server check them."""

    @abstractmethod
    def abort(self) -> None: ...


class CloseOnExit:
    """As a context manager: ``close()`` when the block succeeds, ``abort()`` when it
    raises, so a failed write never becomes a visible object.

    When a write itself failed (the bucket is gone, Ctrl-C) and the block ends in
    another error, the write's error is raised instead: serialisers such as
    ``torch.save`` report a failed ``write`` as their own ("unexpected pos"),
    hiding the cause.
    """

    #: The error the last ``write`` raised, if any.
    failure: BaseException | None = None

    def close(self) -> Any:
        raise NotImplementedError

    def abort(self) -> None:
        raise NotImplementedError

    def __enter__(self: W) -> W:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
            return
        self.abort()
        cause = self.failure
        if cause is not None and cause is not exc:
            raise cause


class ObjectWriter(CloseOnExit):
    """File-like streamed writer that counts size and CRC32C as data passes.

    The object becomes visible only on a clean :meth:`close`; leaving the
    ``with`` block by an exception discards it.
    """

    def __init__(self, raw: RawWriter, key: str) -> None:
        self.key = key
        self._raw = raw
        self._crc = Crc32c()
        self.info: ObjectInfo | None = None
        self.closed = False

    def write(self, data: Buffer, crc32c: int | None = None) -> int:
        """Write ``data``. ``crc32c``: its CRC32C where the caller computed it already
        (an int, as :func:`~cloudckpt.util.crc.crc32c_value` gives it), combined into
        the object's rather than computed again over the bytes."""
        return self._pass(data, self._raw.write, crc32c)

    def lend(self, data: Buffer, crc32c: int | None = None) -> int:
        """Write ``data``, which the upload may send as it is, without copying it: keep
        it alive and unchanged until the writer is closed (a tensor's bytes during a
        save). ``crc32c`` as for :meth:`write`."""
        return self._pass(data, self._raw.lend, crc32c)

    def _pass(self, data: Buffer, to: Any, crc32c: int | None) -> int:
        if self.closed:
            raise ValueError(f"write to closed writer for {self.key}")
        n = nbytes(data)
        if n:
            try:
                check_stop()  # the batch this write belongs to failed or was interrupted
                self._crc.add(data, crc32c)
                to(data)
            except BaseException as exc:
                self.failure = exc
                raise
        return n

    def writable(self) -> bool:
        return True

    def flush(self) -> None:
        """Nothing to do: parts go up as they fill, the object appears on close."""

    def close(self) -> ObjectInfo:
        """Finish the upload and return the object's info."""
        if self.closed:
            assert self.info is not None
            return self.info
        self.closed = True
        try:
            self._raw.commit(self._crc.size, self._crc.hexdigest())
        except BaseException:
            self._raw.abort()
            raise
        self.info = ObjectInfo(self.key, self._crc.size, self._crc.hexdigest())
        return self.info

    def abort(self) -> None:
        """Discard everything written so far."""
        if not self.closed:
            self.closed = True
            self._raw.abort()
