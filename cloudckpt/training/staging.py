"""Local staging for code that can only read and write a path (a framework's engine).

Such code saves into a directory on local disk; every rank then takes part in one
upload that commits the directory as a checkpoint (:func:`upload_dir`), and a load
first brings a checkpoint down into such a directory (:func:`download_dir`). Ranks
on one host share the directory, as they would share a path on local disk; across
hosts each file is sent once, by the first host that holds it.

A staging directory is a full copy of a checkpoint, so one left behind by a process
that was killed mid-save must not stay on disk for good. Each host writes an owner
marker beside its directory (``cloudckpt-staging-<id>.owner-<rank>.json``: host, boot,
pid namespace, and each owning process's pid and start time) before creating it, and
removes it last. Creating a staging directory first removes the ones under the same
root whose every owner provably no longer runs on this host (:func:`remove_leftovers`);
a directory without a marker, or with an owner that runs, or runs elsewhere, is never
touched.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import tempfile
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cloudckpt.core.blobs import BlobArea
from cloudckpt.core.checkpoint import Checkpoint, CheckpointWriter
from cloudckpt.core.liveness import process_gone, this_process
from cloudckpt.core.manifest import Written
from cloudckpt.movement.checkpoint_copy import download
from cloudckpt.names import MANIFEST_NAME
from cloudckpt.runtime import coordination as coord
from cloudckpt.storage import Store, as_store
from cloudckpt.training import multipart

log = logging.getLogger(__name__)

PREFIX = "cloudckpt-staging-"
MARKER_FORMAT = "cloudckpt-staging-owner"
_MARKER_RE = re.compile(r"^(cloudckpt-staging-[0-9a-f]{12})\.owner-(\d+)\.json$")
_MAX_MARKER = 64 << 10


def _leaders(group: Any) -> list[int]:
    """Each rank's host leader: the lowest rank on the same host."""
    return _first_of_host(coord.each_rank(socket.gethostname, group))


def _first_of_host(hosts: list[str]) -> list[int]:
    first: dict[str, int] = {}
    for r, host in enumerate(hosts):
        first.setdefault(host, r)
    return [first[h] for h in hosts]


def staging_root(base: str | os.PathLike | None = None) -> Path:
    """Where staging directories go: ``base``, else ``$CLOUDCKPT_STAGING``, else the
    system temp dir."""
    return Path(base or os.environ.get("CLOUDCKPT_STAGING") or tempfile.gettempdir())


@contextmanager
def staging_dir(base: str | os.PathLike | None = None, group: Any = None) -> Iterator[Path]:
    """A fresh directory with the same path on every rank (one per host), removed
    afterwards; leftovers of dead owners under the same root are removed first.
    ``base`` defaults to ``$CLOUDCKPT_STAGING`` or the system temp dir."""
    root = staging_root(base)
    name = str(coord.on_coordinator(lambda: f"{PREFIX}{uuid.uuid4().hex[:12]}", group))
    path = root / name
    owners = coord.each_rank(this_process, group)
    leaders = _first_of_host([o["host"] for o in owners])
    me = coord.rank(group)
    lead = leaders[me] == me
    marker = root / f"{name}.owner-{leaders[me]}.json"
    mine = [o for r, o in enumerate(owners) if leaders[r] == leaders[me]]
    coord.each_rank(lambda: _create(root, name, marker, mine) if lead else None, group)
    try:
        coord.each_rank(lambda: path.mkdir(parents=True, exist_ok=True), group)
        yield path
        coord.each_rank(lambda: None, group)  # no rank removes what another still reads
    finally:
        shutil.rmtree(path, ignore_errors=True)
        if lead and not path.exists():  # the proof goes last, with nothing left to prove
            marker.unlink(missing_ok=True)


# ------------------------------------------------------------ owners and leftovers


def _create(root: Path, name: str, marker: Path, owners: list[dict[str, Any]]) -> None:
    """Remove dead owners' leftovers, then write this host's marker (create-only),
    before the directory exists: no directory of ours is ever without its proof."""
    remove_leftovers(root)
    root.mkdir(parents=True, exist_ok=True)
    doc = {"format": MARKER_FORMAT, "version": 1, "directory": name, "owners": owners,
           "created": time.time()}
    with open(marker, "x") as f:
        f.write(json.dumps(doc))


def _read_marker(path: Path, directory: str) -> list[dict[str, Any]] | None:
    """The owners a marker names, or None when it is not one cloudckpt wrote for
    ``directory`` as this user (then nothing it names is touched)."""
    try:
        st = path.lstat()
        if not path.is_file() or path.is_symlink() or st.st_size > _MAX_MARKER:
            return None
        if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
            return None
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("format") != MARKER_FORMAT \
            or doc.get("directory") != directory:
        return None
    owners = doc.get("owners")
    if not isinstance(owners, list) or not owners \
            or not all(isinstance(o, dict) for o in owners):
        return None
    return owners


def _markers(root: Path) -> dict[str, list[Path]]:
    """Markers under ``root``, by the directory they stand for."""
    found: dict[str, list[Path]] = {}
    try:
        names = os.listdir(root)
    except OSError:
        return found
    for entry in names:
        m = _MARKER_RE.match(entry)
        if m:
            found.setdefault(m.group(1), []).append(root / entry)
    return found


def remove_leftovers(base: str | os.PathLike | None = None) -> list[Path]:
    """Remove the staging directories under ``base`` (default: as :func:`staging_dir`)
    that processes killed mid-save left behind: only ``cloudckpt-staging-*``
    directories whose markers cloudckpt wrote and whose every owner provably no
    longer runs on this host. Returns the directories removed."""
    root = staging_root(base)
    removed = []
    for name, markers in sorted(_markers(root).items()):
        records = [_read_marker(m, name) for m in markers]
        if any(r is None for r in records):
            continue
        owners = [o for r in records for o in r or ()]
        if all(process_gone(o) for o in owners) and _remove(root / name, markers, owners):
            removed.append(root / name)
    return removed


def _remove(path: Path, markers: list[Path], owners: list[dict[str, Any]]) -> bool:
    """Remove a dead owner's directory, then its markers (the proof goes last, so an
    interrupted removal is finished next time); True when a directory was removed."""
    who = ", ".join(f"pid {o.get('pid')}" for o in owners)
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        return False  # not a directory cloudckpt made: leave it, and its markers
    existed = path.exists()
    shutil.rmtree(path, ignore_errors=True)
    if path.exists():
        log.warning("could not remove %s, left by a save that died (%s on %s); remove it "
                    "by hand", path, who, owners[0].get("host"))
        return False
    for m in markers:
        m.unlink(missing_ok=True)
    if existed:
        log.warning("removed %s: staging left by a save that died (%s on %s)", path, who,
                    owners[0].get("host"))
    else:
        log.info("removed the owner marker of %s (%s is gone)", path, who)
    return existed


def _files(root: Path, chosen: set[str] | None) -> list[str]:
    found = (p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    return sorted(f for f in found if chosen is None or f in chosen)


def _send(store: Store, root: Path, rel: str) -> Written:
    info = store.put_file(rel, root / rel)
    assert info.crc32c is not None
    return multipart.entry(store, rel, info.size, info.crc32c)


@dataclass
class LocalFiles:
    """A :class:`~cloudckpt.training.multipart.Part`: every file under each host's
    ``root`` (or only the relative paths in ``select``), each sent once, by the first
    rank of the first host that holds it; with ``blobs``, as a blob of that area,
    sent only if it is not there yet."""

    root: Path
    select: set[str] | None = None
    blobs: BlobArea | None = None

    def write(self, store: Store, group: Any) -> list[list[Written]]:
        leaders = _leaders(group)
        me = coord.rank(group)
        held = coord.each_rank(
            lambda: _files(self.root, self.select) if leaders[me] == me else [], group)
        owner: dict[str, int] = {}
        for r, names in enumerate(held):
            for rel in names:
                if rel != MANIFEST_NAME:  # a downloaded copy's manifest is not data
                    owner.setdefault(rel, r)
        mine = [rel for rel, r in owner.items() if r == me]
        if self.blobs is None:
            return coord.each_rank(lambda: [_send(store, self.root, rel) for rel in mine],
                                   group)
        return coord.each_rank(lambda: self._send_blobs(store, mine), group)

    def _send_blobs(self, store: Store, rels: list[str]) -> list[Written]:
        assert self.blobs is not None
        sent = self.blobs.put_files(store, {rel: self.root / rel for rel in rels})
        return [Written(rel, entry) for rel, entry in sent.items()]

    def commit(self, writer: CheckpointWriter, written: list[list[Written]]) -> None:
        multipart.Stored(e for sent in written for e in sent).commit(writer, None)


def upload_dir(local_dir: str | os.PathLike, dest: str | Store, *, group: Any = None,
               storage_options: Mapping[str, Any] | None = None,
               select: Iterable[str] | None = None, incremental: bool = False,
               blobs: BlobArea | None = None, **writer_options: Any) -> Checkpoint | None:
    """Commit every file under each host's ``local_dir`` (or only the relative paths in
    ``select``) as one checkpoint at ``dest``; call on every rank. ``writer_options``
    (``step``, ``kind``, ``metadata``, ``takeover``) go to the :class:`CheckpointWriter`.
    Returns the checkpoint on rank 0, None elsewhere; if any rank fails, every rank
    raises and nothing is committed (the claim marks what was sent as cloudckpt's, for
    the next save or ``gc``). ``incremental`` stores each file as a blob of the area
    above ``dest`` (``blobs``: of that area, for a part of a larger save), sent only
    when its bytes are not there yet (:mod:`cloudckpt.core.blobs`)."""
    store = as_store(dest, storage_options)
    if blobs is None and incremental:
        blobs = BlobArea.above(store, 1)
    part = LocalFiles(Path(local_dir), None if select is None else set(select), blobs)
    return multipart.save(store, [part], group=group, blobs=blobs, **writer_options)


def download_dir(ckpt: Checkpoint, local_dir: str | os.PathLike, *, group: Any = None) -> Path:
    """Bring a committed checkpoint into ``local_dir`` on every host (each host's first
    rank downloads, every file checked); call on every rank."""
    leaders = _leaders(group)
    me = coord.rank(group)
    coord.each_rank(lambda: download(ckpt, local_dir) if leaders[me] == me else None, group)
    return Path(local_dir)
