"""Committed checkpoints: open, read and verify against the manifest.

A checkpoint's objects are read through its manifest only (invariant 2): each
read checks size and CRC32C, and an incremental checkpoint's blobs are read
from its run's blob area (:mod:`cloudckpt.core.blobs`) under the names the
manifest gives.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from cloudckpt.core.blobs import BlobArea, digest_of
from cloudckpt.core.manifest import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    FileEntry,
    Manifest,
    read_manifest_bytes,
)
from cloudckpt.core.ownership import (
    COMMITTED,
    EMPTY,
    missing_manifest_error,
    part_of_unfinished,
    survey,
    unfinished_whole,
)
from cloudckpt.errors import (
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    ManifestError,
)
from cloudckpt.storage import Store, as_store
from cloudckpt.util.crc import crc32c_hex

__all__ = ["Checkpoint", "open_checkpoint", "read_manifest"]


def _resolving(store: Store, manifest: Manifest) -> Store:
    """A read-only view of the checkpoint at ``store`` whose reads of the objects
    kept elsewhere (blobs of the run's area, objects in a writer area) go there,
    under the names ``manifest`` gives."""
    if manifest.standard:
        return store if store.written_under is None else store.ancestor(0)
    located: dict[str, str] = {}
    top = 0
    try:
        if manifest.blob_depth is not None:
            area = BlobArea.above(store, manifest.blob_depth)
            area.depth_of(store)  # not inside the area itself
            located.update((p, area.store.path(d)) for p, d in manifest.blobs.items())
            top = manifest.blob_depth
        if manifest.writer_area is not None and manifest.writer_depth is not None:
            anchor = store.ancestor(manifest.writer_depth)
            below = f"{manifest.writer_area}{store.root[len(anchor.root):]}"
            located.update((p, anchor.path(f"{below}/{p}")) for p in manifest.moved)
            top = max(top, manifest.writer_depth)
        base = store.ancestor(top)
    except ConfigError:
        raise CorruptCheckpointError(
            f"the manifest of {store.uri} puts objects above the bucket (or inside a blob "
            "area): it is malformed", {}) from None
    return base.child(store.root[len(base.root) + 1:]).located(located)


class Checkpoint:
    """A committed checkpoint: its manifest and verified reads of its objects."""

    def __init__(self, store: Store, manifest: Manifest) -> None:
        self.store = _resolving(store, manifest)
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

    def matches(self, path: str, data: bytes) -> bool:
        """Whether ``data`` is object ``path`` as the manifest records it (for bytes
        read before the manifest was)."""
        entry = self.manifest.files.get(path)
        return entry is not None and _problem(entry, data) is None

    @contextmanager
    def reading(self, path: str) -> Iterator[None]:
        """Reads of object ``path`` inside: one that finds it missing, or ending before
        the bytes asked for, raises :class:`CorruptCheckpointError` naming it, since
        the manifest lists it with its size. Failures of the store itself (denied, an
        outage) pass as they are: they say nothing of the checkpoint."""
        try:
            yield
        except FileNotFoundError as exc:
            raise self._disagrees(path, "missing", exc) from exc
        except EOFError as exc:
            raise self._disagrees(path, "shorter than the manifest says", exc) from exc

    def _disagrees(self, path: str, problem: str, exc: BaseException) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"object {path!r} of {self.uri} is {problem} ({exc}); the manifest lists it "
            f"with {self.entry(path).size} bytes. Restore it from a copy or fall back to an "
            "earlier checkpoint.", {path: problem})

    def read(self, path: str) -> bytes:
        """Read a whole object, checking size and CRC32C.

        Large objects are fetched as parallel ranged reads of ``part_size``.
        """
        entry = self.entry(path)
        chunk = max(self.store.part_size, 1 << 20)
        with self.reading(path):
            if entry.size > 2 * chunk:
                ranges = [(path, s, min(s + chunk, entry.size))
                          for s in range(0, entry.size, chunk)]
                data = b"".join(self.store.get_ranges(ranges))
            else:
                data = self.store.get(path)
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
        with self.reading(path):
            return self.store.get_range(path, start, end)

    def part(self, prefix: str) -> Checkpoint:
        """The checkpoint committed at ``prefix`` inside this one (a part of a
        multi-part save), its manifest read as one of this checkpoint's objects: one
        that is missing or not the bytes committed here is corrupt, like any other."""
        key = f"{prefix}/{MANIFEST_NAME}"
        entry = self.manifest.files.get(key)
        if entry is None:
            raise CorruptCheckpointError(
                f"the manifest of {self.uri} lists no part at {prefix}/ (no {key}); the "
                "checkpoint is not whole. Fall back to an earlier checkpoint.",
                {key: "not in the manifest"})
        if entry.size > MAX_MANIFEST_BYTES:
            raise ManifestError(f"the manifest of {self.uri} says {key} is {entry.size} "
                                f"bytes, over the {MAX_MANIFEST_BYTES} limit of a manifest")
        return Checkpoint(self.store.child(prefix),
                          Manifest.from_json(self.read(key), source=self.store.key_uri(key)))

    def iter_objects(self) -> Iterator[tuple[str, bytes]]:
        """Yield ``(path, bytes)`` for every object, checked, in parallel batches."""
        batch = max(self.store.max_concurrency, 1)
        files = self.files
        for i in range(0, len(files), batch):
            yield from self.read_many(files[i : i + batch]).items()

    def verify(self, deep: bool = False) -> None:
        """Check every object exists with the right size; with ``deep``, also its CRC32C
        (and a blob's SHA-256, its name). What lies elsewhere (blobs, moved objects)
        is looked up by name, the rest in one listing.

        Raises :class:`CorruptCheckpointError` listing every bad object.
        """
        problems: dict[str, str] = {}
        files = self.manifest.files
        listed = {o.key: o.size for o in self.store.list()}
        elsewhere = [p for p, e in files.items() if e.blob or e.moved]  # not in the listing
        for path, info in zip(elsewhere, self.store.map(self.store.info, elsewhere),
                              strict=True):
            listed.pop(path, None)
            if info is not None:
                listed[path] = info.size
        for path, entry in files.items():
            if path not in listed:
                problems[path] = "missing"
            elif listed[path] != entry.size:
                problems[path] = f"size {listed[path]} != {entry.size} in manifest"
        if deep:
            todo = [p for p in self.files if p not in problems]

            def check(path: str) -> tuple[str, str | None]:
                try:
                    return path, _problem(files[path], self.store.get(path))
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
    if entry.blob and digest_of(data) != entry.blob:
        return f"its bytes are not blob {entry.blob} (SHA-256 {digest_of(data)})"
    return None


def read_manifest(store: Store) -> Manifest:
    """Load and validate the manifest of the checkpoint rooted at ``store``.

    Without a manifest, the prefix is surveyed to say what it is instead:
    :class:`IncompleteCheckpointError` for a save cloudckpt started and never
    committed, :class:`NotACheckpointError` for a root holding checkpoints or for
    objects cloudckpt did not write, :class:`CheckpointNotFoundError` when nothing
    is there (:class:`BucketNotFoundError` when not even the bucket is).
    """
    return read_manifest_and_bytes(store)[0]


def read_manifest_and_bytes(store: Store, retry: bool = True) -> tuple[Manifest, bytes]:
    """:func:`read_manifest`, with the bytes it was parsed from (one read gives a caller
    both the manifest and what its checksum is taken over)."""
    try:
        data = read_manifest_bytes(store)  # bounded: never more than MAX_MANIFEST_BYTES
    except FileNotFoundError:
        found = survey(store)
        if found.kind == COMMITTED and retry:  # committed between the read and the listing
            return read_manifest_and_bytes(store, retry=False)
        if found.kind == EMPTY:
            store.check_bucket()
        raise missing_manifest_error(found) from None
    return Manifest.from_json(data, source=store.key_uri(MANIFEST_NAME)), data


def open_checkpoint(
    uri: str | Store, storage_options: Mapping[str, Any] | None = None
) -> Checkpoint:
    """Open the committed checkpoint at ``uri`` (its manifest is read and validated).
    A part of a save that never committed (``<save>/model`` of a torn copy) is
    refused with :class:`IncompleteCheckpointError`, its own manifest
    notwithstanding (:func:`~cloudckpt.core.ownership.unfinished_whole`)."""
    store = as_store(uri, storage_options)
    manifest = read_manifest(store)
    whole = unfinished_whole(store)
    if whole is not None:
        raise part_of_unfinished(store, whole)
    return Checkpoint(store, manifest)
