"""The backend contract: what a :class:`~cloudckpt.storage.Store` holds and asks.

A Store is one class. It *holds* a backend: the object that talks to one service
(S3, GCS, local disk, ...). The Store does everything callers see once, for every
backend -- keys, retries, checksums, conditional-write recovery, batches, streamed
reads -- and asks the backend only for the primitives below, each one attempt on
full filesystem paths (``"bucket/prefix/key"``). Primitives may raise anything:
the backend's :meth:`Backend.classify` says what its exceptions mean, and the
Store's retry policy decides from that.

Most backends subclass :class:`~cloudckpt.storage.fsspec_backend.FsspecBackend`,
which implements every primitive it can over an fsspec filesystem; the protocol
here is what a backend must offer however it is built. A backend is constructed
as ``Backend(root, *, protocol=None, storage_options=None, max_concurrency=16)``
(as ``FsspecBackend`` is) and found by URL scheme through the registry
(:func:`~cloudckpt.storage.register_backend`, or an entry point in the group
``cloudckpt.backends``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, ClassVar, Protocol, TypeVar

from cloudckpt.storage.objects import ObjectInfo
from cloudckpt.storage.retry import Classified, Classifier, Failure, RetryPolicy
from cloudckpt.storage.transfer.window import ByteWindow
from cloudckpt.storage.writers import RangeWriter, RawWriter
from cloudckpt.util.crc import Buffer

__all__ = ["Backend", "Classified", "Classifier", "Failure", "Host"]

T = TypeVar("T")


class Host(Protocol):
    """The store a backend's streamed writer or server-side copy works for: what
    they may use of it (all public :class:`~cloudckpt.storage.Store` API)."""

    root: str
    retry: RetryPolicy
    part_size: int
    max_concurrency: int
    upload_window: ByteWindow

    def map(self, fn: Callable[[Any], T], items: Sequence[Any]) -> list[T]: ...

    def delete(self, keys: Iterable[str]) -> None: ...

    def check_bucket(self) -> None: ...

    def with_retry(self, retry: RetryPolicy) -> Host: ...


class Backend(Protocol):
    """One service's primitives, on full paths, one attempt each."""

    #: The canonical URL scheme the backend was opened under (``"s3"`` for s3a://).
    protocol: str
    #: The root of the store it was opened for, as the filesystem names it; the
    #: store's children share the backend (and e.g. the local one stays inside it).
    root: str
    #: The filesystem's options, checked (the backend's own taken out).
    storage_options: dict[str, Any]
    #: Whether conditional writes are enforced by the server (else the backend
    #: emulates them in :meth:`put_if_absent` itself, and nothing is probed).
    native_conditional_writes: ClassVar[bool]
    #: Whether :meth:`open_range_writer` works: ranges in any order, in parallel.
    ranged_writes: ClassVar[bool]
    #: The version token the conditional-write probe's compare-and-swap goes
    #: against (one no object has); None: the writes cannot fail to be enforced
    #: (local disk, memory) and are never probed.
    probe_stale_version: ClassVar[str | None]

    def __init__(self, root: str, *, protocol: str | None = None,
                 storage_options: Mapping[str, Any] | None = None,
                 max_concurrency: int = ...) -> None:
        """How the Store builds the backend it holds (``storage_options`` checked by
        the backend; ``max_concurrency`` the requests kept in flight)."""

    # ------------------------------------------------------------------ naming

    def rooted(self, root: str) -> Backend:
        """This backend (same filesystem and options) for a store rooted at ``root``
        (a filesystem path), which may lie above the one it was opened for."""

    def uri_of(self, root: str) -> str:
        """The URI of a store rooted at ``root``, as a user would write it."""

    def strip_protocol(self, name: str) -> str:
        """A name from a listing as the filesystem's path (no scheme)."""

    def cache_key(self, root: str) -> tuple[str, ...]:
        """What a probe result for a store at ``root`` is cached under: the backend,
        its options, the bucket."""

    def is_hidden(self, path: str) -> bool:
        """Whether ``path`` is bookkeeping (temporaries, parts), hidden from listings."""

    # ------------------------------------------------------------------- reads

    def get(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        """The object's bytes, or ``[start, end)`` of them."""

    def iter_range(self, path: str, start: int, end: int, chunk: int) -> Iterator[bytes]:
        """Bytes ``[start, end)`` in pieces of at most ``chunk`` bytes (fewer where
        the object ends sooner)."""

    def get_versioned(self, path: str) -> tuple[bytes, str]:
        """The whole object and its version token."""

    def head(self, path: str) -> dict[str, Any] | None:
        """The object's listing entry (``size``, ...), None if it does not exist."""

    def version_of(self, info: Mapping[str, Any]) -> str | None:
        """The version token in a listing entry, if it has one."""

    def find(self, path: str) -> dict[str, dict[str, Any]]:
        """Every object below ``path``, recursively: name -> listing entry."""

    def ls_dirs(self, path: str) -> list[str]:
        """The names of the immediate sub-prefixes of ``path``."""

    def bucket_exists(self, root: str) -> bool | None:
        """Whether the bucket of a store at ``root`` exists; None where that means
        nothing (local paths) or cannot be told."""

    def bucket_versioning(self, root: str) -> str:
        """Whether the bucket of a store at ``root`` keeps the versions of what is
        overwritten or deleted: one of :mod:`.versioning`'s ``"enabled"``,
        ``"suspended"``, ``"off"`` (local paths: nothing keeps them) or ``"unknown"``
        (the service cannot say). Asked once per bucket and process."""

    # ------------------------------------------------------------------ writes

    def put(self, path: str, data: Buffer) -> str | None:
        """Write a whole object (overwriting); its version token if cheaply known."""

    def put_checked(self, path: str, data: Buffer, crc32c: str) -> str | None:
        """:meth:`put` given the CRC32C (hex) of ``data``, for the server to check."""

    def put_if_absent(self, path: str, data: Buffer) -> str:
        """Create ``path`` only if it does not exist; ``FileExistsError`` otherwise."""

    def put_if_match(self, path: str, data: Buffer, version: str) -> str:
        """Replace ``path`` only if its version is ``version``; ``FileExistsError``
        otherwise (a vanished object included)."""

    def delete(self, paths: list[str], root: str) -> None:
        """Delete objects (missing ones are no error); ``root`` is the deleting
        store's, the highest directory a backend with real ones may remove once empty."""

    def open_writer(self, path: str, host: Host) -> RawWriter:
        """A streamed writer of a large object, made visible only by ``commit``."""

    def open_range_writer(self, path: str, size: int) -> RangeWriter:
        """A writer of ranges in any order (only where :attr:`ranged_writes`)."""

    # ------------------------------------------------------------------ copies

    def can_copy_from(self, other: Backend) -> bool:
        """Whether :meth:`copy` can copy objects of ``other`` on the server."""

    def copy(self, src_path: str, path: str, size: int, host: Host) -> ObjectInfo:
        """Copy ``src_path`` (of a backend :meth:`can_copy_from` accepted) to ``path``
        on the server; its size and CRC32C as the server reports them (``crc32c``
        None where it gives no whole-object one). Retries each request itself,
        under ``host.retry``."""

    # ------------------------------------------------------------------ errors

    def classify(self, exc: BaseException) -> Classified | None:
        """What one exception of a failure's chain is, in this backend's knowledge:
        its HTTP status and error code, and a :class:`Failure` where the status
        alone does not tell. None: nothing to say (the generic rules decide)."""
