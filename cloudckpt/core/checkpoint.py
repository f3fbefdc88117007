"""Immutable checkpoints: write objects, then commit a manifest.

A checkpoint is every object under one prefix (or, saved incrementally, in its
run's blob area) plus the manifest at ``<prefix>/cloudckpt-manifest.json``. The
manifest is written last and create-only, so a checkpoint is either complete and
verifiable or invisible (invariants 1 and 2 of docs/architecture.md). Reading a
committed one: :mod:`cloudckpt.core.committed`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from cloudckpt.core import kinds, replacing, rootindex
from cloudckpt.core.blobs import BlobArea
from cloudckpt.core.claim import WriterClaim
from cloudckpt.core.committed import (
    Checkpoint,
    open_checkpoint,
    read_manifest,
    read_manifest_and_bytes,
)
from cloudckpt.core.manifest import MANIFEST_NAME, FileEntry, Manifest, validate_path
from cloudckpt.core.ownership import Survey
from cloudckpt.errors import CommitConflictError, ConfigError, CorruptCheckpointError, StorageError
from cloudckpt.names import WRITER_AREAS
from cloudckpt.runtime import interrupts
from cloudckpt.storage import ObjectInfo, ObjectWriter, Store, as_store
from cloudckpt.storage.writers import CloseOnExit
from cloudckpt.util.crc import Buffer, crc32c_hex

log = logging.getLogger(__name__)

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

    ``blobs`` (the run's :class:`~cloudckpt.core.blobs.BlobArea`) makes the save
    incremental: what :meth:`put` writes becomes a blob, stored once under the
    SHA-256 of its bytes, and the manifest references it.

    Objects are written at their own paths only by a writer whose claim was fresh
    (the prefix had none). One that took a claim over, or retries a save, writes
    them under names no other writer uses, ``.cloudckpt-writers/<its id>/<path>``,
    and the manifest says so (``moved``): the writer it took over from, if it still
    runs, cannot overwrite what this one commits (invariant 12). So does a writer on
    a :meth:`~cloudckpt.storage.Store.writing_under` view (a part of a larger save
    that moved). ``own_paths`` keeps every object at its path all the same (a copy,
    whose layout is its source's, and whose every writer writes the same bytes).

    ``replace`` lets the save replace a checkpoint of its kind committed at the URI
    (:mod:`cloudckpt.core.replacing`): its objects go under its writer area, its
    manifest swaps in by compare-and-swap, and only then do the old objects go.

    The commit keeps the index of the root above the prefix up to date
    (:mod:`cloudckpt.core.rootindex`) when the root has one; ``index`` (a saver of a run
    root) also makes it when the root has none.
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
        blobs: BlobArea | None = None,
        own_paths: bool = False,
        replace: bool = False,
        index: bool = False,
    ) -> None:
        self.store = as_store(uri, storage_options)
        if replace and (own_paths or adopting):
            raise ConfigError(f"{self.store.uri}: a copy or an adoption writes at its "
                              "objects' own names and never replaces a committed checkpoint")
        self.blobs = blobs
        self._blob_depth = blobs.depth_of(self.store) if blobs else None
        # adopting: the objects are someone else's (dcp.adopt commits them); the claim
        # may cover them, and a failure removes it rather than leave it as a mark.
        self._claim = WriterClaim(self.store, takeover=takeover, foreign_ok=adopting,
                                  declared=lambda: self.entries.keys())
        self.step = step
        self.metadata = dict(metadata or {})
        self.kind = kind
        self._entries: dict[str, FileEntry] = {}
        self._out = self.store  # where this writer's own objects go (see _acquire)
        self._own_paths = own_paths or adopting
        # The writer area of the moved entries: (area, levels above this prefix).
        self._area: tuple[str, int] | None = self.store.written_under
        self._open: set[str] = set()
        self._lock = threading.Lock()
        self._committed: Checkpoint | None = None
        self._replace = replace
        self._index = index
        self.replaced: replacing.Replaced | None = None  # what this save replaces, once claimed
        if not replace and self.store.exists(MANIFEST_NAME):
            raise CommitConflictError(
                f"a checkpoint is already committed at {self.store.uri}; checkpoints are "
                "immutable. Choose a new URI, or delete it first (cloudckpt rm)."
            )

    def _find_replaced(self) -> None:
        """Before the first claim of a replacing save: read what it replaces."""
        if self._replace and not self._claim.used:
            self.replaced = replacing.find(self.store, self.kind)
            self._claim.replacing = self.replaced is not None

    @property
    def uri(self) -> str:
        return self.store.uri

    @contextmanager
    def _live(self) -> Iterator[None]:
        """Claim the prefix for a write; if the write fails, the writer stops being
        live (a retry in this process may take over; this writer may claim again)."""
        self._acquire()
        try:
            yield
        except BaseException:
            self._claim.suspend()
            raise

    def _acquire(self) -> None:
        """Claim the prefix; after the first claim, choose where objects go: under this
        writer's area unless its claim was fresh on a prefix holding no checkpoint."""
        self._find_replaced()
        self._claim.acquire()
        fresh = self._claim.fresh and self.replaced is None
        if self._out is self.store and self._area is None and not fresh \
                and self.blobs is None and not self._own_paths:
            self._out = self.store.writing_under(f"{WRITER_AREAS}/{self._claim.writer}")
            self._area = self._out.written_under
            log.info("%s holds a checkpoint or was claimed before: this save writes its "
                     "objects under %s/", self.uri, self._out.key_uri(WRITER_AREAS))

    @property
    def moving(self) -> str | None:
        """The writer area this writer's own objects go to (None: their own paths),
        for the other processes writing into the same save (after :meth:`claim`)."""
        under = self._out.written_under
        return under[0] if under else None

    def claim(self) -> Survey | None:
        """Claim the prefix now, before other processes write objects into it (for a
        coordinator that commits what several ranks write); writes claim it anyway.
        Returns what the prefix held when this writer claimed it."""
        self._acquire()
        return self._claim.found

    def abandon(self) -> None:
        """Give up a save that failed without committing: release the claim, so a
        retry (in this process or another) can claim the prefix at once."""
        if self._committed is None:
            self._claim.release(committed=False)

    def _record(self, info: ObjectInfo, key: str | None = None, blob: str | None = None,
                moved: bool = False) -> None:
        assert info.crc32c is not None
        with self._lock:
            self._entries[key or info.key] = FileEntry(info.size, info.crc32c, blob, moved)

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
        return self.put_many({path: data})[path]

    def put_many(self, items: Mapping[str, Buffer]) -> dict[str, ObjectInfo]:
        """Write many objects in parallel: ``{path: bytes}``."""
        if not isinstance(items, Mapping):
            raise TypeError(f"put_many takes a mapping of path to bytes, got "
                            f"{type(items).__name__}")
        for p, data in items.items():
            self._check_path(p)
            self._check_data(p, data)
        with self._live():
            if self.blobs is not None:
                return self._put_blobs(items)
            out = self._out
            infos = out.put_many(items)
        for info in infos.values():
            self._record(info, moved=out.written_under is not None)
        return infos

    def _put_blobs(self, items: Mapping[str, Buffer]) -> dict[str, ObjectInfo]:
        assert self.blobs is not None
        out = {}
        for path, (digest, info) in self.blobs.put_many(self.store, items).items():
            self._record(info, path, digest)
            out[path] = ObjectInfo(path, info.size, info.crc32c)
        return out

    def open(self, path: str) -> _TrackedWriter:
        """Stream a large object; it is recorded when the writer closes."""
        self._check_path(path)
        if self.blobs is not None:
            raise ConfigError(f"{self.uri}: an incremental save names each object by its "
                              "bytes; write it with put(), not as a stream")
        self._acquire()
        with self._lock:
            self._open.add(path)
        return _TrackedWriter(self, path)

    def add_existing(self, path: str, size: int, crc32c: str, blob: str | None = None,
                     moved: bool = False, *, blob_depth: int | None = None,
                     area: tuple[str, int] | None = None) -> None:
        """Record an object written by another process (e.g. another rank); ``blob``:
        a blob of the area ``blob_depth`` levels up (this writer's own by default);
        ``moved``: written through a view of this writer's :attr:`moving` area (or of
        ``area``: its path and how many levels above this prefix its root lies)."""
        self._check_path(path)
        if blob is not None:
            self._refer(blob_depth or self._blob_depth, path)
        if moved:
            self._move(area or self._area, path)
        with self._lock:
            self._entries[path] = FileEntry(size, crc32c, blob, moved)

    def _move(self, area: tuple[str, int] | None, path: str) -> None:
        if area is None or area[1] < 0 or self._area not in (None, area):
            raise ConfigError(f"{self.uri}: {path!r} lies in another writer area than this "
                              "checkpoint's other moved objects; one save writes one area")
        self._area = area

    def _refer(self, depth: int | None, path: str) -> None:
        if depth is None or (self._blob_depth not in (None, depth)):
            raise ConfigError(f"{self.uri}: {path!r} is a blob of another area than this "
                              "checkpoint's; one checkpoint references one run's blobs")
        self._blob_depth = depth

    def add_part(self, prefix: str) -> Checkpoint:
        """Record the committed checkpoint at ``prefix`` (below this one) as a part:
        its objects and its own manifest, so this manifest covers all of them."""
        sub = self.store.child(prefix)
        manifest, raw = read_manifest_and_bytes(sub)  # one read: the manifest and its checksum
        levels = len(prefix.strip("/").split("/"))
        depth = None if manifest.blob_depth is None else manifest.blob_depth - levels
        area = None if manifest.writer_area is None else (
            manifest.writer_area, (manifest.writer_depth or 0) - levels)
        for path, entry in manifest.files.items():
            self.add_existing(f"{prefix}/{path}", entry.size, entry.crc32c, entry.blob,
                              entry.moved, blob_depth=depth, area=area)
        self.add_existing(f"{prefix}/{MANIFEST_NAME}", len(raw), crc32c_hex(raw))
        return Checkpoint(sub, manifest)

    @property
    def entries(self) -> dict[str, FileEntry]:
        with self._lock:
            return dict(self._entries)

    def commit(self, manifest: Manifest | None = None) -> Checkpoint:
        """Write the manifest (create-only; over the one it replaces by compare-and-swap,
        then deleting what that one held). Everything listed must be written already.

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
            blob_depth = self._blob_depth if any(e.blob for e in self._entries.values()) \
                else None
            area = self._area if any(e.moved for e in self._entries.values()) else None
            if manifest is None:
                manifest = Manifest(files=dict(self._entries), step=self.step,
                                    metadata=self.metadata, kind=self.kind,
                                    blob_depth=blob_depth,
                                    writer_area=None if area is None else area[0],
                                    writer_depth=None if area is None else area[1])
            elif dict(manifest.files) != self._entries:
                bad = sorted(set(self._entries.items()) ^ set(manifest.files.items()))
                raise CorruptCheckpointError(
                    f"{self.uri}: the manifest to commit does not list what was written: "
                    f"{bad[:5]}; nothing was committed", {p: "differs" for p, _ in bad})
        if self.replaced is not None:
            found = self._claim.found
            present = {o.key for o in found.objects} if found is not None else ()
            manifest = dataclasses.replace(manifest, superseded=replacing.superseded(
                self.replaced.manifest, manifest, present))
        recording = rootindex.Commit(self.store, self._index)
        with self._live():
            self._claim.check()
            interrupts.raise_if_swallowed()  # a Ctrl-C during the save stops it here
            recording.begin()
            try:
                written = self._write_manifest(manifest)
            except BaseException:
                recording.failed()
                raise
        recording.done(manifest, written)
        if self.replaced is not None:
            replacing.clear(self.store, self.replaced, manifest)
        self._claim.release(committed=True)
        if manifest.blob_depth == 1:  # the run's checkpoint itself: its manifest holds now
            BlobArea.above(self.store, 1).release(self.store.root.rsplit("/", 1)[-1])
        log.info("committed %s (step %s, %d objects, %d bytes)", self.uri, self.step,
                 len(manifest.files), manifest.total_size)
        self._committed = Checkpoint(self.store, manifest)
        return self._committed

    def _write_manifest(self, manifest: Manifest) -> int | None:
        """Write the manifest; its size in bytes where known (the root index records it)."""
        if self.replaced is None:
            raw = manifest.to_json()
            self.store.put_if_absent(MANIFEST_NAME, raw)
            return len(raw)
        try:
            replacing.swap(self.store, manifest, self.replaced)
            return None
        except CommitConflictError:  # lost: what this save wrote goes
            if manifest.writer_area is not None and manifest.writer_depth == 0:
                try:
                    self.store.delete(f"{manifest.writer_area}/{p}" for p in manifest.moved)
                except Exception as exc:  # noqa: BLE001 - the conflict is what to report
                    log.warning("could not remove the objects of the lost save under %s/%s:"
                                " %s", self.uri, manifest.writer_area, exc)
            raise

    def __enter__(self) -> CheckpointWriter:
        self._watch = interrupts.watching()
        self._watch.__enter__()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            self._end(exc_type, exc)
        except BaseException as failure:
            self._watch.__exit__(type(failure), failure, failure.__traceback__)
            raise
        self._watch.__exit__(exc_type, exc, tb)

    def _end(self, exc_type: Any, exc: Any) -> None:
        """Commit after a clean ``with`` block; abandon after a failed one."""
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
        self._w: ObjectWriter = owner._out.open_write(path)
        self._moved = owner._out.written_under is not None

    def write(self, data: Buffer, crc32c: int | None = None) -> int:
        return self._w.write(data, crc32c)

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
        self._owner._record(info, moved=self._moved)
        return info

    def abort(self) -> None:
        self._w.abort()
        self._owner._claim.suspend()
        with self._owner._lock:
            self._owner._open.discard(self._path)
