"""What a run directory holds: its checkpoints, newest last, and what else lies there.

Read through the run root's index (:mod:`cloudckpt.core.rootindex`) where it has one:
one GET and one LIST, however many checkpoints lie there."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from cloudckpt.core import rootindex
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
from cloudckpt.errors import (
    CheckpointNotFoundError,
    CloudCkptError,
    CommitConflictError,
    CorruptCheckpointError,
)
from cloudckpt.names import BLOB_AREA, CLAIM_NAME, INDEX_NAME
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
    newest object's time; ``kind`` the manifest's kind (committed ones).
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
    kind: str | None = None
    #: The manifest the listing read; None when the entry came from the root index.
    _manifest: Manifest | None = field(default=None, repr=False, compare=False)
    #: The root index's record this entry came from, and the root it lies in.
    _indexed: tuple[rootindex.Entry, Store] | None = field(default=None, repr=False,
                                                          compare=False)

    def to_dict(self) -> dict[str, Any]:
        """The entry as plain data (for JSON), without the manifest."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if not f.name.startswith("_")}

    @property
    def manifest(self) -> Manifest | None:
        """The checkpoint's manifest (committed ones): the one the listing read, or, for
        an entry taken from the root index, read now (once). A manifest that disagrees
        with the index fixes the index; one that is gone drops the entry and raises
        :class:`CheckpointNotFoundError`."""
        if self._manifest is None and self._indexed is not None:
            object.__setattr__(self, "_manifest", self._confirm(*self._indexed))
        return self._manifest

    def _confirm(self, entry: rootindex.Entry, root: Store) -> Manifest:
        sub = root.child(self.name)
        try:
            raw = read_manifest_bytes(sub, size=entry.manifest_bytes)  # one GET, if recorded
            m = Manifest.from_json(raw, source=sub.key_uri(MANIFEST_NAME))
        except FileNotFoundError:
            log.warning("the index of %s lists %s as committed, but its manifest is gone "
                        "(deleted behind cloudckpt's back); dropping its entry", root.uri,
                        self.name)
            rootindex.fix(root, self.name, None)
            raise CheckpointNotFoundError(
                f"{self.uri} is no longer committed: its manifest is gone (the run root's "
                "index listed it; it no longer does). List the root again.") from None
        except CorruptCheckpointError:
            rootindex.fix(root, self.name, None)  # a listing shows it unreadable from now
            raise
        if rootindex.Entry.of(m) != entry or entry.manifest_bytes not in (None, len(raw)):
            log.info("the index of %s disagreed with the manifest of %s; fixed its entry",
                     root.uri, self.name)
            rootindex.fix(root, self.name, rootindex.Entry.of(m, len(raw)))
        return m

    def open(self, root: Store) -> Checkpoint:
        """The committed checkpoint this entry names below ``root``, from the manifest
        the listing read (read now if it took the entry from the root index, and read
        again if it has none)."""
        sub = root.child(self.name)
        m = self.manifest
        return Checkpoint(sub, m) if m else open_checkpoint(sub)

    def present(self, root: Store) -> bool:
        """Whether this committed checkpoint's manifest is still there: free when the
        listing read it, one HEAD when the entry came from the root index (whose entry
        goes, with a WARNING, when it is not)."""
        if self._manifest is not None or self._indexed is None:
            return self.committed
        if root.child(self.name).exists(MANIFEST_NAME):
            return True
        log.warning("the index of %s lists %s as committed, but its manifest is gone "
                    "(deleted behind cloudckpt's back); dropping its entry", root.uri,
                    self.name)
        rootindex.fix(root, self.name, None)
        return False

    def whole(self, root: Store) -> bool:
        """Whether every object of this committed checkpoint below ``root`` is there with
        the size its manifest lists (one listing). A resume asks before it picks the
        newest checkpoint: one missing, truncated or oversized objects is skipped with a
        WARNING naming them, as the manager's restore falls back from it, rather than
        fail the same way on every automatic restart."""
        try:
            self.open(root).verify()
        except (CorruptCheckpointError, CheckpointNotFoundError) as exc:
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
    index: bool = True,
) -> list[CheckpointInfo]:
    """The checkpoints directly below ``root``, oldest step first.

    Only committed checkpoints by default, with a WARNING naming each one skipped
    because its manifest cannot be read (malformed, or a field out of range);
    ``include_uncommitted`` adds every other prefix there, flagged
    ``committed=False`` with its ``status``.

    The root index (:mod:`cloudckpt.core.rootindex`) is read first: the checkpoints it
    records that the root's listing shows are taken from it, every other prefix is
    probed (its manifest read); a missing or stale index is rebuilt and written back.
    ``index=False`` reads every manifest and leaves the index alone.
    Raises :class:`BucketNotFoundError` when the bucket does not exist.
    """
    store = as_store(root, storage_options)
    return list_root(store, include_uncommitted=include_uncommitted, index=index).infos


@dataclass(frozen=True)
class Listing:
    """What :func:`list_root` found."""

    infos: list[CheckpointInfo]
    #: Whether the root holds a usable index (so it is a run root, never a checkpoint).
    indexed: bool


def list_root(store: Store, *, include_uncommitted: bool = False,
              index: bool = True) -> Listing:
    """:func:`list_checkpoints` of ``store``, saying whether it had a root index: a
    root that has one costs one GET of it and one LIST, plus a manifest GET for each
    name the index does not record committed (and, with ``include_uncommitted``, a
    survey of each that is no checkpoint and was not surveyed within
    :data:`~cloudckpt.core.rootindex.OTHERS_TTL`)."""
    loaded = rootindex.load(store) if index else None
    idx = loaded.index if loaded is not None else None
    names = store.list_prefixes()
    if not names:
        store.check_bucket()
    names = [n for n in names if n != BLOB_AREA]
    dirs = part_dirs()
    parts = [n for n in names if n in dirs]
    # A root that is itself a save never committed (a torn copy's step-1/): its
    # committed parts (model/) are no checkpoints of their own.
    whole = unfinished_whole(store.child(parts[0])) if parts else None
    now = time.time()
    seen: dict[str, Manifest] = {}  # what probing found committed
    seen_bytes: dict[str, int] = {}  # and the size of each one's manifest
    surveyed: dict[str, rootindex.Other | None] = {}  # surveyed: no checkpoint (None: ours)

    def probe(name: str, again: bool = True) -> CheckpointInfo | None:
        sub = store.child(name)
        try:
            raw = read_manifest_bytes(sub)
            m = Manifest.from_json(raw, source=sub.key_uri(MANIFEST_NAME))
        except FileNotFoundError:
            if not include_uncommitted:
                return None
            cached = idx.others.get(name) if idx is not None else None
            if cached is not None and now - cached.surveyed <= rootindex.OTHERS_TTL:
                return CheckpointInfo(name, sub.uri, False, created=cached.created,
                                      size=cached.size, files=cached.files,
                                      status=cached.status)
            found = survey(sub)
            if found.kind == EMPTY:  # vanished meanwhile
                return None
            if found.kind == COMMITTED:  # committed between the read and the listing
                return probe(name, again=False) if again else None
            info = CheckpointInfo(name, sub.uri, False, created=found.newest, size=found.size,
                                  files=len(found.objects), status=_STATUS[found.kind])
            surveyed[name] = rootindex.Other(info.status, info.size, info.files, info.created,
                                             now) if found.kind in (FOREIGN, ROOT) else None
            return info
        except CorruptCheckpointError as exc:
            return CheckpointInfo(name, sub.uri, False, error=str(exc), status="unreadable")
        if whole is not None and name in dirs:
            return CheckpointInfo(name, sub.uri, False, m.step, m.created, m.total_size,
                                  len(m.files), status="part",
                                  error=f"a part of the save at {whole.uri}, which never "
                                  "committed: no checkpoint of its own")
        seen[name] = m
        seen_bytes[name] = len(raw)
        return CheckpointInfo(name, sub.uri, True, m.step, m.created, m.total_size,
                              len(m.files), kind=m.kind, _manifest=m)

    recorded = idx.checkpoints if idx is not None and whole is None else {}
    infos = [_from_entry(store, n, recorded[n]) for n in names if n in recorded]
    infos += [i for i in store.map(probe, [n for n in names if n not in recorded])
              if i is not None]
    if loaded is not None and whole is None:
        _write_back(store, loaded, set(names), seen, surveyed, now, seen_bytes)
    if not include_uncommitted:
        for i in infos:
            if i.status == "unreadable":  # never a silent gap in a run
                log.warning("skipping %s: its manifest cannot be read (%s)", i.uri, i.error)
            elif i.status == "part":
                log.warning("skipping %s: %s", i.uri, i.error)
        infos = [i for i in infos if i.committed]
    return Listing(sorted(infos, key=_sort_key), idx is not None)


def _from_entry(root: Store, name: str, e: rootindex.Entry) -> CheckpointInfo:
    return CheckpointInfo(name, root.child(name).uri, True, e.step, e.created, e.size, e.files,
                          kind=e.kind, _indexed=(e, root))


def _write_back(root: Store, loaded: rootindex.Loaded, present: set[str],
                seen: Mapping[str, Manifest], surveyed: Mapping[str, rootindex.Other | None],
                now: float, seen_bytes: Mapping[str, int] | None = None) -> None:
    """Bring the root index in line with what the listing found (``present``: the
    names listed; ``seen``: manifests probed; ``surveyed``: prefixes found to be no
    checkpoint) by one conditional write; a lost race leaves it to the next listing."""
    before = loaded.index
    index = before.copy() if before is not None else rootindex.Index()
    added = dropped = 0
    for name in [n for n in index.checkpoints if n not in present]:
        del index.checkpoints[name]  # its prefix is gone: deleted behind the index's back
        dropped += 1
    for name, p in list(index.pending.items()):
        if name not in present or (name not in seen and p.expired(now)):
            del index.pending[name]  # settled: gone, or a commit that never happened
        elif name in seen and (p.op == rootindex.COMMIT or p.expired(now)):
            del index.pending[name]  # committed; the commit did not get to record it
    for name in [n for n in index.others if n not in present or n in seen]:
        del index.others[name]
    for name, m in seen.items():
        if name in index.pending:
            continue  # a commit or delete under way records it itself
        added += name not in index.checkpoints
        index.forget(name)
        index.checkpoints[name] = rootindex.Entry.of(m, (seen_bytes or {}).get(name))
    for name, other in surveyed.items():
        if name not in index.pending:
            index.forget(name)
            if other is not None:  # an unfinished save is surveyed afresh every time
                index.others[name] = other
    if before is not None and index == before:
        return
    if before is None and (not index.checkpoints or (loaded.problem is None and (
            root.exists(MANIFEST_NAME) or root.exists(CLAIM_NAME)))):
        return  # nothing worth an index, or no run root: a checkpoint or a save itself
    try:
        if loaded.version is not None:
            root.put_if_match(INDEX_NAME, index.to_json(), loaded.version)
        else:
            root.put_if_absent(INDEX_NAME, index.to_json())
    except CommitConflictError:
        log.debug("the index of %s changed while it was listed; the next listing updates "
                  "it", root.uri)
        return
    except (CloudCkptError, OSError) as exc:
        log.info("could not write the index of %s back (%s); listings read the manifests "
                 "until one can", root.uri, exc)
        return
    if added or dropped or before is None:
        why = (" (it had none)" if before is None and loaded.problem is None
               else " (it could not be used)" if before is None else "")
        log.info("rebuilt the index of %s: %d entries added, %d dropped%s", root.uri, added,
                 dropped, why)


def newest(root: Store, infos: Sequence[CheckpointInfo]
           ) -> tuple[CheckpointInfo, Checkpoint] | None:
    """The newest of the committed ``infos`` (a listing of ``root``) that opens, and the
    checkpoint: its manifest is read (the root index's entry fixed, or dropped when the
    manifest is gone: then the one before it is tried, as after one whose manifest cannot
    be read, with a WARNING)."""
    for info in reversed(infos):
        try:
            return info, info.open(root)
        except CheckpointNotFoundError:
            continue
        except CorruptCheckpointError as exc:
            log.warning("skipping %s: its manifest cannot be read (%s)", info.uri, exc)
    return None


def latest_checkpoint(
    root: str | Store, storage_options: Mapping[str, Any] | None = None
) -> Checkpoint | None:
    """The committed checkpoint with the highest step below ``root``, or None."""
    store = as_store(root, storage_options)
    found = newest(store, list_checkpoints(store))
    return found[1] if found else None
