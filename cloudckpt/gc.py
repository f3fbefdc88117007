"""Garbage collection: what crashed saves and lost slot swaps leave behind.

Two kinds of garbage, both invisible to readers but taking space:

- unfinished saves: prefixes without a manifest that cloudckpt provably wrote
  (its writer claim, ROLL part markers, or only its reserved names: see
  :mod:`cloudckpt.ownership`), whose newest object is older than a grace
  period — a save still in progress is younger than that;
- slot generations that the slot's pointer does not name, older than the grace
  period (a crash between a generation's commit and the pointer swap, or
  during the old generation's deletion).

Nothing else is ever touched: prefixes holding objects cloudckpt did not write
(``logs/``, ``datasets/``) and roots holding checkpoints further down are
skipped, and each prefix is surveyed again just before it is deleted.

The grace period is what keeps a live save from being collected: set it well
above the longest save.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .manifest import MANIFEST_NAME, SLOT_POINTER_NAME
from .ownership import OURS, ROOT, Survey, survey
from .slot import GENERATION_RE, RecoverSlot
from .storage import Store, open_store

log = logging.getLogger("cloudckpt")

DEFAULT_GRACE_SECONDS = 6 * 3600.0
UNFINISHED, ORPHAN = "unfinished save", "orphan generation"


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


def _garbage(s: Survey, reason: str, kind: str, now: float) -> Garbage:
    return Garbage(s.uri, reason, len(s.objects), s.size, now - (s.newest or 0.0), kind)


def find_garbage(root: str | Store, storage_options: Mapping[str, Any] | None = None, *,
                 grace_seconds: float = DEFAULT_GRACE_SECONDS) -> list[Garbage]:
    """What lies directly below ``root`` (and in slots there, or ``root`` itself
    as a slot) that no reader can reach, that cloudckpt wrote, and that is older
    than ``grace_seconds``."""
    store = root if isinstance(root, Store) else open_store(root, storage_options)
    now = time.time()
    found: list[Garbage] = []
    slots = [store] if store.exists(SLOT_POINTER_NAME) else []
    names = store.list_prefixes()
    if not names:
        store.check_bucket()
    for name in names:
        if slots and GENERATION_RE.match(name):
            continue  # judged against the slot's pointer below
        s = survey(store.child(name))
        if s.kind == ROOT and any(o.key == SLOT_POINTER_NAME for o in s.objects):
            slots.append(store.child(name))
        elif s.kind == ROOT:
            log.info("gc: skipping %s, %d checkpoints lie below it; run gc on it to "
                     "collect there", s.uri, len(s.checkpoints))
        elif s.kind == OURS:
            g = _garbage(s, "uncommitted: a save that never committed", UNFINISHED, now)
            if g.age_seconds >= grace_seconds:
                found.append(g)
        elif s.kind != "committed":
            log.debug("gc: skipping %s (%s: not cloudckpt's)", s.uri, s.kind)
    for slot_store in slots:
        slot = RecoverSlot(slot_store)
        current = (slot.info() or {}).get("generation")
        for gen in slot.generations():
            if gen == current:
                continue
            g = _garbage(survey(slot_store.child(gen)),
                         f"orphan generation of slot {slot_store.uri}", ORPHAN, now)
            if g.age_seconds >= grace_seconds:
                found.append(g)
    return found


def collect(garbage: list[Garbage], storage_options: Mapping[str, Any] | None = None) -> int:
    """Delete what :func:`find_garbage` found; return the number of objects removed.

    Each prefix is surveyed again first: one that a save has committed since, or
    that now holds objects cloudckpt did not write, is left alone.
    """
    removed = 0
    for g in garbage:
        sub = open_store(g.uri, storage_options)
        now = survey(sub)
        if g.kind == UNFINISHED and now.kind != OURS:
            log.warning("gc: leaving %s: it is no longer an unfinished save (%s)", g.uri,
                        now.kind)
            continue
        hidden_first = g.kind == ORPHAN and any(o.key == MANIFEST_NAME for o in now.objects)
        if hidden_first:
            sub.delete([MANIFEST_NAME])  # an orphan generation may be committed: hide it first
        removed += sub.delete_prefix("") + int(hidden_first)
        log.info("gc: removed %s (%s)", g.uri, g.reason)
    return removed
