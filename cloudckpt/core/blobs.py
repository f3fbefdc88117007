"""A run root's blob area: the objects of incremental saves, named by their content.

An incremental save stores each object as ``<root>/cloudckpt-blobs/<sha256>`` and
its manifest references it (``FileEntry.blob``, with ``blob_depth`` saying how far
up the root lies); an object whose digest is already there is referenced, not sent
again. Readers resolve references through the manifest only.

Bytes under a name derived from them never change, so a writer whose claim was
taken over, still running, cannot alter a committed checkpoint (invariant 12).

A blob goes only when nothing can still need it (:func:`sweep`): no committed
manifest directly below the root references it, no live hold names it, and it was
released by a deleted checkpoint or is older than the grace period. Age alone is
not enough, as a save may re-reference an old blob that just became unreferenced;
so a save writes a hold naming every blob it relies on, then reads the sweep
record (:meth:`Holding.settle`): when a sweep ran or runs since the save first
looked at the area, it waits for that sweep to end and checks its blobs again,
sending any that went. Either the sweep sees the hold, or the save sees the sweep.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from cloudckpt.core.manifest import DIGEST_RE, FileEntry, Manifest, read_manifest_bytes
from cloudckpt.errors import (
    CommitConflictError,
    ConfigError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
)
from cloudckpt.names import BLOB_AREA, MANIFEST_NAME
from cloudckpt.storage import ObjectInfo, Store
from cloudckpt.util.crc import Buffer, Crc32c

log = logging.getLogger(__name__)

#: The area's sweep record: how many sweeps ran, and whether one runs now.
SWEEP_RECORD = ".cloudckpt-sweep.json"
#: Where saves' holds lie: ``.holds/<checkpoint name>/<id>.json``.
HOLDS = ".holds"
#: How long a sweep may run: it stops deleting after half of it, and a record older
#: than it is stale (a sweep that was killed holds saves up no longer than this).
DEFAULT_LEASE_SECONDS = 60.0
#: A hold older than this protects nothing: its save is long over (the gc grace).
DEFAULT_HOLD_SECONDS = 6 * 3600.0
_POLL = 0.2


#: Set to 1 to make saves incremental where the caller left it open (the frameworks'
#: integrations: their own configs have no key for it).
INCREMENTAL_ENV = "CLOUDCKPT_INCREMENTAL"


def requested(flag: bool | None) -> bool:
    """Whether a save is incremental: ``flag``, or when None ``$CLOUDCKPT_INCREMENTAL``."""
    if flag is not None:
        return flag
    value = os.environ.get(INCREMENTAL_ENV, "").strip().lower()
    if value not in ("", "0", "1", "false", "true", "no", "yes"):
        raise ConfigError(f"{INCREMENTAL_ENV}={value!r}: set it to 1 (incremental saves) "
                          "or 0")
    return value in ("1", "true", "yes")


def digest_of(data: Buffer) -> str:
    """The name of a blob holding ``data``: its SHA-256, in hex."""
    return hashlib.sha256(data).hexdigest()


class BlobArea:
    """The blob area below ``parent``, the directory holding a run's checkpoints."""

    def __init__(self, parent: Store) -> None:
        self.parent = parent
        self.store = parent.child(BLOB_AREA)

    @classmethod
    def above(cls, store: Store, depth: int) -> BlobArea:
        """The area of the run ``depth`` levels above the checkpoint at ``store``."""
        return cls(store.ancestor(depth))

    @property
    def uri(self) -> str:
        return self.store.uri

    def _below(self, store: Store) -> list[str]:
        root = self.parent.root
        if store.protocol != self.parent.protocol or not store.root.startswith(root + "/"):
            raise ConfigError(f"{store.uri} is not below {self.parent.uri}; an incremental "
                              "checkpoint lies below the directory of its blob area")
        parts = store.root[len(root) + 1:].split("/")
        if parts[0] == BLOB_AREA:
            raise ConfigError(f"{store.uri} is inside the blob area {self.uri}")
        return parts

    def depth_of(self, store: Store) -> int:
        """How many levels below the area's directory ``store`` lies."""
        return len(self._below(store))

    def top_of(self, store: Store) -> str:
        """The name of the run's checkpoint ``store`` is (or is a part of)."""
        return self._below(store)[0]

    def put(self, data: Buffer, digest: str | None = None) -> tuple[str, ObjectInfo]:
        """Store ``data`` as a blob (the same bytes again if it is there)."""
        digest = digest or digest_of(data)
        return digest, self.store.put(digest, data)

    def put_file(self, path: str | os.PathLike[str]) -> FileEntry:
        """Store a local file as a blob unless the area has it: one pass to hash it,
        then a HEAD, then the upload only when missing. Its entry: size, CRC32C and
        the blob's digest."""
        sha, crc = hashlib.sha256(), Crc32c()
        with open(path, "rb") as f:
            while chunk := f.read(8 << 20):
                sha.update(chunk)
                crc.update(chunk)
        digest = sha.hexdigest()
        there = self.store.info(digest)
        if there is None or there.size != crc.size:
            info = self.store.put_file(digest, path)
            if (info.size, info.crc32c) != (crc.size, crc.hexdigest()):
                self.store.delete([digest])  # its name no longer says what it holds
                raise CorruptCheckpointError(
                    f"{path} changed while it was saved to {self.store.key_uri(digest)}; "
                    "nothing was committed", {str(path): "changed"})
        return FileEntry(crc.size, crc.hexdigest(), digest)

    def put_many(self, store: Store, items: Mapping[str, Buffer]
                 ) -> dict[str, tuple[str, ObjectInfo]]:
        """Store the objects (``{key: bytes}``) of the checkpoint at ``store`` as
        blobs, each distinct content once, in parallel, held until it commits:
        ``{key: (digest, info)}``."""
        holding = self.holding(self.top_of(store))
        digests = {key: digest_of(data) for key, data in items.items()}
        by_digest = {digests[key]: data for key, data in items.items()}
        sent = dict(store.map(lambda kv: self.put(kv[1], kv[0]), list(by_digest.items())))
        holding.settle(sent, lambda digest: self.put(by_digest[digest], digest))
        return {key: (digest, sent[digest]) for key, digest in digests.items()}

    def put_files(self, store: Store, files: Mapping[str, str | os.PathLike[str]]
                  ) -> dict[str, FileEntry]:
        """Store local files (``{key: path}``) of the checkpoint at ``store`` as blobs,
        in parallel, held until it commits: ``{key: entry}``."""
        holding = self.holding(self.top_of(store))
        keys = sorted(files)
        sent = dict(zip(keys, store.map(lambda key: self.put_file(files[key]), keys),
                        strict=True))
        by_digest = {entry.blob: files[key] for key, entry in sent.items() if entry.blob}
        holding.settle(by_digest, lambda digest: self.put_file(by_digest[digest]))
        return sent

    def missing(self, digests: Iterable[str]) -> set[str]:
        """Those of ``digests`` with no blob (one HEAD each, in parallel)."""
        wanted = sorted(set(digests))
        found = self.store.map(self.store.info, wanted)
        return {d for d, info in zip(wanted, found, strict=True) if info is None}

    def record(self) -> tuple[dict[str, Any], str | None]:
        """The sweep record and its version (``{}`` and None before the first sweep)."""
        try:
            raw, version = self.store.get_with_version(SWEEP_RECORD)
        except FileNotFoundError:
            return {}, None
        try:
            record = json.loads(raw)
        except ValueError:
            record = {}
        return (record if isinstance(record, dict) else {}), version

    def holding(self, top: str) -> Holding:
        """A hold for one rank's share of the save of checkpoint ``top``; create it
        before looking at or writing any blob it will name."""
        return Holding(self, top)

    def release(self, top: str) -> None:
        """After checkpoint ``top`` committed (its manifest protects its blobs now):
        remove its saves' holds. Best effort: a hold left over expires."""
        try:
            holds = self.store.list(f"{HOLDS}/{top}")
            self.store.delete(o.key for o in holds)
        except Exception as exc:  # noqa: BLE001 - a leftover hold only delays a sweep
            log.warning("could not remove the holds of %s in %s: %s", top, self.uri, exc)


def _stale(record: dict[str, Any]) -> bool:
    since, lease = record.get("since"), record.get("lease")
    if not isinstance(since, int | float) or not isinstance(lease, int | float):
        return True
    return time.time() - since > lease


def _running(record: dict[str, Any]) -> bool:
    return bool(record.get("running")) and not _stale(record)


class Holding:
    """What one rank of one save relies on in the area (see the module's docstring)."""

    def __init__(self, area: BlobArea, top: str) -> None:
        self.area = area
        self.top = top
        self.seen = area.record()[0]  # before any blob is looked at

    def settle(self, digests: Collection[str], restore: Callable[[str], object]) -> None:
        """Hold ``digests``, which this save found in the area or sent there; if a sweep
        may have missed the hold, wait for it to end and ``restore`` each blob it took.
        After this, no sweep deletes them while the hold lives."""
        if not digests:
            return
        hold = json.dumps({"blobs": sorted(digests), "since": time.time(),
                           "host": socket.gethostname(), "pid": os.getpid()}).encode()
        self.area.store.put(f"{HOLDS}/{self.top}/{uuid.uuid4().hex}.json", hold)
        now = self.area.record()[0]
        if not _running(self.seen) and not _running(now) and (
                now.get("count") == self.seen.get("count")):
            return  # no sweep since the blobs were looked at: any later one sees the hold
        while _running(now):
            time.sleep(_POLL)
            now = self.area.record()[0]
        gone = self.area.missing(digests)
        if gone:
            log.warning("a sweep of %s removed %d blob(s) this save relies on; sending them "
                        "again", self.area.uri, len(gone))
        for digest in sorted(gone):
            restore(digest)


# ------------------------------------------------------------------ the sweep


@dataclass(frozen=True)
class Swept:
    """What a sweep removed (or, dry, would remove)."""

    blobs: int
    size: int
    holds: int


def referenced(parent: Store) -> set[str]:
    """Every blob a committed manifest directly below ``parent`` references (a
    checkpoint's root manifest lists its parts' objects too). A manifest that cannot
    be read stops the sweep: what it references cannot be known."""
    names = [n for n in parent.list_prefixes() if n != BLOB_AREA]

    def blobs_of(name: str) -> set[str]:
        sub = parent.child(name)
        try:
            raw = read_manifest_bytes(sub)
        except FileNotFoundError:
            return set()
        manifest = Manifest.from_json(raw, source=sub.key_uri(MANIFEST_NAME))
        return set(manifest.blobs.values()) if manifest.blob_depth == 1 else set()

    out: set[str] = set()
    for found in parent.map(blobs_of, names):
        out |= found
    return out


def sweep(parent: Store, *, released: Collection[str] = (),
          grace_seconds: float = DEFAULT_HOLD_SECONDS, lease_seconds: float | None = None,
          dry_run: bool = False) -> Swept:
    """Delete the blobs of ``parent``'s area that nothing needs: unreferenced by every
    committed manifest below ``parent``, named by no hold younger than ``grace_seconds``,
    and either ``released`` (referenced by a checkpoint just deleted) or older than
    ``grace_seconds``; and the holds older than that. One sweep at a time:
    :class:`CommitConflictError` while another runs. ``dry_run`` deletes nothing."""
    lease_seconds = lease_seconds or DEFAULT_LEASE_SECONDS
    area = BlobArea(parent)
    started = time.monotonic()
    version = None if dry_run else _begin(area, lease_seconds)
    try:
        listed = area.store.list()
        blobs = [o for o in listed if DIGEST_RE.match(o.key)]
        holds = [o for o in listed if o.key.startswith(HOLDS + "/")]
        keep = referenced(parent)
        now = time.time()
        stale = [o for o in holds if now - (o.mtime or now) > grace_seconds]
        for hold in (o for o in holds if o not in stale):
            keep |= _held(area, hold.key)
        released = set(released)
        doomed = [o for o in blobs if o.key not in keep and (
            o.key in released or now - (o.mtime or now) >= grace_seconds)]
        if not dry_run:
            for i in range(0, len(doomed), 100):
                if time.monotonic() - started > lease_seconds / 2:
                    raise IncompleteCheckpointError(
                        f"the sweep of {area.uri} ran past half its {lease_seconds:.0f} s "
                        "lease and stopped; run gc again")
                area.store.delete(o.key for o in doomed[i:i + 100])
            area.store.delete(o.key for o in stale)
        if doomed:
            log.info("swept %d unreferenced blob(s) (%d bytes) from %s", len(doomed),
                     sum(o.size for o in doomed), area.uri)
        return Swept(len(doomed), sum(o.size for o in doomed), len(stale))
    finally:
        if version is not None:
            _end(area, version)


def _held(area: BlobArea, key: str) -> set[str]:
    try:
        record = json.loads(area.store.get(key))
    except FileNotFoundError:
        return set()  # released meanwhile: its checkpoint committed
    except ValueError:
        record = {}
    blobs = record.get("blobs") if isinstance(record, dict) else None
    if not isinstance(blobs, list):
        raise IncompleteCheckpointError(f"{area.store.key_uri(key)} is not a hold cloudckpt "
                                        "wrote; not sweeping what it might protect")
    return {b for b in blobs if isinstance(b, str)}


def _begin(area: BlobArea, lease: float) -> str:
    """Mark the area as being swept (compare-and-swap); the new record's version."""
    record, version = area.record()
    if _running(record):
        raise CommitConflictError(
            f"another sweep of {area.uri} is running (host {record.get('host')!r}, pid "
            f"{record.get('pid')}); try again once it ends")
    count = n if isinstance(n := record.get("count"), int) else 0
    data = json.dumps({"count": count + 1, "running": True, "since": time.time(),
                       "lease": lease, "host": socket.gethostname(),
                       "pid": os.getpid()}).encode()
    if version is None:
        info = area.store.put_if_absent(SWEEP_RECORD, data)
    else:
        info = area.store.put_if_match(SWEEP_RECORD, data, version)
    assert info.version is not None
    return info.version


def _end(area: BlobArea, version: str) -> None:
    record, now = area.record()
    if now != version:
        log.warning("the sweep record of %s changed while it ran (taken over as stale)",
                    area.uri)
        return
    try:
        area.store.put_if_match(SWEEP_RECORD, json.dumps({**record, "running": False})
                                .encode(), version)
    except CommitConflictError:
        log.warning("the sweep record of %s changed as the sweep ended", area.uri)
