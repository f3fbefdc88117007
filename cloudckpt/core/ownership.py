"""Whose objects lie under a prefix: what cloudckpt may delete, and what to call it.

Deletes prove ownership (invariant 7 of docs/architecture.md). A prefix with a manifest at its
top is a committed checkpoint. Any other prefix is, by one recursive listing:

- **empty**: nothing is stored there;
- **ours**: a save, copy or delete that cloudckpt started and did not finish. Its
  proof is a mark only cloudckpt writes at the prefix's top: the writer claim
  (kept after a failure, rewritten before a delete starts; a fresh claim is
  never put on a prefix holding anything else), or a framework's marker directory
  (:attr:`~cloudckpt.core.plugins.Framework.marker_dirs`); or every object under it
  has a name cloudckpt reserves (upload parts, temporary files, writer areas, a
  root index). The committed
  parts of an unfinished save in :func:`part_dirs` (a training checkpoint's
  ``model/``, a framework's declared parts) belong to it;
- **root**: committed checkpoints, or other saves (their claims), lie below it (a
  run directory, a slot; its root index, :mod:`cloudckpt.core.rootindex`, is no mark of
  a save: a root holding one stays a root, and a prefix holding nothing else is ours);
- **foreign**: objects cloudckpt did not write (logs, datasets, a user's files).

Only *ours* is ever deleted as a whole (``rm --force``, ``gc``, a retried save or
copy); a root only checkpoint by checkpoint; foreign objects never.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from cloudckpt.core import plugins
from cloudckpt.errors import (
    CheckpointNotFoundError,
    ConfigError,
    IncompleteCheckpointError,
    NotACheckpointError,
)
from cloudckpt.names import (
    CLAIM_NAME,
    INDEX_NAME,
    INTERNAL_MARKS,
    MANIFEST_NAME,
    MODEL_PART,
    SLOT_POINTER_NAME,
    WRITER_AREAS,
)
from cloudckpt.storage import ObjectInfo, Store

EMPTY, OURS, ROOT, FOREIGN, COMMITTED = "empty", "ours", "root", "foreign", "committed"


def part_dirs() -> frozenset[str]:
    """Where a save's own committed parts lie below its prefix: a training
    checkpoint's DCP part and the frameworks' declared parts. A claimed prefix with
    checkpoints anywhere else is a root, not a save."""
    return frozenset({MODEL_PART}) | plugins.part_dirs()


def _marker(key: str, dirs: Iterable[str]) -> bool:
    return any(key.startswith(d + "/") or f"/{d}/" in key for d in dirs)


def is_reserved(key: str, markers: Sequence[str] | None = None) -> bool:
    """Whether ``key`` (relative to some prefix) names an object only cloudckpt writes:
    a manifest, a writer claim, a slot pointer, a root index, a framework's marker, an
    upload part, a temporary file, or an object in a writer area. ``markers``: the frameworks'
    marker directories, when a caller judging many keys has asked
    :func:`plugins.marker_dirs` once."""
    name = key.rsplit("/", 1)[-1]
    return (name in (MANIFEST_NAME, CLAIM_NAME, SLOT_POINTER_NAME, INDEX_NAME)
            or any(m in name for m in INTERNAL_MARKS) or f"/{WRITER_AREAS}/" in f"/{key}"
            or _marker(key, plugins.marker_dirs() if markers is None else markers))


@dataclass(frozen=True)
class Survey:
    """What one recursive listing of a prefix shows (hidden objects included)."""

    uri: str
    kind: str
    objects: tuple[ObjectInfo, ...]
    #: The outermost committed checkpoints below the prefix, as relative prefixes.
    checkpoints: tuple[str, ...] = ()
    #: Keys that no cloudckpt mark or layout explains.
    foreign: tuple[str, ...] = ()
    #: Saves of cloudckpt's under way (or cut short) below the prefix: where claims lie.
    saves: tuple[str, ...] = ()

    @property
    def size(self) -> int:
        return sum(o.size for o in self.objects)

    @property
    def newest(self) -> float | None:
        """The newest object's time: the last sign of life of whatever wrote them."""
        return max((o.mtime for o in self.objects if o.mtime), default=None)


def survey(store: Store) -> Survey:
    """List ``store``'s whole prefix once and say whose it is."""
    objects = tuple(store.list(internal=True))
    return classify(store.uri, objects)


def classify(uri: str, objects: Sequence[ObjectInfo]) -> Survey:
    """The :class:`Survey` of a prefix holding ``objects`` (keys relative to it)."""
    objects = tuple(objects)
    keys = [o.key for o in objects]
    if not keys:
        return Survey(uri, EMPTY, objects)
    if MANIFEST_NAME in keys:
        return Survey(uri, COMMITTED, objects)
    nested = _outermost(k[: -len(MANIFEST_NAME) - 1] for k in keys
                        if k.endswith("/" + MANIFEST_NAME))
    # Saves under way (or cut short) further down: a claim below the top.
    saves = _outermost(k[: -len(CLAIM_NAME) - 1] for k in keys
                       if k.endswith("/" + CLAIM_NAME))
    units = _outermost([*nested, *saves])
    markers = plugins.marker_dirs()
    foreign = tuple(k for k in keys if not is_reserved(k, markers) and not inside(k, units))
    marked = CLAIM_NAME in keys or any(k.startswith(d + "/") for d in markers for k in keys)
    own_parts = part_dirs()
    if marked and all(p.split("/", 1)[0] in own_parts for p in units):
        kind = OURS  # a save of cloudckpt's, its committed parts (model/, actor/...) its own
    elif nested or (saves and not marked):
        kind = ROOT
    elif not foreign and not marked:
        kind = OURS  # nothing but upload parts and temporary files of cloudckpt's
    else:
        kind = FOREIGN
    return Survey(uri, kind, objects, nested, foreign, saves)


def inside(key: str, prefixes: Iterable[str]) -> bool:
    """Whether ``key`` lies below one of ``prefixes``."""
    return any(key.startswith(p + "/") for p in prefixes)


def _outermost(prefixes: Iterable[str]) -> tuple[str, ...]:
    found = sorted(set(prefixes))
    out: list[str] = []
    for p in found:
        if not inside(p, out):
            out.append(p)
    return tuple(out)


def _names(items: Sequence[str], n: int = 3) -> str:
    shown = ", ".join(items[:n])
    return shown + (f" and {len(items) - n} more" if len(items) > n else "")


def describe_root(s: Survey) -> str:
    """'a root holding 2 committed checkpoints (step-1, step-2)', for messages."""
    n = len(s.checkpoints)
    if not n:
        return (f"a root with {len(s.saves)} unfinished save{'s' if len(s.saves) != 1 else ''}"
                f" below it ({_names(list(s.saves))})")
    return (f"a root holding {n} committed checkpoint{'s' if n != 1 else ''} below it "
            f"({_names(list(s.checkpoints))})")


def not_a_checkpoint(s: Survey) -> CheckpointNotFoundError:
    """The error for a prefix that has no manifest at its top, saying what it is."""
    if s.kind == EMPTY:
        return CheckpointNotFoundError(
            f"no checkpoint at {s.uri}: nothing is stored there. Check the URI; "
            "`cloudckpt ls` on the parent lists the checkpoints.")
    if s.kind == ROOT:
        below = (s.checkpoints or s.saves)[-1]
        return NotACheckpointError(
            f"{s.uri} is not a checkpoint but {describe_root(s)}. `cloudckpt ls {s.uri}` "
            f"lists them; name one of them, e.g. {s.uri}/{below}.")
    if s.kind == FOREIGN:
        if ".metadata" in s.foreign:
            return NotACheckpointError(
                f"{s.uri} holds a DCP checkpoint written without cloudckpt's writer (a "
                f".metadata and {len(s.foreign) - 1} more objects, no manifest): this looks "
                "like a checkpoint written by torch's FsspecWriter, which "
                "dcp.save(..., checkpoint_id=URI) picks when no storage_writer is given. "
                "Pass storage_writer=CloudStorageWriter(URI) to dcp.save to save with "
                f"cloudckpt; adopt this one with `cloudckpt adopt {s.uri}`, which checks "
                "every object it references and commits it.")
        return NotACheckpointError(
            f"{s.uri} is not a checkpoint: it holds {len(s.objects)} object"
            f"{'s' if len(s.objects) != 1 else ''} that cloudckpt did not write "
            f"({_names(list(s.foreign))}) and no manifest. Check the URI.")
    raise ValueError(f"{s.uri} is {s.kind}, not a missing checkpoint")


def incomplete(s: Survey) -> IncompleteCheckpointError:
    """The error for a save cloudckpt started at ``s.uri`` and never committed."""
    return IncompleteCheckpointError(
        f"{s.uri} holds a save that never committed ({len(s.objects)} object"
        f"{'s' if len(s.objects) != 1 else ''}, no manifest: it crashed, failed or is still "
        "running). Load an earlier checkpoint. Rerunning the same save, `cloudckpt cp` or "
        "`cloudckpt download` replaces or resumes it; `cloudckpt gc` removes such saves once "
        f"they are older than a grace period, `cloudckpt rm --force {s.uri}` removes this one "
        "now.")


def unfinished_whole(store: Store) -> Store | None:
    """The save that never committed (its writer claim at its top, no manifest: it
    crashed, was cut short or still runs) that the prefix at ``store`` is a part of,
    found through the part directories above it (``<save>/model``,
    ``<save>/actor/huggingface``); None when it is a part of none. Such a part has a
    manifest of its own, yet is no checkpoint: only the save's manifest makes it one.
    Costs a check or two per part directory above ``store``, none elsewhere."""
    dirs = part_dirs()
    found = None
    current = store
    while current.root.rsplit("/", 1)[-1] in dirs:
        try:
            current = current.ancestor(1)
        except ConfigError:  # the bucket's (or the filesystem's) top
            break
        if current.exists(CLAIM_NAME) and not current.exists(MANIFEST_NAME):
            found = current
    return found


def part_of_unfinished(part: Store, whole: Store) -> IncompleteCheckpointError:
    """The error for opening ``part``, a part of the unfinished save at ``whole``."""
    return IncompleteCheckpointError(
        f"{part.uri} is a part of the save at {whole.uri}, which never committed (its claim "
        "is there, its manifest is not: it crashed, was cut short or is still running), so "
        "it is no checkpoint of its own. Load an earlier checkpoint. Rerunning the save or "
        f"the `cloudckpt cp` completes it; `cloudckpt rm --force {whole.uri}` removes it.")


def missing_manifest_error(s: Survey) -> CheckpointNotFoundError | IncompleteCheckpointError:
    """Why ``s.uri`` cannot be opened as a checkpoint."""
    return incomplete(s) if s.kind == OURS else not_a_checkpoint(s)
