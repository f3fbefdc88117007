"""Replacing a committed checkpoint: a save onto a URI that holds one (DCP's
``overwrite=True``), safe at every instant.

The replacing writer writes its objects under its own writer area, never at the
committed objects' names (invariant 12 of docs/architecture.md); its manifest replaces
the old one by compare-and-swap on the version read before the save claimed the prefix,
so of a zombie and the save that took it over, or two racing saves, exactly one commit
counts; and only after the swap are the old generation's objects that the new manifest
does not reference deleted (invariant 5). Those keys are listed in the new manifest
(``superseded``), so a cleanup cut short is finished by whoever next replaces or deletes
the checkpoint.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass

from cloudckpt.core.deletion import release_blobs
from cloudckpt.core.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, Manifest
from cloudckpt.errors import CommitConflictError, ConfigError, ManifestError
from cloudckpt.storage import Store

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Replaced:
    """The committed checkpoint a save replaces: its manifest, and the version of the
    manifest object that the swap expects to find."""

    manifest: Manifest
    version: str


def find(store: Store, kind: str) -> Replaced | None:
    """The checkpoint committed at ``store`` that a save of ``kind`` is to replace (None
    when there is none). Refused with :class:`CommitConflictError`: one of another kind,
    and one that is part of a larger checkpoint, whose manifest lists this one's bytes."""
    info = store.info(MANIFEST_NAME)
    if info is None:
        return None
    uri = store.key_uri(MANIFEST_NAME)
    if info.size > MAX_MANIFEST_BYTES:
        raise ManifestError(f"{uri} is {info.size} bytes, over the {MAX_MANIFEST_BYTES} limit "
                            "of a manifest; not replacing what it is")
    try:
        raw, version = store.get_with_version(MANIFEST_NAME)
    except FileNotFoundError:
        return None  # deleted meanwhile: a fresh save
    old = Manifest.from_json(raw, source=uri)
    _check_replaceable(store, old, kind)
    log.warning("replacing the checkpoint committed at %s (step %s, commit %s): its objects "
                "are deleted once the new one commits", store.uri, old.step, old.commit_id)
    return Replaced(old, version)


def _check_replaceable(store: Store, old: Manifest, kind: str) -> None:
    if old.kind != kind:
        raise CommitConflictError(
            f"{store.uri} holds a checkpoint of kind {old.kind!r}, which a save of kind "
            f"{kind!r} does not replace. Save to another URI, or delete it first "
            f"(cloudckpt rm {store.uri}).")
    if store.written_under is not None or old.writer_depth not in (None, 0) \
            or old.blob_depth not in (None, 1):
        raise CommitConflictError(
            f"{store.uri} is a part of a larger save (its objects lie in that save's area); "
            "replacing it would tear that save. Save to another URI.")
    above = _enclosing(store)
    if above is not None:
        raise CommitConflictError(
            f"{store.uri} lies inside the checkpoint committed at {above}, whose manifest "
            "lists its bytes; replacing it would make that checkpoint corrupt. Save to "
            "another URI.")


def _enclosing(store: Store) -> str | None:
    """The URI of a checkpoint committed at a prefix above ``store``, if any."""
    ups: list[Store] = []
    while True:
        try:
            ups.append(store.ancestor(len(ups) + 1))
        except ConfigError:
            break
    found = store.map(lambda up: up.exists(MANIFEST_NAME), ups)
    return next((up.uri for up, there in zip(ups, found, strict=True) if there), None)


def superseded(old: Manifest, new: Manifest, present: Collection[str]) -> tuple[str, ...]:
    """The keys the replaced generation held that ``new`` does not reference: its own
    objects, and those its own replacement left that are still ``present`` (listed when
    the save claimed the prefix)."""
    left = set(old.superseded).intersection(present)
    return tuple(sorted((old.live_keys | left) - new.live_keys))


def swap(store: Store, manifest: Manifest, replaced: Replaced) -> None:
    """Write ``manifest`` over the replaced one, by compare-and-swap on its version:
    :class:`CommitConflictError` when another save replaced or deleted it meanwhile."""
    try:
        store.put_if_match(MANIFEST_NAME, manifest.to_json(), replaced.version)
    except CommitConflictError:
        raise CommitConflictError(
            f"the checkpoint at {store.uri} was replaced or deleted by another save while "
            "this one ran; that one stands and this save is discarded (its objects are "
            "removed). Only one job should write a checkpoint URI.") from None


def clear(store: Store, replaced: Replaced, committed: Manifest) -> None:
    """After the swap: delete what the replaced generation held that the committed
    manifest does not reference, and release its blobs to the run's sweep. A delete that
    fails leaves the keys listed in the committed manifest, for the next replace or
    ``rm`` of it."""
    try:
        store.delete(committed.superseded)
    except Exception as exc:  # noqa: BLE001 - the commit stands; the keys stay listed
        log.warning("replaced %s, but could not delete the %d objects of the checkpoint it "
                    "replaced (%s); its manifest lists them as superseded, and the next "
                    "replace or `cloudckpt rm` of it deletes them", store.uri,
                    len(committed.superseded), exc)
    if replaced.manifest.blob_depth == 1:
        release_blobs(store.ancestor(1), replaced.manifest.blobs.values())
