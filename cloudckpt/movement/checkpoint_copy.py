"""Copy a committed checkpoint between any two stores, verified end to end.

Every object is checked against the source manifest (size and CRC32C) before
it is recorded (:mod:`cloudckpt.movement.copying` moves the bytes: on the server within
one store, in parallel ranges into local disk, streamed otherwise), and only
then is the source's manifest written at the destination, create-only: the
copy is committed exactly like a save, with the same step, metadata and commit
id. A copy interrupted for any reason resumes when run again.

A copy or download of an incremental checkpoint holds the standard layout: each
blob's bytes at its object's path, and manifests (its parts' too) that list them
there (:func:`standard_layout`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from cloudckpt.core.checkpoint import Checkpoint, CheckpointWriter, open_checkpoint
from cloudckpt.core.deletion import remove_leftovers
from cloudckpt.core.manifest import MANIFEST_NAME, FileEntry, Manifest
from cloudckpt.core.ownership import COMMITTED, FOREIGN, OURS, ROOT, not_a_checkpoint, survey
from cloudckpt.errors import CommitConflictError, CorruptCheckpointError, NotACheckpointError
from cloudckpt.movement.copying import Progress, Report, checksum_object
from cloudckpt.movement.copying import copy_objects as _copy_objects
from cloudckpt.storage import ObjectInfo, Store, as_store, open_store
from cloudckpt.util.crc import crc32c_hex

log = logging.getLogger(__name__)


def copy_checkpoint(
    src: str | Checkpoint,
    dst: str | Store,
    *,
    src_options: Mapping[str, Any] | None = None,
    dst_options: Mapping[str, Any] | None = None,
    progress: Progress | None = None,
) -> Checkpoint:
    """Copy the committed checkpoint ``src`` to ``dst`` and commit it there.

    If ``dst`` already holds the very same checkpoint (same commit id), nothing
    is copied. If it holds what an interrupted copy left (cloudckpt's claim on it),
    the copy resumes: objects already there with the manifest's size and CRC32C are
    kept, everything else the interrupted copy left is replaced. A destination
    holding anything else is refused before anything is written:
    :class:`CommitConflictError` for another checkpoint, :class:`NotACheckpointError`
    for a root holding checkpoints or objects cloudckpt did not write.

    ``progress`` is called with the number of bytes of each chunk done (from
    several threads; calls are serialised), objects kept on resume included, counted
    by the source's sizes: the calls add up to ``ckpt.total_size`` once it is done. If
    the copy fails, what it wrote stays, claimed and marked abandoned, for a rerun
    to resume (or ``cloudckpt gc`` / ``rm --force`` to remove).
    """
    ckpt = src if isinstance(src, Checkpoint) else open_checkpoint(src, src_options)
    store = as_store(dst, dst_options)
    found = survey(store)
    if found.kind == COMMITTED:
        return _already_there(ckpt, store, progress)
    if found.kind in (ROOT, FOREIGN):
        raise NotACheckpointError(
            f"cannot copy {ckpt.uri} to {store.uri}: {not_a_checkpoint(found)} Nothing was "
            "copied: name a new URI (or an empty directory) for the copy.")
    # A copy holds the standard layout, even when it resumes: a copy still running
    # elsewhere writes the same bytes under each name.
    writer = CheckpointWriter(store, step=ckpt.step, metadata=ckpt.metadata,
                              kind=ckpt.manifest.kind, own_paths=True)
    manifest, parts = standard_layout(ckpt)
    report = Report(progress)
    try:
        kept = _resume(ckpt, writer, manifest, report) if found.kind == OURS else set()
        _copy_objects(ckpt, writer, [p for p in ckpt.files if p not in kept | parts.keys()],
                      progress)
        rewritten = {p: data for p, data in parts.items() if p not in kept}
        writer.put_many(rewritten)
        report(sum(ckpt.entry(p).size for p in rewritten))
        return writer.commit(manifest)
    except BaseException:
        writer.abandon()  # what was copied stays, provably ours, for a rerun to resume
        raise


def _already_there(ckpt: Checkpoint, store: Store, progress: Progress | None) -> Checkpoint:
    try:
        existing = open_checkpoint(store)
    except CorruptCheckpointError as exc:
        raise CommitConflictError(
            f"{store.uri} already holds a checkpoint whose manifest cannot be read ({exc}); "
            "copy to another URI, or delete it first (cloudckpt rm)") from None
    if existing.manifest.commit_id != ckpt.manifest.commit_id:
        raise CommitConflictError(
            f"{store.uri} already holds a different checkpoint (commit "
            f"{existing.manifest.commit_id}, step {existing.step}); copy to another URI, or "
            "delete it first (cloudckpt rm)")
    log.info("%s already holds commit %s; nothing to copy", store.uri, ckpt.manifest.commit_id)
    if progress:
        progress(ckpt.total_size)
    return existing


def standard_layout(ckpt: Checkpoint) -> tuple[Manifest, dict[str, bytes]]:
    """The manifest a copy of ``ckpt`` commits (same commit; every object at its own
    path), and the part manifests it holds instead of the source's (``{path: bytes}``):
    a part of an incremental checkpoint references blobs a copy does not have, and
    one of a save that moved its objects, a writer area."""
    manifest = ckpt.manifest.materialized()
    if ckpt.manifest.standard:
        return manifest, {}
    parts = {}
    for path in ckpt.files:
        if path.endswith(f"/{MANIFEST_NAME}"):
            part = Manifest.from_json(ckpt.read(path), source=f"{ckpt.uri}/{path}")
            parts[path] = part.materialized().to_json()
    files = {**manifest.files, **{p: FileEntry(len(b), crc32c_hex(b)) for p, b in parts.items()}}
    return dataclasses.replace(manifest, files=files), parts


def _resume(ckpt: Checkpoint, writer: CheckpointWriter, manifest: Manifest, report: Report
            ) -> set[str]:
    """Take over what an interrupted copy (or save) left at the destination: claim it,
    keep and record each object whose size and CRC32C (read back) are the manifest's,
    delete the rest (other bytes, upload parts, temporary files). Returns what was kept.

    Raises :class:`CommitConflictError` if a copy still running holds the claim.
    """
    store = writer.store
    # An abandoned claim, or one of a process that is gone, is taken over; what the
    # prefix held then is what this copy resumes from.
    found = writer.claim()
    assert found is not None
    entries = manifest.files
    kept = _matching(store, entries, found.objects)
    for key in sorted(kept):
        writer.add_existing(key, entries[key].size, entries[key].crc32c)
        report(ckpt.entry(key).size)  # a part manifest's size at the source, as counted
    stale = remove_leftovers(store, (o.key for o in found.objects), keep=kept)
    log.info("resuming the copy of %s into %s: %d of %d objects already there and checked, "
             "%d leftovers removed", ckpt.uri, store.uri, len(kept), len(entries), len(stale))
    return kept


def _matching(store: Store, entries: Mapping[str, FileEntry],
              objects: Iterable[ObjectInfo]) -> set[str]:
    """The keys among ``objects`` whose bytes (read back, streamed, in parallel) have
    the size and CRC32C ``entries`` lists for them."""
    candidates = [o.key for o in objects if o.key in entries and o.size == entries[o.key].size]

    def check(key: str) -> tuple[str, bool]:
        try:
            return key, checksum_object(store, key, entries[key].size) == (
                entries[key].size, entries[key].crc32c)
        except (FileNotFoundError, EOFError):
            return key, False

    return {k for k, good in store.map(check, candidates) if good}


def download(uri: str | Checkpoint, local_dir: str | os.PathLike,
             storage_options: Mapping[str, Any] | None = None) -> Path:
    """Download a committed checkpoint (an HF export, a framework's checkpoint) into
    ``local_dir``, every file checked, beside its manifest; files already there with
    the right size and CRC32C are skipped (a cache that repairs itself). Returns the
    directory.

    Files are written through a local store rooted at ``local_dir``, so a symbolic
    link already in the destination never leads a write outside it.
    """
    ckpt = uri if isinstance(uri, Checkpoint) else open_checkpoint(uri, storage_options)
    root = Path(local_dir)
    root.mkdir(parents=True, exist_ok=True)
    dest = open_store(str(root.resolve()))
    manifest, parts = standard_layout(ckpt)
    present = _matching(dest, manifest.files, dest.list())
    todo = [path for path in ckpt.files if path not in present]
    for path in todo:  # each read is itself parallel
        dest.put(path, parts[path] if path in parts else ckpt.read(path))
    dest.put(MANIFEST_NAME, manifest.to_json())
    log.info("downloaded %s to %s (%d files fetched, %d already present)", ckpt.uri, root,
             len(todo), len(ckpt.files) - len(todo))
    return root
