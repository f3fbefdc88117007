"""The backends' common base: every primitive of the
:class:`~cloudckpt.storage.backend.Backend` protocol that an fsspec filesystem
offers, and the construction every backend shares.

A backend subclasses :class:`FsspecBackend`. It names its URL schemes
(:attr:`~FsspecBackend.protocols`), builds its filesystem (``_filesystem``) from
the storage options it checked (``_read_options``), and implements the abstract
primitives on full filesystem paths. Primitives may raise any exception; the
backend's ``classify`` says what they mean, and the Store holding the backend
retries and wraps them.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar, TypeVar

import fsspec

from cloudckpt.errors import ConfigError
from cloudckpt.names import is_hidden
from cloudckpt.storage import versioning
from cloudckpt.storage.backend import Backend, Host
from cloudckpt.storage.objects import ObjectInfo
from cloudckpt.storage.options import DEFAULT_CONCURRENCY, check_filesystem_options
from cloudckpt.storage.retry import Classified, RetryPolicy
from cloudckpt.storage.writers import RangeWriter, RawWriter
from cloudckpt.util.crc import Buffer

B = TypeVar("B", bound="FsspecBackend")


class FsspecBackend(ABC):
    """A :class:`~cloudckpt.storage.backend.Backend` over an fsspec filesystem.

    ``root`` is the store's root without the scheme; ``protocol`` the scheme it is
    opened under (one of :attr:`protocols`; required only where the backend serves
    any scheme); ``storage_options`` the filesystem's options and the backend's
    own, checked by ``_read_options``; ``max_concurrency`` the requests the store
    keeps in flight (for the filesystem's connection pool).
    """

    #: The URL schemes the backend serves, its canonical one first (the one its URIs
    #: are written with). Empty: any scheme, named by the ``protocol`` keyword.
    protocols: ClassVar[tuple[str, ...]] = ()
    native_conditional_writes: ClassVar[bool] = False
    ranged_writes: ClassVar[bool] = False
    probe_stale_version: ClassVar[str | None] = None

    def __init__(self, root: str, *, protocol: str | None = None,
                 storage_options: Mapping[str, Any] | None = None,
                 max_concurrency: int = DEFAULT_CONCURRENCY) -> None:
        self.protocol = self._protocol_of(protocol)
        self.root = self._root_of(root).rstrip("/")
        self.max_concurrency = max_concurrency
        options = dict(storage_options or {})
        self.storage_options = self._read_options(protocol or self.protocol, options)
        self.fs = self._filesystem(self.storage_options)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri_of(self.root)!r})"

    # ------------------------------------------------------------ construction
    # __init__ calls these, in this order.

    @classmethod
    def _protocol_of(cls, protocol: str | None) -> str:
        """The backend's protocol given the ``protocol`` keyword: the canonical one of
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

    # ------------------------------------------------------------------ naming

    def rooted(self: B, root: str) -> B:
        new = copy.copy(self)
        new.root = root
        return new

    def uri_of(self, root: str) -> str:
        if self.protocol in ("file", ""):
            return root
        return f"{self.protocol}://{root}"

    def strip_protocol(self, name: str) -> str:
        return name.split("://", 1)[1] if "://" in name else name

    def cache_key(self, root: str) -> tuple[str, ...]:
        return (type(self).__name__, repr(sorted(self.storage_options.items())),
                root.split("/", 1)[0])

    def is_hidden(self, path: str) -> bool:
        # Writer claims, temporary files and upload parts: bookkeeping, on every backend.
        return is_hidden(path)

    # -------------------------------------------------------------- primitives

    @abstractmethod
    def put(self, path: str, data: Buffer) -> str | None: ...

    def put_checked(self, path: str, data: Buffer, crc32c: str) -> str | None:
        # Backends whose server can verify the CRC32C override this (S3, GCS).
        return self.put(path, data)

    def get(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        data: bytes = self.fs.cat_file(path, start=start, end=end)
        return data

    @abstractmethod
    def put_if_absent(self, path: str, data: Buffer) -> str: ...

    @abstractmethod
    def put_if_match(self, path: str, data: Buffer, version: str) -> str: ...

    @abstractmethod
    def get_versioned(self, path: str) -> tuple[bytes, str]: ...

    def head(self, path: str) -> dict[str, Any] | None:
        self.fs.invalidate_cache(path)
        try:
            info = self.fs.info(path)
        except FileNotFoundError:
            return None
        return info if info.get("type") == "file" else None

    def find(self, path: str) -> dict[str, dict[str, Any]]:
        self.fs.invalidate_cache(path)
        try:
            found: dict[str, dict[str, Any]] = self.fs.find(path, detail=True)
            return found
        except FileNotFoundError:
            return {}

    def ls_dirs(self, path: str) -> list[str]:
        self.fs.invalidate_cache(path)
        try:
            entries = self.fs.ls(path, detail=True)
        except FileNotFoundError:
            return []
        return [e["name"] for e in entries if e.get("type") == "directory"]

    def delete(self, paths: list[str], root: str) -> None:
        for p in paths:
            try:
                self.fs.rm_file(p)
            except FileNotFoundError:
                pass

    def open_writer(self, path: str, host: Host) -> RawWriter:
        """Here: everything buffered, then one retried put on commit."""
        return BufferedRawWriter(self, path, host.retry)

    def version_of(self, info: Mapping[str, Any]) -> str | None:
        return None

    def bucket_exists(self, root: str) -> bool | None:
        return None

    def bucket_versioning(self, root: str) -> str:
        return versioning.UNKNOWN

    def iter_range(self, path: str, start: int, end: int, chunk: int) -> Iterator[bytes]:
        """This default sends one ranged read per piece; backends that can stream one
        response body do so."""
        for s in range(start, end, chunk):
            data = self.get(path, s, min(s + chunk, end))
            yield data
            if len(data) < min(chunk, end - s):
                return  # the object ends here; the caller sees the read was short

    def can_copy_from(self, other: Backend) -> bool:
        return False

    def copy(self, src_path: str, path: str, size: int, host: Host) -> ObjectInfo:
        raise NotImplementedError(f"{type(self).__name__} has no server-side copy")

    def open_range_writer(self, path: str, size: int) -> RangeWriter:
        raise NotImplementedError(f"{type(self).__name__} takes no ranged writes")

    def same_service(self, other: Backend) -> bool:
        """Whether ``other`` reaches the same service with the same credentials:
        the same backend, and the same filesystem or the same options for one."""
        return type(other) is type(self) and (
            getattr(other, "fs", None) is self.fs
            or other.storage_options == self.storage_options)

    def classify(self, exc: BaseException) -> Classified | None:
        """Nothing beyond the generic rules (see :mod:`.retry`)."""
        return None


class BufferedRawWriter(RawWriter):
    """Collect everything, then one retried ``put_checked`` on commit.

    Right for backends without a cheaper multipart path; memory use is the
    object's size.
    """

    def __init__(self, backend: Backend, path: str, retry: RetryPolicy) -> None:
        self._backend = backend
        self._path = path
        self._retry = retry
        self._buf = bytearray()

    def write(self, data: Buffer) -> None:
        self._buf += data

    def commit(self, size: int, crc32c: str) -> None:
        data = bytes(self._buf)
        self._buf = bytearray()
        self._retry.call(lambda: self._backend.put_checked(self._path, data, crc32c),
                         op="put", key=self._path, errors=self._backend)

    def abort(self) -> None:
        self._buf = bytearray()
