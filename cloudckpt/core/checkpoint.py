"""Immutable checkpoints: write objects, commit a manifest, open, verify.

A checkpoint is every object under one prefix plus the manifest at
``<prefix>/cloudckpt-manifest.json``. The manifest is written last and
create-only, so a checkpoint is either complete and verifiable or invisible
(invariants 1 and 2 of docs/architecture.md).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from cloudckpt.core import kinds
from cloudckpt.core.claim import WriterClaim
from cloudckpt.core.manifest import (
    MANIFEST_NAME,
    FileEntry,
    Manifest,
    read_manifest_bytes,
    validate_path,
)
from cloudckpt.core.ownership import COMMITTED, EMPTY, Survey, missing_manifest_error, survey
from cloudckpt.errors import (
    CheckpointNotFoundError,
    CommitConflictError,
    CorruptCheckpointError,
    StorageError,
)
from cloudckpt.storage import ObjectInfo, ObjectWriter, Store, as_store
from cloudckpt.storage.writers import CloseOnExit
from cloudckpt.util.crc import Buffer, crc32c_hex

log = logging.getLogger("cloudckpt")

__all__ = [
    "Checkpoint",
    "CheckpointWriter",
    "open_checkpoint",
    "read_manifest",
]


class CheckpointWriter:
    """Write the objects of one checkpoint, then commit it.

    >>> with CheckpointWriter("s3://bucket/run/step-100", step=100) as w:  # doctest: +SKIP
    ...     w.put("model.bin", data)
    ...     with w.open("big.bin") as f:
    ...         f.write(chunk)

    Leaving the ``with`` block normally commits; leaving it by an exception
    writes no manifest, so nothing becomes visible. Objects already written
    then stay as an uncommitted prefix for ``cloudckpt gc`` or a retry of the
    same save to overwrite.

    One writer per URI: the first object written claims the prefix (see
    :mod:`cloudckpt.core.claim`), and a second live writer gets a
    :class:`CommitConflictError` before it writes anything. ``takeover``
    replaces the claim of a writer on another host that is known to be dead. A
    prefix holding data cloudckpt did not write (or checkpoints further down) is
    refused with :class:`NotACheckpointError` at the first write.
    """

    def __init__(
        self,
        uri: str | Store,
        *,
        step: int | None = None,
        metadata: Mapping[str, Any] | None = None,
        kind: str = kinds.GENERIC,
        storage_options: Mapping[str, Any] | None = None,
        takeover: bool = False,
        adopting: bool = False,
    ) -> None:
        self.store = as_store(uri, storage_options)
        # adopting: the objects are someone else's (dcp.adopt commits them); the claim
        # may cover them, and a failure removes it rather than leave it as a mark.
        self._claim = WriterClaim(self.store, takeover=takeover, foreign_ok=adopting,
                                  declared=lambda: self.entries.keys())
        self.step = step
        self.metadata = dict(metadata or {})
        self.kind = kind
        self._entries: dict[str, FileEntry] = {}
        self._open: set[str] = set()
        self._lock = threading.Lock()
        self._committed: Checkpoint | None = None
        if self.store.exists(MANIFEST_NAME):
            raise CommitConflictError(
                f"a checkpoint is already committed at {self.store.uri}; checkpoints are "
                "immutable. Choose a new URI, or delete it first (cloudckpt rm)."
            )

    @property
    def uri(self) -> str:
        return self.store.uri

    @contextmanager
    def _live(self) -> Iterator[None]:
        """Claim the prefix for a write; if the write fails, the writer stops being
        live (a retry in this process may take over; this writer may claim again)."""
        self._claim.acquire()
        try:
            yield
        except BaseException:
            self._claim.suspend()
            raise

    def claim(self) -> Survey | None:
        """Claim the prefix now, before other processes write objects into it (for a
        coordinator that commits what several ranks write); writes claim it anyway.
        Returns what the prefix held when this writer claimed it."""
        self._claim.acquire()
        return self._claim.found

    def abandon(self) -> None:
        """Give up a save that failed without committing: release the claim, so a
        retry (in this process or another) can claim the prefix at once."""
        if self._committed is None:
            self._claim.release(committed=False)

    def _record(self, info: ObjectInfo) -> None:
        assert info.crc32c is not None
        with self._lock:
            self._entries[info.key] = FileEntry(info.size, info.crc32c)

    def _check_path(self, path: str) -> str:
        if not isinstance(path, str):
            raise TypeError(f"object paths are strings like 'model.bin', got "
                            f"{type(path).__name__} {path!r:.100}")
        if self._committed is not None:
            raise CommitConflictError(f"{self.uri} is committed; no more objects can be added")
        return validate_path(path, source=f"object for {self.uri}")

    def _check_data(self, path: str, data: Any) -> None:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"the data of {path!r} must be bytes, bytearray or memoryview, "
                            f"got {type(data).__name__}")

    def put(self, path: str, data: Buffer) -> ObjectInfo:
        """Write one object of the checkpoint."""
        path = self._check_path(path)
        self._check_data(path, data)
        with self._live():
            info = self.store.put(path, data)
        self._record(info)
        return info

    def put_many(self, items: Mapping[str, Buffer]) -> dict[str, ObjectInfo]:
        """Write many objects in parallel: ``{path: bytes}``."""
        if not isinstance(items, Mapping):
            raise TypeError(f"put_many takes a mapping of path to bytes, got "
                            f"{type(items).__name__}")
        for p, data in items.items():
            self._check_path(p)
            self._check_data(p, data)
        with self._live():
            infos = self.store.put_many(items)
        for info in infos.values():
            self._record(info)
        return infos

    def open(self, path: str) -> _TrackedWriter:
        """Stream a large object; it is recorded when the writer closes."""
        self._check_path(path)
        self._claim.acquire()
        with self._lock:
            self._open.add(path)
        return _TrackedWriter(self, path)

    def add_existing(self, path: str, size: int, crc32c: str) -> None:
        """Record an object written by another process (e.g. another rank)."""
        self._check_path(path)
        with self._lock:
            self._entries[path] = FileEntry(size, crc32c)

    def add_part(self, prefix: str) -> Checkpoint:
        """Record the committed checkpoint at ``prefix`` (below this one) as a part:
        its objects and its own manifest, so this manifest covers all of them."""
        sub = self.store.child(prefix)
        manifest, raw = _manifest_and_bytes(sub)  # one read: the manifest and its checksum
        for path, entry in manifest.files.items():
            self.add_existing(f"{prefix}/{path}", entry.size, entry.crc32c)
        self.add_existing(f"{prefix}/{MANIFEST_NAME}", len(raw), crc32c_hex(raw))
        return Checkpoint(sub, manifest)

    @property
    def entries(self) -> dict[str, FileEntry]:
        with self._lock:
            return dict(self._entries)

    def commit(self, manifest: Manifest | None = None) -> Checkpoint:
        """Write the manifest (create-only). Everything listed must be written already.

        ``manifest`` commits a given one instead of one built from what was written
        (a copy keeps its source's manifest); it must list exactly those objects.
        """
        if self._committed is not None:
            return self._committed
        with self._lock:
            if self._open:
                raise StorageError(
                    f"cannot commit {self.uri}: streamed objects still open: {sorted(self._open)}"
                )
            if manifest is None:
                manifest = Manifest(files=dict(self._entries), step=self.step,
                                    metadata=self.metadata, kind=self.kind)
            elif dict(manifest.files) != self._entries:
                bad = sorted(set(self._entries.items()) ^ set(manifest.files.items()))
                raise CorruptCheckpointError(
                    f"{self.uri}: the manifest to commit does not list what was written: "
                    f"{bad[:5]}; nothing was committed", {p: "differs" for p, _ in bad})
        with self._live():
            self._claim.check()
            self.store.put_if_absent(MANIFEST_NAME, manifest.to_json())
        self._claim.release(committed=True)
        log.info("committed %s (step %s, %d objects, %d bytes)", self.uri, self.step,
                 len(manifest.files), manifest.total_size)
        self._committed = Checkpoint(self.store, manifest)
        return self._committed

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.commit()
        elif self._committed is None:
            self.abandon()
            if issubclass(exc_type, CommitConflictError):
                log.warning("save to %s lost to another writer: %s", self.uri, exc)
                return
            log.warning("save to %s failed (%s); no manifest written, the prefix stays "
                        "uncommitted and invisible", self.uri, exc_type.__name__)


class _TrackedWriter(CloseOnExit):
    """An :class:`ObjectWriter` that reports to its checkpoint when closed."""

    def __init__(self, owner: CheckpointWriter, path: str) -> None:
        self._owner = owner
        self._path = path
        self._w: ObjectWriter = owner.store.open_write(path)

    def write(self, data: Buffer) -> int:
        return self._w.write(data)

    @property
    def failure(self) -> BaseException | None:  # type: ignore[override]
        return self._w.failure

    def flush(self) -> None:
        """Nothing to do (parts go up as they fill): lets ``torch.save(obj, f)`` and
        other writers that flush use it as a file."""

    def writable(self) -> bool:
        return True

    def close(self) -> ObjectInfo:
        try:
            info = self._w.close()
        finally:
            with self._owner._lock:
                self._owner._open.discard(self._path)
        self._owner._record(info)
        return info

    def abort(self) -> None:
        self._w.abort()
        self._owner._claim.suspend()
        with self._owner._lock:
            self._owner._open.discard(self._path)


class Checkpoint:
    """A committed checkpoint: its manifest and verified reads of its objects."""

    def __init__(self, store: Store, manifest: Manifest) -> None:
        self.store = store
        self.manifest = manifest

    def __repr__(self) -> str:
        return f"Checkpoint({self.uri!r}, step={self.step}, files={len(self.files)})"

    @property
    def uri(self) -> str:
        return self.store.uri

    @property
    def step(self) -> int | None:
        return self.manifest.step

    @property
    def metadata(self) -> Mapping[str, Any]:
        return self.manifest.metadata

    @property
    def files(self) -> list[str]:
        """Object paths, from the manifest (never from a listing)."""
        return sorted(self.manifest.files)

    @property
    def total_size(self) -> int:
        return self.manifest.total_size

    def entry(self, path: str) -> FileEntry:
        try:
            return self.manifest.files[path]
        except KeyError:
            raise CheckpointNotFoundError(
                f"{path!r} is not part of checkpoint {self.uri}; it has: "
                f"{', '.join(self.files[:10])}{' ...' if len(self.files) > 10 else ''}"
            ) from None

    def _check(self, path: str, data: bytes) -> bytes:
        entry = self.entry(path)
        problem = _problem(entry, data)
        if problem:
            raise CorruptCheckpointError(
                f"object {path!r} of {self.uri} is corrupt: {problem}. Restore it from a "
                "copy or fall back to an earlier checkpoint.",
                {path: problem},
            )
        return data

    def read(self, path: str) -> bytes:
        """Read a whole object, checking size and CRC32C.

        Large objects are fetched as parallel ranged reads of ``part_size``.
        """
        entry = self.entry(path)
        chunk = max(self.store.part_size, 1 << 20)
        try:
            if entry.size > 2 * chunk:
                ranges = [(path, s, min(s + chunk, entry.size))
                          for s in range(0, entry.size, chunk)]
                data = b"".join(self.store.get_ranges(ranges))
            else:
                data = self.store.get(path)
        except (FileNotFoundError, EOFError) as exc:
            raise CorruptCheckpointError(
                f"object {path!r} of {self.uri} is listed in the manifest but missing or "
                f"short ({exc})", {path: "missing or short"},
            ) from None
        return self._check(path, data)

    def read_many(self, paths: Sequence[str]) -> dict[str, bytes]:
        """Read many objects in parallel, each checked."""
        for p in paths:
            self.entry(p)
        return dict(zip(paths, self.store.map(self.read, list(paths)), strict=True))

    def read_range(self, path: str, start: int, end: int) -> bytes:
        """Read bytes ``[start, end)`` of an object.

        A range cannot be checked against the whole object's CRC32C; only its
        bounds are checked. Use :meth:`read` or :meth:`verify` for integrity.
        """
        entry = self.entry(path)
        if not 0 <= start <= end <= entry.size:
            raise ValueError(f"range [{start}, {end}) outside {path!r} of size {entry.size}")
        try:
            return self.store.get_range(path, start, end)
        except (FileNotFoundError, EOFError) as exc:
            raise CorruptCheckpointError(
                f"object {path!r} of {self.uri} is missing or short: {exc}", {path: "short"}
            ) from None

    def iter_objects(self) -> Iterator[tuple[str, bytes]]:
        """Yield ``(path, bytes)`` for every object, checked, in parallel batches."""
        batch = max(self.store.max_concurrency, 1)
        files = self.files
        for i in range(0, len(files), batch):
            yield from self.read_many(files[i : i + batch]).items()

    def verify(self, deep: bool = False) -> None:
        """Check every object exists with the right size; with ``deep``, also its CRC32C.

        Raises :class:`CorruptCheckpointError` listing every bad object.
        """
        problems: dict[str, str] = {}
        listed = {o.key: o.size for o in self.store.list()}
        for path, entry in self.manifest.files.items():
            if path not in listed:
                problems[path] = "missing"
            elif listed[path] != entry.size:
                problems[path] = f"size {listed[path]} != {entry.size} in manifest"
        if deep:
            todo = [p for p in self.files if p not in problems]

            def check(path: str) -> tuple[str, str | None]:
                try:
                    return path, _problem(self.manifest.files[path], self.store.get(path))
                except FileNotFoundError:
                    return path, "missing"

            for path, problem in self.store.map(check, todo):
                if problem:
                    problems[path] = problem
        if problems:
            names = ", ".join(f"{p} ({why})" for p, why in sorted(problems.items()))
            raise CorruptCheckpointError(
                f"checkpoint {self.uri} failed verification: {names}", problems
            )


def _problem(entry: FileEntry, data: bytes) -> str | None:
    if len(data) != entry.size:
        return f"size {len(data)} != {entry.size} in manifest"
    crc = crc32c_hex(data)
    if crc != entry.crc32c:
        return f"crc32c {crc} != {entry.crc32c} in manifest"
    return None


def read_manifest(store: Store) -> Manifest:
    """Load and validate the manifest of the checkpoint rooted at ``store``.

    Without a manifest, the prefix is surveyed to say what it is instead:
    :class:`IncompleteCheckpointError` for a save cloudckpt started and never
    committed, :class:`NotACheckpointError` for a root holding checkpoints or for
    objects cloudckpt did not write, :class:`CheckpointNotFoundError` when nothing
    is there (:class:`BucketNotFoundError` when not even the bucket is).
    """
    return _manifest_and_bytes(store)[0]


def _manifest_and_bytes(store: Store, retry: bool = True) -> tuple[Manifest, bytes]:
    try:
        data = read_manifest_bytes(store)  # bounded: never more than MAX_MANIFEST_BYTES
    except FileNotFoundError:
        found = survey(store)
        if found.kind == COMMITTED and retry:  # committed between the read and the listing
            return _manifest_and_bytes(store, retry=False)
        if found.kind == EMPTY:
            store.check_bucket()
        raise missing_manifest_error(found) from None
    return Manifest.from_json(data, source=store.key_uri(MANIFEST_NAME)), data


def open_checkpoint(
    uri: str | Store, storage_options: Mapping[str, Any] | None = None
) -> Checkpoint:
    """Open the committed checkpoint at ``uri`` (its manifest is read and validated)."""
    store = as_store(uri, storage_options)
    return Checkpoint(store, read_manifest(store))
