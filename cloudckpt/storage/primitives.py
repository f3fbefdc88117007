"""What a backend implements: the primitives a :class:`~cloudckpt.storage.Store` is
built on, with defaults over any fsspec filesystem, and the hooks of the one
constructor every backend shares.

A backend is a ``Store`` subclass. It names its URL schemes (:attr:`protocols`),
builds its filesystem (:meth:`_filesystem`) from the storage options it checked
(:meth:`_read_options`), and implements the abstract primitives below on full
filesystem paths. Primitives may raise any exception; the public methods of the
Store classify, retry and wrap them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import fsspec

from cloudckpt.errors import ConfigError
from cloudckpt.names import is_hidden
from cloudckpt.storage.objects import ObjectInfo
from cloudckpt.storage.options import check_filesystem_options
from cloudckpt.storage.writers import RangeWriter, RawWriter
from cloudckpt.util.crc import Buffer

if TYPE_CHECKING:
    from cloudckpt.storage.base import Store


class StorePrimitives(ABC):
    """The backend's half of a :class:`~cloudckpt.storage.Store`."""

    #: The URL schemes the backend serves, its canonical one first (the one its URIs
    #: are written with). Empty: any scheme, named by the ``protocol`` keyword.
    protocols: ClassVar[tuple[str, ...]] = ()
    #: Whether conditional writes are enforced by the server (vs. emulated).
    native_conditional_writes: ClassVar[bool] = False
    #: Whether :meth:`open_write_at` works: ranges written in any order, in parallel.
    ranged_writes: ClassVar[bool] = False

    fs: fsspec.AbstractFileSystem
    root: str
    protocol: str
    storage_options: dict[str, Any]

    # ------------------------------------------------------------ construction
    # Store.__init__ calls these, in this order, before the store is used.

    @classmethod
    def _protocol_of(cls, protocol: str | None) -> str:
        """The store's protocol given the ``protocol`` keyword: the canonical one of
        :attr:`protocols` (which ``protocol`` must be one of, when given)."""
        if not cls.protocols:
            if not protocol:
                raise ConfigError(f"{cls.__name__} needs protocol=..., the fsspec protocol "
                                  "of its filesystem (e.g. 'abfs')")
            return protocol
        if protocol is not None and protocol not in cls.protocols:
            raise ConfigError(f"{cls.__name__} serves "
                              f"{', '.join(p + '://' for p in cls.protocols)}, not {protocol}://")
        return cls.protocols[0]

    def _root_of(self, root: str) -> str:
        """The root prefix as the filesystem names it (trailing '/' stripped after)."""
        return root

    @classmethod
    def filesystem_options(cls) -> frozenset[str] | None:
        """The storage option names the backend's filesystem takes (None: any)."""
        return None

    def _read_options(self, scheme: str, options: dict[str, Any]) -> dict[str, Any]:
        """Check the storage options (cloudckpt's own taken out already), take out
        those the backend reads itself, and return the filesystem's. ``scheme`` is
        the protocol as the caller gave it, for messages. By default, names must be
        among :meth:`filesystem_options`; ConfigError otherwise."""
        check_filesystem_options(scheme, options, self.filesystem_options())
        return options

    @abstractmethod
    def _filesystem(self, options: dict[str, Any]) -> fsspec.AbstractFileSystem:
        """The filesystem, built from the options :meth:`_read_options` returned
        (``self.root``, ``self.protocol``, ``self.max_concurrency`` are set)."""

    def _ready(self) -> None:
        """Last step of construction: backend state beyond the filesystem (none by
        default; the local backend records the root its children stay inside)."""
        return None

    # -------------------------------------------------------------- primitives

    @abstractmethod
    def _put(self, path: str, data: Buffer) -> str | None:
        """Write a whole object; return its version token if cheaply known."""

    def _put_checked(self, path: str, data: Buffer, crc32c: str) -> str | None:
        """``_put`` given the CRC32C (hex) the caller computed; backends that can
        have the server verify it override this (S3 does)."""
        return self._put(path, data)

    def _get(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        return self.fs.cat_file(path, start=start, end=end)

    @abstractmethod
    def _put_if_absent(self, path: str, data: Buffer) -> str:
        """Create ``path`` only if it does not exist; FileExistsError otherwise."""

    @abstractmethod
    def _put_if_match(self, path: str, data: Buffer, version: str) -> str:
        """Replace ``path`` only if its version is ``version``; FileExistsError otherwise."""

    @abstractmethod
    def _get_versioned(self, path: str) -> tuple[bytes, str]:
        """Read a whole object together with its version token."""

    def _head(self, path: str) -> dict[str, Any] | None:
        self.fs.invalidate_cache(path)
        try:
            info = self.fs.info(path)
        except FileNotFoundError:
            return None
        return info if info.get("type") == "file" else None

    def _find(self, path: str) -> dict[str, dict[str, Any]]:
        self.fs.invalidate_cache(path)
        try:
            return self.fs.find(path, detail=True)
        except FileNotFoundError:
            return {}

    def _ls_dirs(self, path: str) -> list[str]:
        self.fs.invalidate_cache(path)
        try:
            entries = self.fs.ls(path, detail=True)
        except FileNotFoundError:
            return []
        return [e["name"] for e in entries if e.get("type") == "directory"]

    def _delete(self, paths: list[str]) -> None:
        for p in paths:
            try:
                self.fs.rm_file(p)
            except FileNotFoundError:
                pass

    @abstractmethod
    def _open_writer(self, path: str) -> RawWriter:
        """A writer for a large object, made durable only by ``commit()``."""

    def _version_of(self, info: Mapping[str, Any]) -> str | None:
        return None

    def _bucket_exists(self) -> bool | None:
        """Whether the store's bucket exists (one request); None where that means
        nothing (local paths) or cannot be told."""
        return None

    def _hidden(self, path: str) -> bool:
        # Writer claims, temporary files and upload parts: bookkeeping, on every backend.
        return is_hidden(path)

    def _probe_conditionals(self) -> str:
        """Try create-only and compare-and-swap writes on a probe object (one attempt;
        the store's retry policy wraps it) and say whether the server enforced them:
        :data:`~.conditional.NATIVE`, ``IGNORED`` or ``REFUSED``. Here: stores whose
        conditional writes cannot fail to be enforced (local, memory)."""
        return "native"

    def _iter_range(self, path: str, start: int, end: int, chunk: int) -> Iterator[bytes]:
        """Bytes ``[start, end)`` of ``path`` in pieces of at most ``chunk`` bytes (one
        attempt). This default sends one ranged read per piece; backends that can
        stream one response body do so."""
        for s in range(start, end, chunk):
            data = self._get(path, s, min(s + chunk, end))
            yield data
            if len(data) < min(chunk, end - s):
                return  # the object ends here; the caller sees the read was short

    def _copy(self, src_path: str, path: str, size: int) -> ObjectInfo:
        """Copy ``src_path`` (of a store :meth:`can_copy_from` accepted) to ``path``
        on the server. Returns the copy's size and CRC32C as the server reports
        them (``crc32c`` None where it reports no whole-object CRC32C). A copy can
        be many requests: this retries each itself, under :attr:`retry`."""
        raise NotImplementedError(f"{type(self).__name__} has no server-side copy")

    def _open_range_writer(self, path: str, size: int) -> RangeWriter:
        """A writer taking ranges of a ``size``-byte object in any order (only where
        :attr:`ranged_writes` is set)."""
        raise NotImplementedError(f"{type(self).__name__} takes no ranged writes")

    def _same_service(self, other: Store) -> bool:
        """Whether ``other`` reaches the same service with the same credentials:
        the same backend, and the same filesystem or the same options for one."""
        return type(other) is type(self) and (
            other.fs is self.fs or other.storage_options == self.storage_options)
