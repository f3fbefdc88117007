"""The root index: what a run root holds, in one object, so that listing it reads O(1) objects.

``<root>/cloudckpt-index.json`` records the committed checkpoints directly below the root
(name, step, commit time, size, object count, kind: what a listing shows), the names
whose commit or delete is under way (``pending``), and the last survey of the prefixes
there that are no checkpoints (``others``: a user's logs, a folder of runs).

It is a cache of the manifests, never trusted over them: a listing takes from it only
that a name it lists is committed (and that name's figures), and probes every other
name's manifest as it would without an index; opening a checkpoint reads its manifest,
which fixes an entry that disagrees and drops one whose manifest is gone. A missing,
malformed or stale index is rebuilt from the manifests by the next listing
(:mod:`cloudckpt.core.listing`).

Every write is conditional (create-only, then compare-and-swap on the version read) and
retried on a lost race, so savers committing at once into one root never lose an entry.
A commit marks its name pending before its manifest is written and records it after; a
delete marks it pending before the manifest goes and drops it after, so a crash between
leaves the name probed, never a committed checkpoint hidden or a deleted one shown.
Failures to update the index never fail the commit or delete: the next listing repairs it.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from cloudckpt.core.manifest import Manifest
from cloudckpt.errors import CloudCkptError, CommitConflictError, ConfigError
from cloudckpt.names import INDEX_NAME
from cloudckpt.storage import Store

log = logging.getLogger(__name__)

FORMAT = "cloudckpt.rootindex"
VERSION = 1
#: A pending mark older than this (seconds) is a commit or delete that crashed: a listing
#: then settles the name by its manifest alone.
PENDING_EXPIRY = 3600.0
#: A survey of a prefix that is no checkpoint is shown for this long (seconds) before a
#: listing surveys it again.
OTHERS_TTL = 3600.0
#: Attempts of one update against writers racing for the same index.
ATTEMPTS = 64
COMMIT, DELETE = "commit", "delete"


@dataclass(frozen=True)
class Entry:
    """A committed checkpoint as its manifest describes it."""

    step: int | None
    created: float | None
    size: int
    files: int
    kind: str
    #: The manifest's own size in bytes, so that a reader takes it in one GET however
    #: big (None where unknown); a hint checked by the read, not part of the record.
    manifest_bytes: int | None = field(default=None, compare=False)

    @classmethod
    def of(cls, manifest: Manifest, manifest_bytes: int | None = None) -> Entry:
        return cls(manifest.step, manifest.created, manifest.total_size, len(manifest.files),
                   manifest.kind, manifest_bytes)


@dataclass(frozen=True)
class Other:
    """A prefix that is no checkpoint (``status`` ``"foreign"`` or ``"root"``), as its
    last survey found it at ``surveyed``."""

    status: str
    size: int
    files: int
    created: float | None
    surveyed: float


@dataclass(frozen=True)
class Pending:
    """A commit or delete (``op``) of the name, begun at ``since``."""

    op: str
    since: float

    def expired(self, now: float) -> bool:
        return now - self.since > PENDING_EXPIRY


@dataclass
class Index:
    """The root index's content; a name is in at most one of its three maps."""

    checkpoints: dict[str, Entry] = field(default_factory=dict)
    pending: dict[str, Pending] = field(default_factory=dict)
    others: dict[str, Other] = field(default_factory=dict)

    def forget(self, name: str) -> None:
        self.checkpoints.pop(name, None)
        self.pending.pop(name, None)
        self.others.pop(name, None)

    def copy(self) -> Index:
        return Index(dict(self.checkpoints), dict(self.pending), dict(self.others))

    def to_json(self) -> bytes:
        doc = {"format": FORMAT, "version": VERSION,
               "checkpoints": {n: vars(e) for n, e in sorted(self.checkpoints.items())},
               "pending": {n: vars(p) for n, p in sorted(self.pending.items())},
               "others": {n: vars(o) for n, o in sorted(self.others.items())}}
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Index:
        """Parse an index; ``ValueError`` saying why for anything else."""
        try:
            doc = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"not JSON ({exc})") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ValueError("not a cloudckpt root index")
        if doc.get("version") != VERSION:
            raise ValueError(f"version {doc.get('version')!r}, which this cloudckpt does not "
                             f"read (it reads {VERSION})")
        try:
            return cls({n: _entry(e) for n, e in _names(doc, "checkpoints").items()},
                       {n: _pending(p) for n, p in _names(doc, "pending").items()},
                       {n: _other(o) for n, o in _names(doc, "others").items()})
        except (TypeError, KeyError, AttributeError) as exc:
            raise ValueError(f"a malformed record ({exc!r})") from None


def _names(doc: Mapping[str, Any], key: str) -> dict[str, Any]:
    found = doc.get(key, {})
    if not isinstance(found, dict) or not all(
            isinstance(n, str) and n and "/" not in n for n in found):
        raise ValueError(f"{key!r} is not a map of names")
    return found


def _num(v: Any, kinds: tuple[type, ...], none: bool = False) -> Any:
    if (v is None and none) or (isinstance(v, kinds) and not isinstance(v, bool)):
        return v
    raise TypeError(f"{v!r} is not a {kinds[0].__name__}")


def _entry(e: Mapping[str, Any]) -> Entry:
    if not isinstance(e.get("kind"), str):
        raise TypeError(f"kind {e.get('kind')!r}")
    return Entry(_num(e["step"], (int,), True), _num(e["created"], (int, float), True),
                 _num(e["size"], (int,)), _num(e["files"], (int,)), e["kind"],
                 _num(e.get("manifest_bytes"), (int,), True))


def _pending(p: Mapping[str, Any]) -> Pending:
    if p.get("op") not in (COMMIT, DELETE):
        raise TypeError(f"op {p.get('op')!r}")
    return Pending(p["op"], _num(p["since"], (int, float)))


def _other(o: Mapping[str, Any]) -> Other:
    if o.get("status") not in ("foreign", "root"):
        raise TypeError(f"status {o.get('status')!r}")
    return Other(o["status"], _num(o["size"], (int,)), _num(o["files"], (int,)),
                 _num(o["created"], (int, float), True), _num(o["surveyed"], (int, float)))


@dataclass(frozen=True)
class Loaded:
    """One read of a root's index: ``index`` None when there is none (``version`` None)
    or it cannot be used (``problem`` says why; ``version`` is the object's, for the
    write that replaces it)."""

    index: Index | None
    version: str | None
    problem: str | None = None


def load(root: Store) -> Loaded:
    """Read ``root``'s index (one GET). A malformed one, or one of a version this
    cloudckpt does not read, is reported with a WARNING and treated as none."""
    try:
        raw, version = root.get_with_version(INDEX_NAME)
    except FileNotFoundError:
        return Loaded(None, None)
    try:
        return Loaded(Index.from_json(raw), version)
    except ValueError as exc:
        problem = f"{root.key_uri(INDEX_NAME)} cannot be used: {exc}"
        log.warning("%s; ignoring it, the listing reads the manifests and rebuilds it",
                    problem)
        return Loaded(None, version, problem)


def update(root: Store, change: Callable[[Index], bool], *, create: bool = False,
           known: Loaded | None = None) -> Loaded | None:
    """Apply ``change`` to ``root``'s index by conditional writes, read again and retried
    on a lost race: ``change`` edits the index it is given and returns whether it changed
    anything. Without ``create``, a root with no index is left without one (None is
    returned); a malformed index is replaced. ``known``: the index as last read or
    written, to skip the first read. Returns the index as written (or as found, unchanged).
    """
    for attempt in range(ATTEMPTS):
        cur = known if known is not None else load(root)
        known = None
        if cur.index is None and cur.problem is None and not create:
            return None
        index = cur.index.copy() if cur.index is not None else Index()
        if not change(index) and cur.index is not None:
            return cur
        data = index.to_json()
        try:
            info = (root.put_if_match(INDEX_NAME, data, cur.version) if cur.version
                    else root.put_if_absent(INDEX_NAME, data))
        except CommitConflictError:
            time.sleep(random.uniform(0, min(0.5, 0.01 * 2 ** min(attempt, 6))))
            continue
        return Loaded(index, info.version)
    raise CommitConflictError(f"{root.key_uri(INDEX_NAME)}: {ATTEMPTS} writes lost a race "
                              "to other writers in a row")


def parent_of(store: Store) -> Store | None:
    """The root whose index records the checkpoint at ``store``: the prefix above it;
    None at a bucket's top, and for a view writing into another writer's area (a part
    of a larger save, never directly below a run root)."""
    if store.written_under is not None:
        return None
    try:
        return store.ancestor(1)
    except ConfigError:
        return None


def _name(store: Store) -> str:
    return store.root.rstrip("/").rsplit("/", 1)[-1]


def _quietly(what: str, root: Store, fn: Callable[[], Loaded | None]) -> Loaded | None:
    """Run an update of the index; a failure is a WARNING, never the caller's failure
    (the index is a cache the next listing repairs)."""
    try:
        return fn()
    except (CloudCkptError, OSError) as exc:
        log.warning("could not %s in %s (%s); the next listing repairs it", what,
                    root.key_uri(INDEX_NAME), exc)
        return None


class Commit:
    """One commit's marks in the index of the root above its checkpoint (``store``):
    :meth:`begin` before the manifest is written, :meth:`done` after. With ``create``
    (a saver of a run root) the index is made when the root has none; otherwise only an
    existing index is kept up to date (one GET when there is none)."""

    def __init__(self, store: Store, create: bool) -> None:
        self.root = parent_of(store)
        self.name = _name(store)
        self.create = create
        self._known: Loaded | None = None

    def begin(self) -> None:
        root = self.root
        if root is None:
            return

        def mark(index: Index) -> bool:
            index.forget(self.name)
            index.pending[self.name] = Pending(COMMIT, time.time())
            return True

        self._known = _quietly(f"mark {self.name} pending", root,
                               lambda: update(root, mark, create=self.create))

    def done(self, manifest: Manifest, manifest_bytes: int | None = None) -> None:
        root, known = self.root, self._known
        if root is None or known is None:
            return

        def record(index: Index) -> bool:
            index.forget(self.name)
            index.checkpoints[self.name] = Entry.of(manifest, manifest_bytes)
            return True

        _quietly(f"record {self.name}", root, lambda: update(root, record, known=known))

    def failed(self) -> None:
        """The manifest was not written: the pending mark goes."""
        root, known = self.root, self._known
        if root is None or known is None:
            return

        def unmark(index: Index) -> bool:
            p = index.pending.get(self.name)
            if p is None or p.op != COMMIT:
                return False
            del index.pending[self.name]
            return True

        _quietly(f"unmark {self.name}", root, lambda: update(root, unmark, known=known))


@contextmanager
def deleting(store: Store) -> Iterator[None]:
    """Around deleting the committed checkpoint at ``store``'s manifest: its name is
    marked pending in its root's index first, and dropped once the ``with`` block ends
    without an error (a failed delete leaves it marked, for the listings to probe)."""
    root = parent_of(store)
    if root is None:
        yield
        return
    name = _name(store)

    def mark(index: Index) -> bool:
        index.forget(name)
        index.pending[name] = Pending(DELETE, time.time())
        return True

    known = _quietly(f"mark {name} pending", root, lambda: update(root, mark))
    yield
    if known is None:
        return

    def drop(index: Index) -> bool:
        if name not in index.pending:
            return False
        index.forget(name)
        return True

    _quietly(f"drop {name}", root, lambda: update(root, drop, known=known))


def fix(root: Store, name: str, entry: Entry | None) -> None:
    """Set (``entry``) or drop (None) the record of ``name``, committed, after its
    manifest was read: a checkpoint opened disagreed with its entry."""
    def change(index: Index) -> bool:
        current = index.checkpoints.get(name)
        if current is None or (current == entry and entry is not None
                               and current.manifest_bytes == entry.manifest_bytes):
            return False  # a commit or delete under way, or fixed meanwhile
        if entry is None:
            del index.checkpoints[name]
        else:
            index.checkpoints[name] = entry
        return True

    _quietly(f"fix the record of {name}", root, lambda: update(root, change))
