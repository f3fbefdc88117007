"""Immutable checkpoints: write objects, commit a manifest, open, verify, list.

A checkpoint is every object under one prefix plus the manifest at
``<prefix>/cloudckpt-manifest.json``. The manifest is written last and
create-only, so a checkpoint is either complete and verifiable or invisible
(DESIGN.md invariants 1 and 2).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from .claim import WriterClaim, mark_deleting, seize
from .crc import Buffer, crc32c_hex
from .errors import (
    CheckpointNotFoundError,
    CommitConflictError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    ManifestError,
    NotACheckpointError,
    StorageError,
)
from .manifest import (
    CLAIM_NAME,
    MANIFEST_NAME,
    FileEntry,
    Manifest,
    is_reserved,
    read_manifest_bytes,
    validate_path,
)
from .ownership import (
    COMMITTED,
    EMPTY,
    FOREIGN,
    OURS,
    ROOT,
    Survey,
    classify,
    missing_manifest_error,
    survey,
)
from .storage import ObjectInfo, ObjectWriter, Store, as_store
from .storage.base import CloseOnExit

log = logging.getLogger("cloudckpt")

__all__ = [
    "Checkpoint",
    "CheckpointInfo",
    "CheckpointWriter",
    "delete_checkpoint",
    "delete_tree",
    "latest_checkpoint",
    "list_checkpoints",
    "open_checkpoint",
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
    :mod:`cloudckpt.claim`), and a second live writer gets a
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
        kind: str = "generic",
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

    def claim(self) -> None:
        """Claim the prefix now, before other processes write objects into it (for a
        coordinator that commits what several ranks write); writes claim it anyway."""
        self._claim.acquire()

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
        part = open_checkpoint(self.store.child(prefix))
        for path, entry in part.manifest.files.items():
            self.add_existing(f"{prefix}/{path}", entry.size, entry.crc32c)
        raw = part.store.get(MANIFEST_NAME)
        self.add_existing(f"{prefix}/{MANIFEST_NAME}", len(raw), crc32c_hex(raw))
        return part

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
    try:
        data = read_manifest_bytes(store)  # bounded: never more than MAX_MANIFEST_BYTES
    except FileNotFoundError:
        found = survey(store)
        if found.kind == EMPTY:
            store.check_bucket()
        raise missing_manifest_error(found) from None
    return Manifest.from_json(data, source=store.key_uri(MANIFEST_NAME))


def open_checkpoint(
    uri: str | Store, storage_options: Mapping[str, Any] | None = None
) -> Checkpoint:
    """Open the committed checkpoint at ``uri`` (its manifest is read and validated)."""
    store = as_store(uri, storage_options)
    return Checkpoint(store, read_manifest(store))


@dataclass(frozen=True)
class CheckpointInfo:
    """One entry of a listing: a committed checkpoint, or another prefix.

    ``status`` is ``"committed"``, ``"uncommitted"`` (a save cloudckpt started and
    did not commit), ``"unreadable"`` (a manifest that cannot be read; ``error``
    says why), ``"root"`` (checkpoints lie below it) or ``"foreign"`` (objects
    cloudckpt did not write). ``size`` and ``files`` count what is stored: the
    manifest's objects when committed, everything under the prefix otherwise;
    ``created`` is the commit time, or the newest object's time.
    """

    name: str
    uri: str
    committed: bool
    step: int | None = None
    created: float | None = None
    size: int = 0
    files: int = 0
    error: str | None = None
    status: str = "committed"


def _sort_key(c: CheckpointInfo) -> tuple[int, float, str]:
    return (c.step if c.step is not None else -1, c.created or 0.0, c.name)


_STATUS = {OURS: "uncommitted", ROOT: "root", FOREIGN: "foreign"}


def list_checkpoints(
    root: str | Store,
    storage_options: Mapping[str, Any] | None = None,
    *,
    include_uncommitted: bool = False,
) -> list[CheckpointInfo]:
    """The checkpoints directly below ``root``, oldest step first.

    Only committed checkpoints by default; ``include_uncommitted`` adds every
    other prefix there, flagged ``committed=False`` with its ``status``.
    Raises :class:`BucketNotFoundError` when the bucket does not exist.
    """
    store = as_store(root, storage_options)
    names = store.list_prefixes()
    if not names:
        store.check_bucket()

    def probe(name: str, again: bool = True) -> CheckpointInfo | None:
        sub = store.child(name)
        try:
            m = Manifest.from_json(read_manifest_bytes(sub), source=sub.key_uri(MANIFEST_NAME))
        except FileNotFoundError:
            if not include_uncommitted:
                return None
            found = survey(sub)
            if found.kind == EMPTY:  # vanished meanwhile
                return None
            if found.kind == COMMITTED:  # committed between the read and the listing
                return probe(name, again=False) if again else None
            return CheckpointInfo(name, sub.uri, False, created=found.newest, size=found.size,
                                  files=len(found.objects), status=_STATUS[found.kind])
        except CorruptCheckpointError as exc:
            return CheckpointInfo(name, sub.uri, False, error=str(exc), status="unreadable")
        return CheckpointInfo(name, sub.uri, True, m.step, m.created, m.total_size,
                              len(m.files))

    infos = [i for i in store.map(probe, names) if i is not None]
    if not include_uncommitted:
        infos = [i for i in infos if i.committed]
    return sorted(infos, key=_sort_key)


def latest_checkpoint(
    root: str | Store, storage_options: Mapping[str, Any] | None = None
) -> Checkpoint | None:
    """The committed checkpoint with the highest step below ``root``, or None."""
    store = as_store(root, storage_options)
    committed = list_checkpoints(store)
    if not committed:
        return None
    return open_checkpoint(store.child(committed[-1].name))


def delete_checkpoint(uri: str | Store, storage_options: Mapping[str, Any] | None = None,
                      *, force: bool = False) -> int:
    """Delete a checkpoint: manifest first (it vanishes at once), then the objects it
    lists. Anything else under the prefix (another checkpoint or save further down,
    objects cloudckpt did not write) stays, with a WARNING naming it.

    ``force`` also deletes a save that cloudckpt started and never committed, and a
    checkpoint whose manifest cannot be read (then everything under its prefix).
    Nothing else is ever deleted: a root holding checkpoints or objects cloudckpt
    did not write raise :class:`NotACheckpointError` (see
    :mod:`cloudckpt.ownership`; :func:`delete_tree` deletes a root's checkpoints).
    Returns the number of objects deleted, hidden bookkeeping objects included.
    """
    store = as_store(uri, storage_options)
    try:
        manifest = read_manifest(store)
    except IncompleteCheckpointError:
        if not force:
            raise
        return delete_unfinished(store, survey(store))
    except ManifestError:
        if not force:
            raise
        log.warning("deleting %s, whose manifest cannot be read, with all it holds", store.uri)
        mark_deleting(store)
        store.delete([MANIFEST_NAME])
        n = store.delete_prefix("")
        return n
    # A claim marked "deleting" first: a delete cut short leaves objects that still
    # prove to be cloudckpt's, for gc and rm --force.
    mark_deleting(store)
    store.delete([MANIFEST_NAME])  # invisible from here on
    objects = [o.key for o in store.list(internal=True) if o.key != CLAIM_NAME]
    found = classify(store.uri, [ObjectInfo(k, 0) for k in objects])
    units = (*found.checkpoints, *found.saves)
    mine = [k for k in objects if k in manifest.files
            or (is_reserved(k) and not any(k.startswith(u + "/") for u in units))]
    left = sorted(set(objects) - set(mine))
    store.delete(mine)
    store.delete([CLAIM_NAME])  # the mark goes last
    if left:
        log.warning("deleted checkpoint %s; left %d object(s) under it that it does not "
                    "list (e.g. %s): cloudckpt deletes only what it wrote", store.uri,
                    len(left), left[0])
    return len(mine) + 1  # and the manifest


def delete_unfinished(store: Store, found: Survey) -> int:
    """Delete the unfinished save of cloudckpt's that ``found`` surveyed at ``store``.

    Its claim is seized first, by compare-and-swap on what the survey saw
    (:func:`cloudckpt.claim.seize`): a save that took the prefix over since keeps it
    (:class:`CommitConflictError`, nothing deleted), and a writer that held it all
    along can no longer commit into what is deleted. Returns the objects deleted.
    """
    if found.kind != OURS:
        raise missing_manifest_error(found) if found.kind != COMMITTED else CommitConflictError(
            f"{store.uri} was committed meanwhile; not deleting it as an unfinished save")
    if not seize(store, found.objects):
        raise CommitConflictError(
            f"another save took {store.uri} over while it was to be deleted; nothing was "
            "deleted")
    keys = [o.key for o in store.list(internal=True) if o.key != CLAIM_NAME]
    store.delete(keys)
    if store.exists(MANIFEST_NAME):
        # Its writer passed its last check just before the claim was seized and
        # committed while the data went: hide the torn result rather than show it.
        log.error("a save committed %s while it was deleted as unfinished; its data is "
                  "gone, so its manifest is removed too", store.uri)
        store.delete([MANIFEST_NAME])
    store.delete([CLAIM_NAME])
    return len(keys) + int(any(o.key == CLAIM_NAME for o in found.objects))


def delete_tree(root: str | Store, storage_options: Mapping[str, Any] | None = None
                ) -> tuple[list[str], int, Survey]:
    """Delete every committed checkpoint below ``root`` (at any depth) and every
    unfinished save cloudckpt left there; leave everything else.

    Returns the URIs deleted, the number of objects deleted, and the survey taken
    before (its ``foreign`` keys are what was left alone). A checkpoint whose
    manifest cannot be read, or a save taken over meanwhile, is left with a WARNING.
    """
    store = as_store(root, storage_options)
    found = survey(store)
    if found.kind in (COMMITTED, OURS):
        return [store.uri], delete_checkpoint(store, force=True), found
    deleted: list[str] = []
    count = 0
    for prefix in found.checkpoints:
        sub = store.child(prefix)
        try:
            count += delete_checkpoint(sub)
        except (CorruptCheckpointError, NotACheckpointError) as exc:
            log.warning("left %s: %s", sub.uri, exc)
            continue
        deleted.append(sub.uri)
    for prefix in found.saves:
        if any(prefix.startswith(c + "/") for c in found.checkpoints):
            continue  # inside a checkpoint just deleted, which left it: still there
        sub = store.child(prefix)
        sub_found = survey(sub)
        try:
            count += delete_unfinished(sub, sub_found)
        except (CommitConflictError, CheckpointNotFoundError) as exc:
            log.warning("left %s: %s", sub.uri, exc)
            continue
        deleted.append(sub.uri)
    return deleted, count, found
