"""The Store: one object over a backend and a root prefix.

A Store speaks in *keys*, paths relative to its root (``"step-10/a.bin"``). It
holds a backend (:mod:`.backend`: the primitives ``put``, ``get``, the two
conditional writes, a streamed writer, ... of one service, on full paths) and
does everything a caller uses once for all of them -- retries, checksums,
conditional writes (whether the server enforces them: :mod:`.conditional`), key
validation -- with two collaborators from :mod:`.transfer`: parallel batches
(:class:`~.transfer.batch.Batches`) and streamed ranged reads
(:class:`~.transfer.ranges.RangedRead`).

Every store is constructed the same way::

    Store(root, FileBackend, *, protocol=None, storage_options=None,
          retry=None, max_concurrency=DEFAULT_CONCURRENCY, part_size=DEFAULT_PART_SIZE)

or from a URI by :func:`~cloudckpt.storage.open_store`. A store derived from one
(:meth:`Store.child`, a view, another retry policy) shares its backend and pool.
"""

from __future__ import annotations

import builtins
import copy
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from functools import partial
from typing import Any

from cloudckpt.errors import (
    AccessDeniedError,
    BucketNotFoundError,
    CommitConflictError,
    ConfigError,
)
from cloudckpt.storage import conditional
from cloudckpt.storage.backend import Backend
from cloudckpt.storage.keys import PLAIN, KeyMap, validate_key
from cloudckpt.storage.objects import ObjectInfo, T, chunks, mtime_of
from cloudckpt.storage.options import (
    DEFAULT_CONCURRENCY,
    DEFAULT_PART_SIZE,
    DEFAULT_UPLOAD_WINDOW,
    refuse_own_options,
)
from cloudckpt.storage.retry import RetryPolicy, status_of
from cloudckpt.storage.transfer.batch import Batches
from cloudckpt.storage.transfer.ranges import RangedRead
from cloudckpt.storage.transfer.window import shared_window
from cloudckpt.storage.writers import (
    ObjectWriter,
    RangeWriter,
)
from cloudckpt.util.crc import Buffer, crc32c_hex, nbytes

__all__ = ["Store"]

log = logging.getLogger(__name__)


class Store:
    """Objects under one root prefix, through one backend.

    Instances are cheap and thread-safe; :meth:`child` makes a store rooted at a
    sub-prefix sharing the same backend and pool.

    ``root`` is the bucket and prefix (or local path) without the scheme;
    ``backend`` the backend class (see :mod:`.backend`); ``protocol`` the URL
    scheme the store is opened under (one of the backend's ``protocols``;
    required only where a backend serves any scheme); ``storage_options`` the
    filesystem's and the backend's own (``fsync`` on local disk), checked by the
    backend; and cloudckpt's own ``retry``, ``max_concurrency``, ``part_size``
    and ``upload_window`` (the bytes streamed writes may hold at once, shared by
    every store of the process with the same value).
    """

    def __init__(
        self,
        root: str,
        backend: type[Backend],
        *,
        protocol: str | None = None,
        storage_options: Mapping[str, Any] | None = None,
        retry: RetryPolicy | None = None,
        max_concurrency: int = DEFAULT_CONCURRENCY,
        part_size: int = DEFAULT_PART_SIZE,
        upload_window: int = DEFAULT_UPLOAD_WINDOW,
        conditional_writes: str = conditional.DEFAULT_MODE,
    ) -> None:
        if max_concurrency < 1:
            raise ConfigError("max_concurrency must be >= 1")
        self.retry = retry or RetryPolicy()
        self.max_concurrency = max_concurrency
        self.part_size = part_size
        self.upload_window = shared_window(upload_window)
        self.conditional_writes = conditional.check_mode(conditional_writes)
        options = dict(storage_options or {})
        refuse_own_options(type(self).__name__, options)
        self.backend: Backend = backend(root, protocol=protocol, storage_options=options,
                                        max_concurrency=max_concurrency)
        self.root = self.backend.root
        #: Where this store's keys lie (a view's keys elsewhere: :meth:`located`,
        #: :meth:`writing_under`).
        self.keys: KeyMap = PLAIN
        self._batches = Batches(max_concurrency)

    # ------------------------------------------------------------------ naming

    @property
    def protocol(self) -> str:
        return self.backend.protocol

    @property
    def storage_options(self) -> dict[str, Any]:
        """The filesystem's options, as the backend checked them."""
        return self.backend.storage_options

    @property
    def fs(self) -> Any:
        """The backend's fsspec filesystem (fsspec-based backends: all built-in ones)."""
        return self.backend.fs  # type: ignore[attr-defined]

    @property
    def native_conditional_writes(self) -> bool:
        return self.backend.native_conditional_writes

    @property
    def ranged_writes(self) -> bool:
        """Whether :meth:`open_write_at` works: ranges in any order, in parallel."""
        return self.backend.ranged_writes

    @property
    def uri(self) -> str:
        """The URI of the store's root, as a user would write it."""
        return self.backend.uri_of(self.root)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri!r})"

    def path(self, key: str) -> str:
        """The filesystem path of ``key`` (for the backend's primitives)."""
        return self.keys.path(self.root, key)

    def _derived(self, **changes: Any) -> Store:
        """This store with some attributes changed, sharing backend and pool: how every
        child and view of a store is made."""
        new = copy.copy(self)
        new.__dict__.update(changes)
        return new

    def located(self, elsewhere: Mapping[str, str]) -> Store:
        """A read-only view of this store whose reads of the keys in ``elsewhere`` go to
        other objects of the same backend (``{key: key of the other object, relative to
        this store's bucket or filesystem root}``): an incremental checkpoint's objects
        kept in its run's blob area. Its children keep the mapping of their keys."""
        return self._derived(keys=KeyMap(located=dict(elsewhere)))

    def writing_under(self, area: str) -> Store:
        """A view of this store keeping its objects in ``area`` below its root (those
        of its children too): ``<root>/<area>/<key>`` for ``key``. The manifest and
        the writer claim keep their own names. A save's names no other writer uses
        (:mod:`cloudckpt.core.checkpoint`). A view of ``area`` already (a part of the
        save) is returned as it is: its objects stay where the save's root put them."""
        if self.keys.under is not None and self.keys.under[1] == area:
            return self
        return self._derived(keys=KeyMap(self.keys.located, (self.root, area)))

    @property
    def written_under(self) -> tuple[str, int] | None:
        """A :meth:`writing_under` view's area, and how many levels above this store
        the root it was made at lies; None for a plain store."""
        if self.keys.under is None:
            return None
        anchor, area = self.keys.under
        return area, self.root[len(anchor):].count("/")

    def _writable(self, key: str) -> None:
        if self.keys.located is not None:
            raise ConfigError(f"{self.key_uri(key)}: this view of {self.uri} reads objects "
                              "kept elsewhere (a blob area) and cannot write or delete")

    def ancestor(self, levels: int) -> Store:
        """The store ``levels`` prefixes above this one, sharing backend and pool; never
        above the bucket (or the filesystem's root)."""
        parts = self.root.split("/")
        keep = len(parts) - levels
        if levels < 0 or keep < (2 if self.root.startswith("/") else 1) or not all(
                parts[keep:]):
            raise ConfigError(f"{self.uri} has no prefix {levels} level(s) above it")
        backend = self.backend.rooted("/".join(parts[:keep]))
        return self._derived(backend=backend, root=backend.root, keys=PLAIN)

    def key_uri(self, key: str) -> str:
        """The full URI of ``key``, for messages."""
        return f"{self.uri}/{key}" if key else self.uri

    def with_retry(self, retry: RetryPolicy) -> Store:
        """This store with another retry policy (sharing backend and pool)."""
        return self._derived(retry=retry)

    def child(self, prefix: str) -> Store:
        """A store rooted at ``prefix`` below this one, sharing backend and pool."""
        prefix = prefix.strip("/")
        if not prefix:
            return self
        validate_key(prefix)  # "a//b" is refused: URIs are normalised, keys are checked
        return self._derived(root=f"{self.root}/{prefix}", keys=self.keys.child(prefix))

    # ----------------------------------------------------------- public API

    def _call(self, fn: Callable[[], T], op: str, key: str) -> T:
        return self.retry.call(fn, op=op, key=self.key_uri(key), errors=self.backend)

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
            exists = self._call(lambda: self.backend.bucket_exists(self.root), "head bucket", "")
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
        self._writable(key)
        path = self.path(key)
        crc = crc32c_hex(data)
        version = self._write(lambda: self.backend.put_checked(path, data, crc), "put", key)
        return ObjectInfo(key, nbytes(data), crc, version)

    def get(self, key: str) -> bytes:
        """Read a whole object. ``FileNotFoundError`` if missing."""
        path = self.path(key)
        return self._call(lambda: self.backend.get(path), "get", key)

    def get_range(self, key: str, start: int, end: int) -> bytes:
        """Read bytes ``[start, end)`` of an object."""
        if start < 0 or end < start:
            raise ConfigError(f"invalid byte range [{start}, {end}) for {key}")
        if end == start:
            return b""
        path = self.path(key)

        def fetch() -> bytes:
            try:
                return self.backend.get(path, start, end)
            except Exception as exc:
                if status_of(exc, self.backend) == 416:  # the object is shorter than the range
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
                return bytes(self.backend.get(path, start, end))
            except Exception as exc:
                if status_of(exc, self.backend) == 416:  # the object ends before ``start``
                    return b""
                raise

        return self._call(fetch, "get", key)

    def info(self, key: str) -> ObjectInfo | None:
        """Size and version of ``key``, or None if it does not exist."""
        path = self.path(key)
        raw = self._call(lambda: self.backend.head(path), "head", key)
        if raw is None:
            return None
        return ObjectInfo(key, int(raw.get("size") or 0), None, self.backend.version_of(raw))

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
        base = self.keys.plain(self.root, prefix.strip("/")) if prefix.strip("/") else self.root
        found = self._call(lambda: self.backend.find(base), "list", prefix)
        out = []
        for name, raw in found.items():
            if raw.get("type", "file") != "file" or (self.backend.is_hidden(name)
                                                      and not internal):
                continue
            key = self._key_of(name)
            if key is None:
                continue
            out.append(ObjectInfo(key, int(raw.get("size") or 0), None,
                                  self.backend.version_of(raw), mtime_of(raw)))
        return sorted(out, key=lambda o: o.key)

    def list_prefixes(self, prefix: str = "") -> builtins.list[str]:
        """The immediate sub-prefixes ("directories") below ``prefix``, as keys."""
        base = self.keys.plain(self.root, prefix.strip("/")) if prefix.strip("/") else self.root
        names = self._call(lambda: self.backend.ls_dirs(base), "list", prefix)
        keys = [self._key_of(n.rstrip("/")) for n in names]
        return sorted(k for k in keys if k)

    def delete(self, keys: Iterable[str]) -> None:
        """Delete objects; missing ones are ignored."""
        keys = list(keys)
        for key in keys:
            self._writable(key)
        for chunk in chunks(keys, 1000):
            paths = [self.path(k) for k in chunk]
            self._call(partial(self.backend.delete, paths, self.root), "delete", chunk[0])

    def delete_prefix(self, prefix: str) -> int:
        """Delete every object below ``prefix``, hidden leftovers of crashed writers
        included; return how many objects went."""
        objs = self.list(prefix, internal=True)
        self.delete(o.key for o in objs)
        return len(objs)

    def bucket_uri(self) -> str:
        """The URI of the store's bucket (its root's first component), for messages."""
        if self.protocol in ("file", ""):
            return self.root
        return f"{self.protocol}://{self.root.split('/', 1)[0]}"

    def open_write(self, key: str) -> ObjectWriter:
        """Stream a large object. The object appears only when the writer closes
        without error; on error it is discarded. Use as a context manager."""
        return ObjectWriter(self.backend.open_writer(self.path(key), self), key)

    def put_file(self, key: str, path: str | os.PathLike[str]) -> ObjectInfo:
        """Write a local file as an object: in one request when it fits in a part,
        else streamed a part at a time (never the whole file in memory)."""
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size <= self.part_size:
                return self.put(key, f.read())
            with self.open_write(key) as out:
                while chunk := f.read(self.part_size):
                    out.write(chunk)
        assert out.info is not None
        return out.info

    def open_write_at(self, key: str, size: int) -> RangeWriter:
        """Write a ``size``-byte object as ranges, in any order and from several
        threads at once (:attr:`ranged_writes` backends only, e.g. local disk). The
        object appears only on :meth:`RangeWriter.commit`; :meth:`RangeWriter.abort`
        discards it."""
        if size < 0:
            raise ConfigError(f"invalid size {size} for {key}")
        self._writable(key)
        return self.backend.open_range_writer(self.path(key), size)

    def can_copy_from(self, src: Store) -> bool:
        """Whether :meth:`copy_from` can copy objects of ``src`` into this store on
        the server, without their bytes passing through this process."""
        return self.backend.can_copy_from(src.backend)

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
        self._writable(key)
        info = self.backend.copy(src.path(src_key), self.path(key), size, self)
        return ObjectInfo(key, info.size, info.crc32c, info.version)

    # ------------------------------------------------------ conditional writes

    def put_if_absent(self, key: str, data: Buffer) -> ObjectInfo:
        """Create ``key`` only if it does not exist (S3 ``If-None-Match: *``,
        GCS ``ifGenerationMatch=0``, local ``link``). Raises CommitConflictError."""
        self._writable(key)
        path = self.path(key)
        enforced = self._enforced(swap=False)  # probed outside the write's retries

        def put() -> str:
            if enforced:
                return self.backend.put_if_absent(path, data)
            return conditional.emulated_write(self.backend, path, data, lambda v: v is None)

        return self._conditional(key, data, put, "create-only put", "it exists already")

    def put_if_match(self, key: str, data: Buffer, version: str) -> ObjectInfo:
        """Replace ``key`` only if its version token is still ``version`` (compare-and-swap)."""
        if not version:
            raise ConfigError("put_if_match needs the version token returned by a read or write")
        self._writable(key)
        path = self.path(key)
        enforced = self._enforced(swap=True)

        def put() -> str:
            if enforced:
                return self.backend.put_if_match(path, data, version)
            return conditional.emulated_write(self.backend, path, data,
                                              lambda v: v == version)

        return self._conditional(key, data, put, "compare-and-swap put",
                                 f"its version is no longer {version}")

    def _enforced(self, *, swap: bool) -> bool:
        """Whether the server enforces create-only writes (``swap``: compare-and-swap)
        here; backends that emulate them in ``put_if_absent`` themselves say so with
        ``native_conditional_writes = False``."""
        if not self.backend.native_conditional_writes:
            return True
        return conditional.supports(
            self.conditional_writes, self.backend.cache_key(self.root), self.bucket_uri(),
            lambda: self._write(self._probe_conditionals, "probe conditional writes", ""),
            swap=swap)

    def _probe_conditionals(self) -> str:
        """One attempt of the conditional-write probe (:func:`.conditional.probe`) on a
        fresh hidden object below the root, deleted after under the store's retries."""
        key = conditional.probe_key()
        path = self.path(key)

        def cleanup() -> None:
            try:
                self._call(lambda: self.backend.delete([path], self.root), "delete", key)
            except FileNotFoundError:
                pass  # no bucket: nothing was written
            except Exception as exc:  # noqa: BLE001 - a hidden leftover gc removes
                log.warning("could not delete the probe object %s: %s", self.key_uri(key), exc)

        return conditional.probe(self.backend, path, cleanup, self.bucket_uri())

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
                if head is None or head.size != nbytes(data):
                    current = None
                else:
                    current, current_version = self.get_with_version(key)
            except FileNotFoundError:
                current = None
            if current is not None and crc32c_hex(current) == crc and len(current) == nbytes(
                data
            ):
                log.info("%s of %s: the object holds our bytes already (a re-sent request "
                         "lost to its own first attempt)", what, self.key_uri(key))
                return ObjectInfo(key, nbytes(data), crc, current_version)
            raise CommitConflictError(
                f"{what} of {self.key_uri(key)} lost: {why}. Another writer got there first; "
                "re-read the current state before trying again."
            ) from exc
        return ObjectInfo(key, nbytes(data), crc, version)

    def get_with_version(self, key: str) -> tuple[bytes, str]:
        """Read a whole object and the version token to pass to :meth:`put_if_match`."""
        path = self.path(key)
        return self._call(lambda: self.backend.get_versioned(path), "get", key)

    # ------------------------------------------------------------- batches

    def map(self, fn: Callable[[Any], T], items: Sequence[Any]) -> builtins.list[T]:
        """Run ``fn`` over ``items`` with at most ``max_concurrency`` in flight, results
        in the order of ``items``; the first failure is raised once the calls in flight
        have finished (:meth:`.transfer.batch.Batches.map`)."""
        return self._batches.map(fn, items)

    def put_many(self, items: Mapping[str, Buffer]) -> dict[str, ObjectInfo]:
        """Write many objects in parallel; return their infos by key."""
        infos = self.map(lambda kv: self.put(kv[0], kv[1]), list(items.items()))
        return {i.key: i for i in infos}

    def get_many(self, keys: Sequence[str]) -> dict[str, bytes]:
        """Read many whole objects in parallel."""
        keys = list(keys)
        return dict(zip(keys, self.map(self.get, keys), strict=True))

    def get_ranges(self, ranges: Sequence[tuple[str, int, int]]) -> builtins.list[bytes]:
        """Read many ``(key, start, end)`` ranges in parallel, in the given order."""
        return self.map(lambda r: self.get_range(*r), list(ranges))

    def iter_ranges(self, ranges: Sequence[tuple[str, int, int]], *,
                    max_bytes: int | None = None) -> Iterator[bytes]:
        """Read ``(key, start, end)`` ranges in parallel; yield them in the given order,
        each as soon as it has arrived, with at most ``max_bytes`` asked for or yielded
        but not yet consumed (:meth:`.transfer.batch.Batches.in_order`)."""
        return self._batches.in_order(lambda r: self.get_range(*r), list(ranges),
                                      lambda r: r[2] - r[1], max_bytes)

    # --------------------------------------------------------- ranged reads

    def _ranged(self, key: str) -> RangedRead:
        return RangedRead(self.backend, self.path(key), self.key_uri(key),
                          lambda fn: self._call(fn, "get_range", key))

    def read_range_to(self, key: str, start: int, end: int,
                      sink: Callable[[int, bytes], Any], *, chunk: int = 8 << 20,
                      on_loop: bool = False) -> None:
        """Stream bytes ``[start, end)`` of ``key`` into ``sink(offset, data)``, in
        order, in pieces of at most ``chunk`` bytes: memory holds one piece, however
        long the range. A transient failure resumes at the first byte not yet given
        to ``sink``; one that comes after progress gets a fresh retry budget (a long
        range is not one short operation). ``EOFError`` if the object ends before
        ``end``; an exception raised by ``sink`` stops the read and passes through
        unchanged.

        ``on_loop``: where the backend's GET is a response on an event loop
        (:class:`~.transfer.ranges.StreamedRanges`), ``sink`` is called there with each
        piece as it arrives, none handed to this thread and back (a round trip each,
        which cost a GCS load a third of its speed); it must then never block, and a
        piece is valid only during the call (a view of the client's buffer: copy what
        is kept). There, a sink with a method ``space(offset, n)`` may say where the
        bytes from ``offset`` go (writable, contiguous memory for at most ``n`` of them,
        or None): the client may receive them straight into it, and then calls the sink
        with a view of that memory, so that nothing is copied. What ``space`` raises
        passes through as the sink's errors do.
        """
        if start < 0 or end < start or chunk < 1:
            raise ConfigError(f"invalid byte range [{start}, {end}) for {key}")
        self._ranged(key).to(start, end, sink, chunk=chunk, on_loop=on_loop)

    def read_range_into(self, key: str, start: int, outs: Sequence[Any]) -> int:
        """Fill the writable buffers ``outs`` in turn with the bytes of ``key`` from
        ``start`` on (one ranged read, resumed like :meth:`read_range_to`), with no
        buffer of its own beyond a network piece; return the CRC32C value of the
        bytes read, computed as they arrive. ``EOFError`` if the object is shorter.
        """
        return self._ranged(key).into(start, outs)

    # --------------------------------------------------------------- helpers

    def _key_of(self, name: str) -> str | None:
        name = self.backend.strip_protocol(name)
        if name == self.root or not name.startswith(self.root + "/"):
            return None
        return name[len(self.root) + 1 :]
