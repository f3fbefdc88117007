"""The Store: one object over an fsspec filesystem and a root prefix.

A Store speaks in *keys*, paths relative to its root (``"step-10/a.bin"``).
Backends implement a handful of primitives (``_put``, ``_get``, the two
conditional writes, a streamed writer); everything a caller uses — retries,
checksums, parallel batches, key validation — lives here once.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import fsspec

from ..crc import Buffer, Crc32c, crc32c_hex
from ..errors import (
    AccessDeniedError,
    BucketNotFoundError,
    CloudCkptError,
    CommitConflictError,
    ConfigError,
    StorageError,
)
from ..names import is_hidden
from .retry import RetryPolicy, describe, is_transient, status_of

log = logging.getLogger("cloudckpt.storage")

T = TypeVar("T")

#: Default number of requests a batch keeps in flight.
DEFAULT_CONCURRENCY = 16
#: Default part size of streamed (multipart) writes.
DEFAULT_PART_SIZE = 16 * 1024 * 1024


@dataclass(frozen=True)
class ObjectInfo:
    """What the store knows about one object. ``version`` is the CAS token."""

    key: str
    size: int
    crc32c: str | None = None
    version: str | None = None
    mtime: float | None = None


def validate_key(key: str) -> str:
    """Refuse keys that could leave the store's root or are not plain relative paths."""
    if not isinstance(key, str) or not key:
        raise ConfigError(f"invalid object key {key!r}: must be a non-empty string")
    if "://" in key or key.startswith("/") or "\\" in key or "\x00" in key:
        raise ConfigError(f"invalid object key {key!r}: must be a relative POSIX path")
    parts = key.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise ConfigError(f"invalid object key {key!r}: empty, '.' or '..' path component")
    return key


def join_key(*parts: str) -> str:
    """Join key parts with '/', ignoring empty ones."""
    return "/".join(p.strip("/") for p in parts if p and p.strip("/"))


class Store(ABC):
    """Objects under one root prefix of one filesystem.

    Subclasses set :attr:`protocols` and implement the primitives; see the
    backend modules in this package. Instances are cheap and thread-safe;
    :meth:`child` makes a store rooted at a sub-prefix sharing the same pool.
    """

    protocols: ClassVar[tuple[str, ...]] = ()
    #: Whether conditional writes are enforced by the server (vs. emulated).
    native_conditional_writes: ClassVar[bool] = False
    #: Whether :meth:`open_write_at` works: ranges written in any order, in parallel.
    ranged_writes: ClassVar[bool] = False

    def __init__(
        self,
        fs: fsspec.AbstractFileSystem,
        root: str,
        *,
        protocol: str,
        retry: RetryPolicy | None = None,
        max_concurrency: int = DEFAULT_CONCURRENCY,
        part_size: int = DEFAULT_PART_SIZE,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        if max_concurrency < 1:
            raise ConfigError("max_concurrency must be >= 1")
        self.fs = fs
        self.root = root.rstrip("/")
        self.protocol = protocol
        self.retry = retry or RetryPolicy()
        self.max_concurrency = max_concurrency
        self.part_size = part_size
        self.storage_options: dict[str, Any] = dict(storage_options or {})
        # One pool per root store, shared by its children (see child()).
        self._pool_holder: dict[str, Any] = {"pool": None, "lock": threading.Lock()}

    def __getstate__(self) -> dict[str, Any]:
        # Picklable (for process-based async saves): the pool is rebuilt on use.
        state = dict(self.__dict__)
        state["_pool_holder"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._pool_holder = {"pool": None, "lock": threading.Lock()}

    @classmethod
    def filesystem_options(cls) -> frozenset[str] | None:
        """The storage option names the backend's filesystem takes (None: any)."""
        return None

    # ------------------------------------------------------------------ naming

    @property
    def uri(self) -> str:
        """The URI of the store's root, as a user would write it."""
        if self.protocol in ("file", ""):
            return self.root
        return f"{self.protocol}://{self.root}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri!r})"

    def path(self, key: str) -> str:
        """The filesystem path of ``key`` (for fsspec calls)."""
        return f"{self.root}/{validate_key(key)}"

    def key_uri(self, key: str) -> str:
        """The full URI of ``key``, for messages."""
        return f"{self.uri}/{key}" if key else self.uri

    def with_retry(self, retry: RetryPolicy) -> Store:
        """This store with another retry policy (sharing filesystem and pool)."""
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        new.retry = retry
        return new

    def child(self, prefix: str) -> Store:
        """A store rooted at ``prefix`` below this one, sharing filesystem and pool."""
        if not prefix:
            return self
        validate_key(prefix.strip("/"))
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        new.root = f"{self.root}/{prefix.strip('/')}"
        return new

    # -------------------------------------------------------------- primitives
    # Backends implement these on full filesystem paths. They may raise any
    # exception; the public methods below classify, retry and wrap them.

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

    # ----------------------------------------------------------- public API

    def _call(self, fn: Callable[[], T], op: str, key: str) -> T:
        return self.retry.call(fn, op=op, key=self.key_uri(key))

    def _write(self, fn: Callable[[], T], op: str, key: str) -> T:
        # On a write, "not found" can only mean the bucket (or container) is missing.
        try:
            return self._call(fn, op, key)
        except FileNotFoundError as exc:
            raise BucketNotFoundError(
                f"{op} {self.key_uri(key)} failed: the bucket does not exist ({exc}); "
                "create it first or fix the URI"
            ) from exc

    def check_bucket(self) -> None:
        """Raise :class:`BucketNotFoundError` if the store's bucket does not exist.

        Reads cannot tell a missing bucket from an empty prefix (both list nothing);
        callers ask this once a read found nothing, so a typo in a bucket name is not
        reported as "no checkpoints"."""
        try:
            exists = self._call(self._bucket_exists, "head bucket", "")
        except AccessDeniedError:
            # Asking about the bucket takes a permission (s3:ListBucket unscoped, GCS
            # storage.buckets.get) that prefix-scoped roles lack: then it is unknown.
            return
        if exists is False:
            bucket = self.root.split("/", 1)[0]
            raise BucketNotFoundError(
                f"the bucket {self.protocol}://{bucket} does not exist (reading {self.uri}); "
                "check the bucket name, the endpoint and the account or project")

    def put(self, key: str, data: Buffer) -> ObjectInfo:
        """Write a whole object (overwriting) and return its size and CRC32C."""
        path = self.path(key)
        crc = crc32c_hex(data)
        version = self._write(lambda: self._put_checked(path, data, crc), "put", key)
        return ObjectInfo(key, _nbytes(data), crc, version)

    def get(self, key: str) -> bytes:
        """Read a whole object. ``FileNotFoundError`` if missing."""
        path = self.path(key)
        return self._call(lambda: self._get(path), "get", key)

    def get_range(self, key: str, start: int, end: int) -> bytes:
        """Read bytes ``[start, end)`` of an object."""
        if start < 0 or end < start:
            raise ConfigError(f"invalid byte range [{start}, {end}) for {key}")
        if end == start:
            return b""
        path = self.path(key)

        def fetch() -> bytes:
            try:
                return self._get(path, start, end)
            except Exception as exc:
                if status_of(exc) == 416:  # the object is shorter than the range
                    raise EOFError(f"{self.key_uri(key)} ends before byte {end}") from exc
                raise

        data = self._call(fetch, "get_range", key)
        if len(data) != end - start:
            raise EOFError(
                f"short read of {self.key_uri(key)} [{start}, {end}): got {len(data)} bytes"
            )
        return data

    def get_upto(self, key: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of ``key``, fewer (or none) where it ends sooner: one
        request, retried like any read. For bounded reads of objects whose size is not
        trusted (:meth:`get_range` insists on the whole range)."""
        if start < 0 or end < start:
            raise ConfigError(f"invalid byte range [{start}, {end}) for {key}")
        path = self.path(key)

        def fetch() -> bytes:
            try:
                return bytes(self._get(path, start, end))
            except Exception as exc:
                if status_of(exc) == 416:  # the object ends before ``start``
                    return b""
                raise

        return self._call(fetch, "get", key)

    def info(self, key: str) -> ObjectInfo | None:
        """Size and version of ``key``, or None if it does not exist."""
        path = self.path(key)
        raw = self._call(lambda: self._head(path), "head", key)
        if raw is None:
            return None
        return ObjectInfo(key, int(raw.get("size") or 0), None, self._version_of(raw))

    def exists(self, key: str) -> bool:
        return self.info(key) is not None

    def size(self, key: str) -> int:
        info = self.info(key)
        if info is None:
            raise FileNotFoundError(self.key_uri(key))
        return info.size

    def list(self, prefix: str = "", *, internal: bool = False) -> list[ObjectInfo]:
        """Every object below ``prefix`` (recursively), sorted by key; with
        ``internal`` also the backend's hidden files (temporaries, parts)."""
        base = self.path(prefix.strip("/")) if prefix.strip("/") else self.root
        found = self._call(lambda: self._find(base), "list", prefix)
        out = []
        for name, raw in found.items():
            if raw.get("type", "file") != "file" or (self._hidden(name) and not internal):
                continue
            key = self._key_of(name)
            if key is None:
                continue
            out.append(ObjectInfo(key, int(raw.get("size") or 0), None, self._version_of(raw),
                                  _mtime(raw)))
        return sorted(out, key=lambda o: o.key)

    def list_prefixes(self, prefix: str = "") -> list[str]:
        """The immediate sub-prefixes ("directories") below ``prefix``, as keys."""
        base = self.path(prefix.strip("/")) if prefix.strip("/") else self.root
        names = self._call(lambda: self._ls_dirs(base), "list", prefix)
        keys = [self._key_of(n.rstrip("/")) for n in names]
        return sorted(k for k in keys if k)

    def delete(self, keys: Iterable[str]) -> None:
        """Delete objects; missing ones are ignored."""
        keys = list(keys)
        for chunk in _chunks(keys, 1000):
            paths = [self.path(k) for k in chunk]
            self._call(lambda paths=paths: self._delete(paths), "delete", chunk[0])

    def delete_prefix(self, prefix: str) -> int:
        """Delete every object below ``prefix``, hidden leftovers of crashed writers
        included; return how many objects went."""
        objs = self.list(prefix, internal=True)
        self.delete(o.key for o in objs)
        return len(objs)

    def put_if_absent(self, key: str, data: Buffer) -> ObjectInfo:
        """Create ``key`` only if it does not exist (S3 ``If-None-Match: *``,
        GCS ``ifGenerationMatch=0``, local ``link``). Raises CommitConflictError."""
        path = self.path(key)
        return self._conditional(key, data, lambda: self._put_if_absent(path, data),
                                 "create-only put", "it exists already")

    def put_if_match(self, key: str, data: Buffer, version: str) -> ObjectInfo:
        """Replace ``key`` only if its version token is still ``version`` (compare-and-swap)."""
        if not version:
            raise ConfigError("put_if_match needs the version token returned by a read or write")
        path = self.path(key)
        return self._conditional(key, data, lambda: self._put_if_match(path, data, version),
                                 "compare-and-swap put", f"its version is no longer {version}")

    def _conditional(self, key: str, data: Buffer, fn: Callable[[], str], what: str,
                     why: str) -> ObjectInfo:
        crc = crc32c_hex(data)
        try:
            version = self._write(fn, what, key)
        except FileExistsError as exc:
            # A re-sent request may lose to its own earlier attempt that the server
            # applied before the response was lost: same bytes, ours. Re-sends happen
            # below our retries too (aiohttp re-sends a PUT once by itself), so the
            # check does not depend on how many attempts we made. cloudckpt's own
            # conditional writes (manifests, claims, slot pointers) carry unique ids,
            # so equal bytes never come from another writer.
            try:
                # Compare sizes first: what won may be large, and only ours matters.
                head = self.info(key)
                if head is None or head.size != _nbytes(data):
                    current = None
                else:
                    current, current_version = self.get_with_version(key)
            except FileNotFoundError:
                current = None
            if current is not None and crc32c_hex(current) == crc and len(current) == _nbytes(
                data
            ):
                log.info("%s of %s: the object holds our bytes already (a re-sent request "
                         "lost to its own first attempt)", what, self.key_uri(key))
                return ObjectInfo(key, _nbytes(data), crc, current_version)
            raise CommitConflictError(
                f"{what} of {self.key_uri(key)} lost: {why}. Another writer got there first; "
                "re-read the current state before trying again."
            ) from exc
        return ObjectInfo(key, _nbytes(data), crc, version)

    def get_with_version(self, key: str) -> tuple[bytes, str]:
        """Read a whole object and the version token to pass to :meth:`put_if_match`."""
        path = self.path(key)
        return self._call(lambda: self._get_versioned(path), "get", key)

    def open_write(self, key: str) -> ObjectWriter:
        """Stream a large object. The object appears only when the writer closes
        without error; on error it is discarded. Use as a context manager."""
        return ObjectWriter(self, key)

    def open_write_at(self, key: str, size: int) -> RangeWriter:
        """Write a ``size``-byte object as ranges, in any order and from several
        threads at once (:attr:`ranged_writes` backends only, e.g. local disk). The
        object appears only on :meth:`RangeWriter.commit`; :meth:`RangeWriter.abort`
        discards it."""
        if size < 0:
            raise ConfigError(f"invalid size {size} for {key}")
        return self._open_range_writer(self.path(key), size)

    def can_copy_from(self, src: Store) -> bool:
        """Whether :meth:`copy_from` can copy objects of ``src`` into this store on
        the server, without their bytes passing through this process."""
        return False

    def copy_from(self, src: Store, src_key: str, key: str, size: int) -> ObjectInfo:
        """Copy ``src_key`` of ``src`` (``size`` bytes, as the caller expects it) to
        ``key`` here, on the server; see :meth:`can_copy_from`.

        Returns the new object's size and CRC32C as the server reports them, for the
        caller to check: ``crc32c`` is None where the server gives no whole-object
        CRC32C (the caller then reads the object back). ``FileNotFoundError`` when
        the source (or a bucket) does not exist.
        """
        if not self.can_copy_from(src):
            raise ConfigError(f"{self.uri} cannot copy from {src.uri} on the server")
        info = self._copy(src.path(src_key), self.path(key), size)
        return ObjectInfo(key, info.size, info.crc32c, info.version)

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
            pieces = self._iter_range(path, pos, end, min(chunk, end - pos))
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
                if status_of(exc) == 416:  # the object is shorter than the range
                    raise EOFError(f"{self.key_uri(key)} ends before byte {end}") from exc
                if pos > first and is_transient(exc):
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
                            self.key_uri(key), pos, start, end, describe(exc.error))
            except _SinkError as exc:
                failure = exc.error
                break
        if failure is not None:
            raise failure  # outside the handler: the sink's error, as it was raised

    # ------------------------------------------------------------- batches

    def map(self, fn: Callable[[Any], T], items: Sequence[Any]) -> list[T]:
        """Run ``fn`` over ``items`` with at most ``max_concurrency`` in flight.

        Results keep the order of ``items``. The first failure is raised after
        the requests already in flight have finished (nothing keeps running
        behind the caller's back).
        """
        if len(items) <= 1 or getattr(_worker, "active", False):
            # Inline inside a pool thread: nested batches must not wait on the
            # pool they occupy (that deadlocks once every worker waits).
            return [fn(i) for i in items]
        futures = [self._executor().submit(_in_worker, fn, i) for i in items]
        results: list[T] = []
        error: BaseException | None = None
        for f in futures:
            try:
                results.append(f.result())
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                error = error or exc
                for g in futures:
                    g.cancel()
        if error is not None:
            raise error
        return results

    def put_many(self, items: Mapping[str, Buffer]) -> dict[str, ObjectInfo]:
        """Write many objects in parallel; return their infos by key."""
        infos = self.map(lambda kv: self.put(kv[0], kv[1]), list(items.items()))
        return {i.key: i for i in infos}

    def get_many(self, keys: Sequence[str]) -> dict[str, bytes]:
        """Read many whole objects in parallel."""
        keys = list(keys)
        return dict(zip(keys, self.map(self.get, keys), strict=True))

    def get_ranges(self, ranges: Sequence[tuple[str, int, int]]) -> list[bytes]:
        """Read many ``(key, start, end)`` ranges in parallel, in the given order."""
        return self.map(lambda r: self.get_range(*r), list(ranges))

    def _get_range_tuple(self, r: tuple[str, int, int]) -> bytes:
        return self.get_range(*r)

    def iter_ranges(self, ranges: Sequence[tuple[str, int, int]], *,
                    max_bytes: int | None = None) -> Iterator[bytes]:
        """Read ``(key, start, end)`` ranges in parallel; yield them in the given order,
        each as soon as it has arrived, so the caller works on one while later ones
        are fetched.

        At most ``max_concurrency`` requests run at once, and at most ``max_bytes``
        are requested or yielded but not yet consumed (one range alone may exceed
        it). Closing the iterator early, or a failed read, cancels the requests not
        started and waits for those running (nothing keeps running behind the
        caller's back); the failure is raised in order.
        """
        ranges = list(ranges)
        if getattr(_worker, "active", False):
            # Inside a pool thread: one at a time, inline (see map()).
            for key, start, end in ranges:
                yield self.get_range(key, start, end)
            return
        pending: deque[tuple[Future[bytes], int]] = deque()
        held = 0
        nxt = 0
        try:
            while nxt < len(ranges) or pending:
                while nxt < len(ranges):
                    key, start, end = ranges[nxt]
                    if pending and max_bytes is not None and held + (end - start) > max_bytes:
                        break
                    fut = self._executor().submit(_in_worker, self._get_range_tuple,
                                                  (key, start, end))
                    pending.append((fut, end - start))
                    held += end - start
                    nxt += 1
                fut, size = pending.popleft()
                data = fut.result()
                yield data
                held -= size  # consumed: the caller asked for the next one
        finally:
            for fut, _ in pending:
                fut.cancel()
            wait([fut for fut, _ in pending])

    def _executor(self) -> ThreadPoolExecutor:
        holder = self._pool_holder
        with holder["lock"]:
            if holder["pool"] is None:
                holder["pool"] = ThreadPoolExecutor(
                    self.max_concurrency, thread_name_prefix="cloudckpt-io"
                )
            return holder["pool"]

    # --------------------------------------------------------------- helpers

    def _key_of(self, name: str) -> str | None:
        name = self._strip_protocol(name)
        if name == self.root or not name.startswith(self.root + "/"):
            return None
        return name[len(self.root) + 1 :]

    def _strip_protocol(self, name: str) -> str:
        return name.split("://", 1)[1] if "://" in name else name


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


class _SinkError(CloudCkptError):
    """Carries a failure of a :meth:`Store.read_range_to` sink through the retry
    loop untouched (it is the caller's, not the store's)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


class _Resume(_SinkError):
    """A transient failure of a ranged read after progress: resumed where it
    stopped, under a fresh retry budget."""


class RawWriter(ABC):
    """A backend's streamed upload: parts in, one object out on ``commit``."""

    @abstractmethod
    def write(self, data: Buffer) -> None: ...

    @abstractmethod
    def commit(self, size: int, crc32c: str) -> None:
        """Make the object durable and visible; ``size`` and ``crc32c`` (hex) are of
        everything written, for backends that have the server check them."""

    @abstractmethod
    def abort(self) -> None: ...


class CloseOnExit:
    """As a context manager: ``close()`` when the block succeeds, ``abort()`` when it
    raises, so a failed write never becomes a visible object."""

    def close(self) -> Any:
        raise NotImplementedError

    def abort(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Any:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


class ObjectWriter(CloseOnExit):
    """File-like streamed writer that counts size and CRC32C as data passes.

    The object becomes visible only on a clean :meth:`close`; leaving the
    ``with`` block by an exception discards it.
    """

    def __init__(self, store: Store, key: str) -> None:
        self.store = store
        self.key = key
        self._raw = store._open_writer(store.path(key))
        self._crc = Crc32c()
        self.info: ObjectInfo | None = None
        self.closed = False

    def write(self, data: Buffer) -> int:
        if self.closed:
            raise ValueError(f"write to closed writer for {self.key}")
        n = _nbytes(data)
        if n:
            self._crc.update(data)
            self._raw.write(data)
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


class BufferedRawWriter(RawWriter):
    """Collect everything, then one retried ``put`` on commit.

    Right for backends without a cheaper multipart path; memory use is the
    object's size.
    """

    def __init__(self, store: Store, path: str) -> None:
        self._store = store
        self._path = path
        self._buf = bytearray()

    def write(self, data: Buffer) -> None:
        self._buf += data

    def commit(self, size: int, crc32c: str) -> None:
        data = bytes(self._buf)
        self._buf = bytearray()
        self._store.retry.call(lambda: self._store._put_checked(self._path, data, crc32c),
                               op="put", key=self._path)

    def abort(self) -> None:
        self._buf = bytearray()


_worker = threading.local()


def _in_worker(fn: Callable[[Any], T], item: Any) -> T:
    _worker.active = True
    try:
        return fn(item)
    finally:
        _worker.active = False


def init_options(fs_class: type) -> frozenset[str]:
    """The keyword arguments ``fs_class`` and its bases name in ``__init__``, and those
    every fsspec filesystem takes (its instance and listings caches)."""
    import inspect

    names = {"skip_instance_cache", "use_listings_cache", "listings_expiry_time", "max_paths"}
    for klass in fs_class.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        for p in inspect.signature(init).parameters.values():
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self":
                names.add(p.name)
    return frozenset(names)


async def read_upto(stream: Any, n: int) -> bytes:
    """Up to ``n`` bytes of a response body (anything with ``async read(n)``, which
    may return less), fewer only at its end: pieces of a streamed read."""
    pieces: list[bytes] = []
    got = 0
    while got < n:
        data = await stream.read(n - got)
        if not data:
            break
        pieces.append(data)
        got += len(data)
    return pieces[0] if len(pieces) == 1 else b"".join(pieces)


def _nbytes(data: Buffer) -> int:
    return data.nbytes if isinstance(data, memoryview) else len(data)


def _mtime(raw: Mapping[str, Any]) -> float | None:
    for k in ("mtime", "LastModified", "updated", "created"):
        v = raw.get(k)
        if v is None:
            continue
        if isinstance(v, (int, float)):
            return float(v)
        if hasattr(v, "timestamp"):
            return v.timestamp()
        if isinstance(v, str):
            from datetime import datetime

            try:
                return datetime.fromisoformat(v.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
    return None


def _chunks(seq: list[T], n: int) -> Iterable[list[T]]:
    for i in range(0, len(seq), n):
        yield seq[i : i + n]

