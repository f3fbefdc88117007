"""Deleting: only what cloudckpt can prove is its own (invariant 7 of docs/architecture.md).

A committed checkpoint loses its manifest first (it vanishes at once), then
exactly the objects the manifest lists; an unfinished save of cloudckpt's
(:mod:`cloudckpt.core.ownership`) goes once its claim is seized; a root only
checkpoint by checkpoint. Nothing else is ever deleted.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Mapping
from typing import Any

from cloudckpt.core import claim, plugins, rootindex
from cloudckpt.core.blobs import sweep
from cloudckpt.core.committed import read_manifest
from cloudckpt.core.ownership import (
    COMMITTED,
    OURS,
    Survey,
    classify,
    inside,
    is_reserved,
    missing_manifest_error,
    survey,
)
from cloudckpt.errors import (
    CheckpointNotFoundError,
    CloudCkptError,
    CommitConflictError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    ManifestError,
    NotACheckpointError,
)
from cloudckpt.names import BLOB_AREA, CLAIM_NAME, INDEX_NAME, MANIFEST_NAME
from cloudckpt.storage import Store, as_store, versioning

log = logging.getLogger(__name__)


def delete_checkpoint(uri: str | Store, storage_options: Mapping[str, Any] | None = None,
                      *, force: bool = False) -> int:
    """Delete a checkpoint: manifest first (it vanishes at once), then the objects it
    lists (and those of the generation it replaced that are left, its ``superseded``
    keys); the root index above it (:mod:`cloudckpt.core.rootindex`) drops its entry.
    Anything else under the prefix (another checkpoint or save further down, objects
    cloudckpt did not write) stays, with a WARNING naming it.

    ``force`` also deletes a save that cloudckpt started and never committed, and a
    checkpoint whose manifest cannot be read (then everything under its prefix).
    Nothing else is ever deleted: a root holding checkpoints or objects cloudckpt
    did not write raise :class:`NotACheckpointError` (see
    :mod:`cloudckpt.core.ownership`; :func:`delete_tree` deletes a root's checkpoints).
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
            parent = rootindex.parent_of(store)
            if parent is not None:  # listings show it unreadable, not as the index had it
                rootindex.fix(parent, store.root.rsplit("/", 1)[-1], None)
            raise
        log.warning("deleting %s, whose manifest cannot be read, with all it holds", store.uri)
        with claim.deleting(store), rootindex.deleting(store):
            store.delete([MANIFEST_NAME])
        return _said(store, store.delete_prefix(""))
    # A claim marked "deleting" first: a delete cut short leaves objects that still
    # prove to be cloudckpt's, for gc and rm --force.
    with claim.deleting(store):
        with rootindex.deleting(store):  # its root's index: marked first, dropped after
            store.delete([MANIFEST_NAME])  # invisible from here on
        listed = [o for o in store.list(internal=True) if o.key != CLAIM_NAME]
        found = classify(store.uri, listed)
        units = (*found.checkpoints, *found.saves)
        markers = plugins.marker_dirs()
        gone = {*manifest.files, *manifest.superseded}  # and what a replace left
        mine = [o.key for o in listed if o.key in gone
                or (is_reserved(o.key, markers) and not inside(o.key, units))]
        left = sorted({o.key for o in listed} - set(mine))
        store.delete(mine)
    store.delete([CLAIM_NAME])  # the mark goes last
    if manifest.blob_depth == 1:
        release_blobs(store.ancestor(1), manifest.blobs.values())
    if left:
        log.warning("deleted checkpoint %s; left %d object(s) under it that it does not "
                    "list (e.g. %s): cloudckpt deletes only what it wrote", store.uri,
                    len(left), left[0])
    return _said(store, len(mine) + 1)  # and the manifest


def _said(store: Store, deleted: int) -> int:
    """``deleted``, once a bucket keeping versions has been said to keep them (the
    first delete from it in this process: a run's retention says it once)."""
    versioning.log_once(store, f"deleted {store.uri} ({deleted} objects)")
    return deleted


def release_blobs(parent: Store, blobs: Iterable[str]) -> None:
    """After a checkpoint referencing ``blobs`` of ``parent``'s area was deleted: sweep
    the area, so that those no other checkpoint references go now. A sweep that cannot
    run (another one runs, a manifest cannot be read) leaves them for ``gc``."""
    try:
        sweep(parent, released=set(blobs))
    except (CommitConflictError, CloudCkptError) as exc:
        log.warning("left the blobs of the deleted checkpoint in %s/%s for gc: %s",
                    parent.uri, BLOB_AREA, exc)


def remove_leftovers(store: Store, keys: Iterable[str], keep: Collection[str] = ()) -> list[str]:
    """Delete what a save that never committed left at ``store``, a prefix whose claim
    this writer holds: every one of ``keys`` except the claim and ``keep``. The one
    place torn saves are cleaned up; returns the keys deleted."""
    stale = [k for k in keys if k != CLAIM_NAME and k not in keep]
    if stale:
        store.delete(stale)
    return stale


def delete_unfinished(store: Store, found: Survey) -> int:
    """Delete the unfinished save of cloudckpt's that ``found`` surveyed at ``store``.

    Its claim is seized first, by compare-and-swap on what the survey saw
    (:func:`cloudckpt.core.claim.seized`): a save that took the prefix over since keeps it
    (:class:`CommitConflictError`, nothing deleted), and a writer that held it all
    along can no longer commit into what is deleted. Returns the objects deleted.
    """
    if found.kind != OURS:
        raise missing_manifest_error(found) if found.kind != COMMITTED else CommitConflictError(
            f"{store.uri} was committed meanwhile; not deleting it as an unfinished save")
    with claim.seized(store, found.objects) as ours:
        if not ours:
            raise CommitConflictError(
                f"another save took {store.uri} over while it was to be deleted; nothing "
                "was deleted")
        keys = remove_leftovers(store, (o.key for o in store.list(internal=True)))
        if store.exists(MANIFEST_NAME):
            # Its writer passed its last check just before the claim was seized and
            # committed while the data went: hide the torn result rather than show it.
            log.error("a save committed %s while it was deleted as unfinished; its data "
                      "is gone, so its manifest is removed too", store.uri)
            store.delete([MANIFEST_NAME])
    store.delete([CLAIM_NAME])
    return _said(store, len(keys) + int(any(o.key == CLAIM_NAME for o in found.objects)))


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
    if found.kind == COMMITTED:
        return [store.uri], delete_checkpoint(store, force=True), found
    if found.kind == OURS:
        return [store.uri], delete_unfinished(store, found), found
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
        if inside(prefix, found.checkpoints):
            continue  # inside a checkpoint just deleted, which left it: still there
        sub = store.child(prefix)
        sub_found = survey(sub)
        try:
            count += delete_unfinished(sub, sub_found)
        except (CommitConflictError, CheckpointNotFoundError) as exc:
            log.warning("left %s: %s", sub.uri, exc)
            continue
        deleted.append(sub.uri)
    # The root indexes of what was emptied: caches of what is gone, rebuilt if needed.
    indexes = [o.key for o in found.objects if o.key.rsplit("/", 1)[-1] == INDEX_NAME
               and not inside(o.key, found.checkpoints)]
    if indexes:
        store.delete(indexes)
        count += len(indexes)
    return deleted, count, found
