"""What a download of a run directory brings down, laid out as its framework expects.

A root (a run or trial directory) holds committed checkpoints and recover slots. On
local disk a framework expects each checkpoint's files at its path, and a slot's
current generation *at the slot's path* (that is the overwrite-in-place directory
the framework knows). :func:`tree_units` says what goes where (``cloudckpt download``
copies each); objects cloudckpt did not write are left out and counted.
"""

from __future__ import annotations

import logging

from cloudckpt.core.checkpoint import Checkpoint, open_checkpoint
from cloudckpt.core.ownership import COMMITTED, EMPTY, ROOT, not_a_checkpoint, survey
from cloudckpt.core.slots import GENERATION_RE, Slot
from cloudckpt.names import SLOT_POINTER_NAME
from cloudckpt.storage import Store

log = logging.getLogger(__name__)


def tree_units(store: Store) -> list[tuple[str, Checkpoint]]:
    """What a download of ``store``'s prefix brings down: (relative path, checkpoint)
    for every slot's current generation and every committed checkpoint outside slots."""
    found = survey(store)
    if found.kind == COMMITTED:
        return [("", open_checkpoint(store))]
    if found.kind == EMPTY:
        store.check_bucket()  # a misspelt bucket is said to be one, not an empty prefix
    if found.kind != ROOT:
        raise not_a_checkpoint(found)
    slots = sorted({o.key[: -len(SLOT_POINTER_NAME)].rstrip("/") for o in found.objects
                    if o.key.rsplit("/", 1)[-1] == SLOT_POINTER_NAME})
    units = [(s, Slot(store.child(s) if s else store).current()) for s in slots]
    units += [(c, open_checkpoint(store.child(c))) for c in found.checkpoints
              if not _generation(c, slots)]
    if found.foreign:
        log.info("%s: %d object(s) cloudckpt did not write are not downloaded (e.g. %s)",
                 store.uri, len(found.foreign), found.foreign[0])
    return units


def _generation(prefix: str, slots: list[str]) -> bool:
    parent, _, name = prefix.rpartition("/")
    return parent in slots and GENERATION_RE.match(name) is not None
