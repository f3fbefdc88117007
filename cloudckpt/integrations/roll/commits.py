"""When a ROLL checkpoint commits: the markers of its current parts, merged and
checked against what ROLL's resume reads, then committed as the last step of a
multi-part save (:func:`cloudckpt.training.multipart.commit`). Each worker's
uploaded files are one :class:`~cloudckpt.training.multipart.Stored` part."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cloudckpt.core.blobs import BlobArea
from cloudckpt.core.checkpoint import Checkpoint, CheckpointWriter, open_checkpoint
from cloudckpt.core.deletion import remove_leftovers
from cloudckpt.core.gc import collect, find_garbage
from cloudckpt.core.manifest import FileEntry, Written
from cloudckpt.core.retention import Managed, apply_retention
from cloudckpt.errors import (
    CheckpointNotFoundError,
    CommitConflictError,
    IncompleteCheckpointError,
    StorageError,
)
from cloudckpt.integrations.roll import membership
from cloudckpt.integrations.roll.layout import CKPT_RE, KIND
from cloudckpt.integrations.roll.markers import part_names, read_markers, resume_problems, summary
from cloudckpt.names import MANIFEST_NAME
from cloudckpt.storage import Store
from cloudckpt.training import multipart
from cloudckpt.util.text import plural

log = logging.getLogger(__name__)

Markers = Mapping[str, Mapping[str, Any]]


def current_parts(store: Store, attempt_id: str | None, since: float) -> dict[str, dict[str, Any]]:
    """The markers of this attempt's parts, by key: those naming ``attempt_id``, or,
    without one, those written at or after ``since``."""
    parts: dict[str, dict[str, Any]] = {}
    for key, marker in read_markers(store).items():
        if attempt_id:
            current = marker.get("attempt") == attempt_id
        else:
            current = float(marker.get("created", 0)) >= since
        if current:
            parts[key] = marker
        else:
            log.info("ignoring part %r of %s from an earlier attempt", marker.get("part"),
                     store.uri)
    return parts


def merged_files(store: Store, parts: Markers) -> dict[str, FileEntry]:
    """Every file the parts list, with its size and CRC32C (and blob: an incremental
    upload's), each one in the bucket at its own path (or in the blob area)."""
    files: dict[str, FileEntry] = {}
    for marker in parts.values():
        for key, e in marker["files"].items():
            blob = e.get("blob")
            entry = FileEntry(int(e["size"]), str(e["crc32c"]), str(blob) if blob else None)
            if files.setdefault(key, entry) != entry:
                raise CommitConflictError(
                    f"{store.uri}: two parts uploaded different {key!r}; not committing")
    present = {o.key: o.size for o in store.list()}
    blobs = [e.blob for e in files.values() if e.blob]
    gone = _area(store).missing(blobs) if blobs else set()
    missing = [k for k, e in files.items()
               if (e.blob in gone if e.blob else present.get(k) != e.size)]
    if missing:
        raise StorageError(f"{store.uri}: parts list objects that are missing or of the "
                           f"wrong size: {sorted(missing)[:5]}; not committing")
    return files


def _area(store: Store) -> BlobArea:
    return BlobArea(store.ancestor(1))


def _resume_problems(store: Store, files: Mapping[str, FileEntry]) -> list[str]:
    """What ROLL's resume would miss in ``files`` (with their sizes), read from ``store``
    (or its run's blob area)."""
    def read(key: str) -> bytes:
        blob = files[key].blob if key in files else None
        return _area(store).store.get(blob) if blob else store.get(key)

    return resume_problems({k: e.size for k, e in files.items()}, read)


def ready(store: Store, parts: Markers, expected: int | None,
          gaps: Sequence[str] = ()) -> dict[str, FileEntry] | str:
    """The files to commit if the parts are all in (``expected`` of them; without a
    count, no ``gaps`` left: :func:`.membership.missing`) and hold all ROLL's resume
    reads; else why not (a part still on its way, or one missing)."""
    if expected is not None and len(parts) < expected:
        log.debug("%s: %d of %d parts present; not committing yet", store.uri, len(parts),
                  expected)
        return f"{len(parts)} of {expected} parts present"
    if expected is None and gaps:
        return f"waiting for {'; '.join(gaps)}"
    files = merged_files(store, parts)
    problems = _resume_problems(store, files)
    if problems:
        reached = f"the {expected} expected" if expected is not None else "every part announced"
        why = (f"{plural(len(parts), 'part')} ({', '.join(part_names(parts))}) reached "
               f"{reached}, but ROLL could not resume from them: {summary(problems)}")
        log.warning("%s is not committed yet: %s. Waiting for more parts; if none come, "
                    "a part was lost%s.", store.uri, why,
                    " or expected_uploads is too low" if expected is not None else "")
        return why
    if expected is not None and len(parts) > expected:
        log.warning("%s: %d parts arrived, more than expected_uploads=%d; committed once "
                    "complete. Fix: set expected_uploads to %d (the pipeline + every "
                    "uploading rank), or leave it out", store.uri, len(parts), expected,
                    len(parts))
    return files


@dataclass(frozen=True)
class Progress:
    """An uncommitted checkpoint's current parts, how long since the newest arrived, what
    is still missing (``gaps``, without a count) and what ROLL's resume would miss once
    they are all in (``problems``)."""

    parts: list[str]
    expected: int | None
    idle: float
    problems: list[str]
    gaps: list[str] = field(default_factory=list)

    def text(self) -> str:
        names = ", ".join(self.parts)
        if self.problems:
            reached = (f"reached expected_uploads={self.expected}" if self.expected is not None
                       else "are all that were announced")
            return (f"{plural(len(self.parts), 'part')} ({names}) {reached}, but ROLL could "
                    f"not resume from them: {summary(self.problems)}")
        if self.expected is None:
            return (f"{plural(len(self.parts), 'part')} arrived ({names}); missing: "
                    f"{summary(self.gaps)}")
        return (f"{len(self.parts)} of expected_uploads={self.expected} parts arrived "
                f"({names})")


def assess(store: Store, parts: Markers, expected: int | None,
           gaps: Sequence[str] = ()) -> Progress | dict[str, FileEntry]:
    """The files to commit when the parts are complete (as this process counts them),
    else where the checkpoint stands; quiet, unlike :func:`ready`."""
    problems: list[str] = []
    if (len(parts) >= expected) if expected is not None else not gaps:
        try:
            files = merged_files(store, parts)
        except (StorageError, CommitConflictError) as exc:
            problems = [str(exc)]
        else:
            problems = _resume_problems(store, files)
            if not problems:
                return files
    newest = max(float(p.get("created", 0)) for p in parts.values())
    return Progress(part_names(parts), expected, max(0.0, time.time() - newest), problems,
                    list(gaps))


def commit(store: Store, ckpt_id: str, parts: Markers, files: Mapping[str, FileEntry],
           attempt_id: str | None) -> Checkpoint:
    """Commit the checkpoint the parts make (a concurrent committer of the same parts
    may win), then remove what only a crashed earlier attempt wrote."""
    m = CKPT_RE.match(ckpt_id)
    meta = {"framework": "roll", "parts": sorted(p["part"] for p in parts.values()),
            "attempt": attempt_id, "clusters": membership.clusters(parts)}
    # The parts' uploaders wrote every file at its own path.
    stored = multipart.Stored(Written(key, entry) for key, entry in files.items())
    incremental = any(e.blob for e in files.values())
    try:
        writer = CheckpointWriter(store, step=int(m.group(1)) if m else None, kind=KIND,
                                  metadata=meta, blobs=_area(store) if incremental else None)
        ckpt = multipart.commit(writer, [stored], [None])
    except CommitConflictError:
        ckpt = _committed_by_another(store)  # a concurrent committer won; same parts
        log.info("%s was committed concurrently by another part", store.uri)
    else:
        log.info("committed %s: %d parts, %d objects", store.uri, len(parts), len(files))
    remove_leftovers(store, (o.key for o in store.list()),
                     keep={*ckpt.manifest.files, MANIFEST_NAME})
    return ckpt


#: How long a part that lost the commit race waits for the winner's manifest.
_WINNER_WAIT_SECONDS = 60.0


def _committed_by_another(store: Store) -> Checkpoint:
    """The checkpoint a concurrent committer of the same parts commits: it may still
    hold the prefix's claim, its manifest not yet written (a slow store, a loaded
    host), so wait for it; raise if it never appears."""
    deadline = time.monotonic() + _WINNER_WAIT_SECONDS
    while True:
        try:
            return open_checkpoint(store)
        except (CheckpointNotFoundError, IncompleteCheckpointError):
            if time.monotonic() > deadline:
                raise CommitConflictError(
                    f"another process was committing {store.uri} with the same parts and "
                    f"did not finish within {_WINNER_WAIT_SECONDS:.0f} s") from None
            time.sleep(0.2)


#: Retention governs only ROLL's own checkpoints: kind ``roll``, named ``checkpoint-N``.
_OWN_CHECKPOINTS = Managed(KIND, CKPT_RE)


def prune(root: Store, keep: int, torn_grace_seconds: float,
          storage_options: Mapping[str, Any]) -> None:
    """``keep`` committed checkpoints (by N; 0 keeps all), and torn saves older than
    ``torn_grace_seconds`` removed by gc's rules (an upload still sending parts counts
    as alive)."""
    if keep > 0:
        apply_retention(root, keep, number=_OWN_CHECKPOINTS)
    torn = find_garbage(root, grace_seconds=torn_grace_seconds, names=CKPT_RE.match)
    for g in torn:
        log.info("deleting torn %s (untouched for %.0f s)", g.uri, g.age_seconds)
    collect(torn, storage_options)
