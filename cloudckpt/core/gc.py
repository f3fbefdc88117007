"""Garbage collection: what crashed saves and lost slot swaps leave behind.

Two kinds of garbage, both invisible to readers but taking space:

- unfinished saves: prefixes without a manifest that cloudckpt provably wrote
  (its writer claim, ROLL part markers, or only its reserved names: see
  :mod:`cloudckpt.core.ownership`), whose newest object is older than a grace
  period — a save still in progress is younger than that;
- slot generations that the slot's pointer does not name, older than the grace
  period (a crash between a generation's commit and the pointer swap, or
  during the old generation's deletion);
- blobs of the root's blob area that no committed checkpoint references and no
  live save holds, older than the grace period, and holds older than it
  (:func:`cloudckpt.core.blobs.sweep`); none while a manifest there cannot be read
  (what it references is unknown), which is a WARNING.

Nothing else is ever touched: prefixes holding objects cloudckpt did not write
(``logs/``, ``datasets/``) and roots holding checkpoints further down are
skipped, and each prefix is surveyed again just before it is deleted.

The grace period is what keeps a live save from being collected: set it well
above the longest save.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from cloudckpt.core.blobs import sweep
from cloudckpt.core.deletion import delete_checkpoint, delete_unfinished
from cloudckpt.core.ownership import COMMITTED, OURS, ROOT, Survey, survey
from cloudckpt.core.slots import GENERATION_RE, Slot
from cloudckpt.errors import CommitConflictError, CorruptCheckpointError
from cloudckpt.names import BLOB_AREA, MANIFEST_NAME, SLOT_POINTER_NAME
from cloudckpt.storage import Store, as_store, open_store

log = logging.getLogger(__name__)

DEFAULT_GRACE_SECONDS = 6 * 3600.0
UNFINISHED, ORPHAN, BLOBS = "unfinished save", "orphan generation", "unreferenced blobs"


@dataclass(frozen=True)
class Garbage:
    """One prefix gc would remove (or removed); ``objects`` and ``size`` count every
    object under it, hidden bookkeeping objects included."""

    uri: str
    reason: str
    objects: int
    size: int
    age_seconds: float
    kind: str = UNFINISHED
    #: The grace period it was found with: :func:`collect` checks it again.
    grace_seconds: float = DEFAULT_GRACE_SECONDS


def _age(s: Survey, now: float) -> float:
    """Seconds since the last write under ``s``; a listing without times counts as
    written just now, since a prefix whose age is unknown is never provably abandoned."""
    if s.newest is None:
        log.warning("gc: leaving %s: its listing tells no modification times", s.uri)
        return 0.0
    return now - s.newest


def _garbage(s: Survey, reason: str, kind: str, now: float, grace: float) -> Garbage:
    return Garbage(s.uri, reason, len(s.objects), s.size, _age(s, now), kind, grace)


def find_garbage(root: str | Store, storage_options: Mapping[str, Any] | None = None, *,
                 grace_seconds: float = DEFAULT_GRACE_SECONDS,
                 names: Callable[[str], Any] | None = None) -> list[Garbage]:
    """What lies directly below ``root`` (and in slots there, or ``root`` itself
    as a slot) that no reader can reach, that cloudckpt wrote, and that is older
    than ``grace_seconds``; ``names`` limits it to the prefixes whose names it
    accepts (e.g. a framework's own checkpoint names)."""
    store = as_store(root, storage_options)
    now = time.time()
    found: list[Garbage] = []
    slots = [store] if store.exists(SLOT_POINTER_NAME) else []
    listed = store.list_prefixes()
    if not listed:
        store.check_bucket()
    for name in listed:
        if name == BLOB_AREA:
            continue  # swept last, once the saves above are judged
        if names is not None and not names(name):
            continue
        sub = store.child(name)
        if (slots and GENERATION_RE.match(name)) or sub.exists(MANIFEST_NAME):
            continue  # generations are judged by their slot's pointer; committed stays
        s = survey(sub)
        if s.kind == ROOT and any(o.key == SLOT_POINTER_NAME for o in s.objects):
            slots.append(sub)
        elif s.kind == ROOT:
            log.info("gc: skipping %s: checkpoints or saves lie below it; run gc on it to "
                     "collect there", s.uri)
        elif s.kind == OURS:
            g = _garbage(s, "uncommitted: a save that never committed", UNFINISHED, now,
                         grace_seconds)
            if g.age_seconds >= grace_seconds:
                found.append(g)
        elif s.kind != COMMITTED:
            log.debug("gc: skipping %s (%s: not cloudckpt's)", s.uri, s.kind)
    for slot_store in slots:
        slot = Slot(slot_store)
        current = (slot.info() or {}).get("generation")
        for gen in slot.generations():
            if gen == current:
                continue
            g = _garbage(survey(slot_store.child(gen)),
                         f"orphan generation of slot {slot_store.uri}", ORPHAN, now,
                         grace_seconds)
            if g.age_seconds >= grace_seconds:
                found.append(g)
    if BLOB_AREA in listed:
        try:
            swept = sweep(store, grace_seconds=grace_seconds, dry_run=True)
        except CorruptCheckpointError as exc:  # what it references cannot be known
            log.warning("gc: leaving the blobs of %s: %s", store.child(BLOB_AREA).uri, exc)
            return found
        if swept.blobs or swept.holds:
            found.append(Garbage(store.child(BLOB_AREA).uri, "only the blobs in it that no "
                                 "committed checkpoint references and no live save holds, "
                                 "and stale holds",
                                 swept.blobs + swept.holds, swept.size, grace_seconds, BLOBS,
                                 grace_seconds))
    return found


def collect(garbage: list[Garbage], storage_options: Mapping[str, Any] | None = None) -> int:
    """Delete what :func:`find_garbage` found; return the number of objects removed.

    Each prefix is surveyed again first: one that a save has committed or written
    to since (younger than the grace period again), or that now holds objects
    cloudckpt did not write, is left alone; an unfinished save's claim is seized by
    compare-and-swap before anything goes, so a save that takes it over meanwhile
    keeps it and never commits half-deleted (:func:`cloudckpt.core.deletion.delete_unfinished`).
    """
    removed = 0
    for g in garbage:
        sub = open_store(g.uri, storage_options)
        if g.kind == BLOBS:  # marked and swept again, under the sweep record
            try:
                swept = sweep(sub.ancestor(1), grace_seconds=g.grace_seconds)
            except (CommitConflictError, CorruptCheckpointError) as exc:
                log.warning("gc: leaving the blobs of %s: %s", g.uri, exc)
                continue
            removed += swept.blobs + swept.holds
            continue
        now = survey(sub)
        if _age(now, time.time()) < g.grace_seconds:
            log.warning("gc: leaving %s: it was written to since it was found", g.uri)
            continue
        try:
            if g.kind == ORPHAN and now.kind == COMMITTED:
                removed += delete_checkpoint(sub)
            elif now.kind == OURS:
                removed += delete_unfinished(sub, now)
            else:
                log.warning("gc: leaving %s: it is no longer an unfinished save (%s)", g.uri,
                            now.kind)
                continue
        except CommitConflictError as exc:
            log.warning("gc: leaving %s: %s", g.uri, exc)
            continue
        log.info("gc: removed %s (%s)", g.uri, g.reason)
    return removed
