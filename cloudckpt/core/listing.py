"""What a run directory holds: its checkpoints, newest last, and what else lies there."""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from cloudckpt.core.checkpoint import Checkpoint, open_checkpoint
from cloudckpt.core.manifest import MANIFEST_NAME, Manifest, read_manifest_bytes
from cloudckpt.core.ownership import (
    COMMITTED,
    EMPTY,
    FOREIGN,
    OURS,
    ROOT,
    part_dirs,
    survey,
    unfinished_whole,
)
from cloudckpt.errors import CorruptCheckpointError
from cloudckpt.names import BLOB_AREA
from cloudckpt.storage import Store, as_store

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointInfo:
    """One entry of a listing: a committed checkpoint, or another prefix.

    ``status`` is ``"committed"``, ``"uncommitted"`` (a save cloudckpt started and
    did not commit), ``"unreadable"`` (a manifest that cannot be read; ``error``
    says why), ``"part"`` (committed, but a part of a save that never committed:
    no checkpoint of its own; ``error`` names the save), ``"root"`` (checkpoints
    lie below it) or ``"foreign"`` (objects cloudckpt did not write). ``size`` and
    ``files`` count what is stored: the manifest's objects when committed,
    everything under the prefix otherwise; ``created`` is the commit time, or the
    newest object's time.
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
    #: The manifest the listing read (committed ones): open it without reading again.
    manifest: Manifest | None = field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        """The entry as plain data (for JSON), without the manifest."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "manifest"}

    def open(self, root: Store) -> Checkpoint:
        """The committed checkpoint this entry names below ``root``, from the manifest
        the listing read (read again only if it has none)."""
        sub = root.child(self.name)
        return Checkpoint(sub, self.manifest) if self.manifest else open_checkpoint(sub)

    def whole(self, root: Store) -> bool:
        """Whether every object of this committed checkpoint below ``root`` is there with
        the size its manifest lists (one listing). A resume asks before it picks the
        newest checkpoint: one missing, truncated or oversized objects is skipped with a
        WARNING naming them, as the manager's restore falls back from it, rather than
        fail the same way on every automatic restart."""
        try:
            self.open(root).verify()
        except CorruptCheckpointError as exc:
            log.warning("skipping %s: %s", self.uri, exc)
            return False
        return True


def _natural(name: str) -> tuple[Any, ...]:
    """``checkpoint-9`` before ``checkpoint-11``: digits compare as numbers."""
    return tuple(int(p) if i % 2 else p for i, p in enumerate(re.split(r"(\d+)", name)))


def _sort_key(c: CheckpointInfo) -> tuple[Any, ...]:
    """By step; a prefix without one (uncommitted, another tool's) by the number in its
    name, so a torn ``step-11`` lies between ``step-9`` and ``step-12``; then by time."""
    number = c.step
    if number is None:
        digits = re.findall(r"\d+", c.name)
        number = int(digits[-1]) if digits else -1
    return (number, c.created or 0.0, _natural(c.name))


_STATUS = {OURS: "uncommitted", ROOT: "root", FOREIGN: "foreign"}


def list_checkpoints(
    root: str | Store,
    storage_options: Mapping[str, Any] | None = None,
    *,
    include_uncommitted: bool = False,
) -> list[CheckpointInfo]:
    """The checkpoints directly below ``root``, oldest step first.

    Only committed checkpoints by default, with a WARNING naming each one skipped
    because its manifest cannot be read (malformed, or a field out of range);
    ``include_uncommitted`` adds every other prefix there, flagged
    ``committed=False`` with its ``status``.
    Raises :class:`BucketNotFoundError` when the bucket does not exist.
    """
    store = as_store(root, storage_options)
    names = store.list_prefixes()
    if not names:
        store.check_bucket()
    names = [n for n in names if n != BLOB_AREA]
    dirs = part_dirs()
    parts = [n for n in names if n in dirs]
    # A root that is itself a save never committed (a torn copy's step-1/): its
    # committed parts (model/) are no checkpoints of their own.
    whole = unfinished_whole(store.child(parts[0])) if parts else None

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
        if whole is not None and name in dirs:
            return CheckpointInfo(name, sub.uri, False, m.step, m.created, m.total_size,
                                  len(m.files), status="part",
                                  error=f"a part of the save at {whole.uri}, which never "
                                  "committed: no checkpoint of its own")
        return CheckpointInfo(name, sub.uri, True, m.step, m.created, m.total_size,
                              len(m.files), manifest=m)

    infos = [i for i in store.map(probe, names) if i is not None]
    if not include_uncommitted:
        for i in infos:
            if i.status == "unreadable":  # never a silent gap in a run
                log.warning("skipping %s: its manifest cannot be read (%s)", i.uri, i.error)
            elif i.status == "part":
                log.warning("skipping %s: %s", i.uri, i.error)
        infos = [i for i in infos if i.committed]
    return sorted(infos, key=_sort_key)


def latest_checkpoint(
    root: str | Store, storage_options: Mapping[str, Any] | None = None
) -> Checkpoint | None:
    """The committed checkpoint with the highest step below ``root``, or None."""
    store = as_store(root, storage_options)
    committed = list_checkpoints(store)
    return committed[-1].open(store) if committed else None
