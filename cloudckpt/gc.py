"""Garbage collection: what crashed saves and lost slot swaps leave behind.

Two kinds of garbage, both invisible to readers but taking space:

- uncommitted prefixes (objects, no manifest) whose newest object is older
  than a grace period — a save still in progress is younger than that;
- slot generations that the slot's pointer does not name, older than the grace
  period (a crash between a generation's commit and the pointer swap, or
  during the old generation's deletion).

The grace period is what keeps a live save from being collected: set it well
above the longest save.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .checkpoint import list_checkpoints
from .manifest import MANIFEST_NAME
from .slot import GENERATION_RE, POINTER, RecoverSlot
from .storage import Store, open_store

log = logging.getLogger("cloudckpt")

DEFAULT_GRACE_SECONDS = 6 * 3600.0


@dataclass(frozen=True)
class Garbage:
    """One prefix gc would remove (or removed)."""

    uri: str
    reason: str
    objects: int
    size: int
    age_seconds: float


def _age(store: Store, now: float) -> tuple[float, int, int]:
    # Hidden objects count: the parts of a streamed upload still running are the
    # newest sign of life of that save.
    objs = store.list(internal=True)
    newest = max((o.mtime or 0.0 for o in objs), default=0.0)
    return now - newest, len(objs), sum(o.size for o in objs)


def find_garbage(root: str | Store, storage_options: Mapping[str, Any] | None = None, *,
                 grace_seconds: float = DEFAULT_GRACE_SECONDS) -> list[Garbage]:
    """What lies directly below ``root`` (and in slots there, or ``root`` itself
    as a slot) that no reader can reach and is older than ``grace_seconds``."""
    store = root if isinstance(root, Store) else open_store(root, storage_options)
    now = time.time()
    found: list[Garbage] = []
    slots = [store] if store.exists(POINTER) else []
    for info in list_checkpoints(store, include_uncommitted=True):
        sub = store.child(info.name)
        if info.committed or (GENERATION_RE.match(info.name) and slots):
            continue
        if sub.exists(POINTER):
            slots.append(sub)
            continue
        age, n, size = _age(sub, now)
        if age >= grace_seconds and not sub.exists(MANIFEST_NAME):
            found.append(Garbage(sub.uri, "uncommitted: no manifest", n, size, age))
    for slot_store in slots:
        slot = RecoverSlot(slot_store)
        current = (slot.info() or {}).get("generation")
        for gen in slot.generations():
            if gen == current:
                continue
            age, n, size = _age(slot_store.child(gen), now)
            if age >= grace_seconds:
                found.append(Garbage(slot_store.child(gen).uri,
                                     f"orphan generation of slot {slot_store.uri}", n, size, age))
    return found


def collect(garbage: list[Garbage], storage_options: Mapping[str, Any] | None = None) -> int:
    """Delete what :func:`find_garbage` found; return the number of objects removed."""
    removed = 0
    for g in garbage:
        sub = open_store(g.uri, storage_options)
        sub.delete([MANIFEST_NAME])  # an orphan generation may be committed: hide it first
        removed += sub.delete_prefix("")
        log.info("gc: removed %s (%s)", g.uri, g.reason)
    return removed
