"""Local staging for code that can only read and write a path (a framework's engine).

Such code saves into a directory on local disk; every rank then takes part in one
upload that commits the directory as a checkpoint (:func:`upload_dir`), and a load
first brings a checkpoint down into such a directory (:func:`download_dir`). Ranks
on one host share the directory, as they would share a path on local disk; across
hosts each file is sent once, by the first host that holds it.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import tempfile
import uuid
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from . import coordination as coord
from .checkpoint import Checkpoint, CheckpointWriter
from .names import MANIFEST_NAME
from .storage import Store, as_store
from .training import claim_prefix
from .transfer import download

log = logging.getLogger("cloudckpt")


def _leaders(group: Any) -> list[int]:
    """Each rank's host leader: the lowest rank on the same host."""
    hosts = coord.each_rank(socket.gethostname, group)
    first: dict[str, int] = {}
    for r, host in enumerate(hosts):
        first.setdefault(host, r)
    return [first[h] for h in hosts]


@contextmanager
def staging_dir(base: str | os.PathLike | None = None, group: Any = None) -> Iterator[Path]:
    """A fresh directory with the same path on every rank (one per host), removed
    afterwards. ``base`` defaults to ``$CLOUDCKPT_STAGING`` or the system temp dir."""
    root = Path(base or os.environ.get("CLOUDCKPT_STAGING") or tempfile.gettempdir())
    name = coord.on_coordinator(lambda: f"cloudckpt-staging-{uuid.uuid4().hex[:12]}", group)
    path = root / str(name)
    coord.each_rank(lambda: path.mkdir(parents=True, exist_ok=True), group)
    try:
        yield path
        coord.each_rank(lambda: None, group)  # no rank removes what another still reads
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _files(root: Path, chosen: set[str] | None) -> list[str]:
    found = (p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    return sorted(f for f in found if chosen is None or f in chosen)


def _send(store: Store, root: Path, rel: str) -> tuple[str, int, str]:
    info = store.put_file(rel, root / rel)
    assert info.crc32c is not None
    return rel, info.size, info.crc32c


def upload_dir(local_dir: str | os.PathLike, dest: str | Store, *, group: Any = None,
               storage_options: Mapping[str, Any] | None = None,
               select: Iterable[str] | None = None,
               **writer_options: Any) -> Checkpoint | None:
    """Commit every file under each host's ``local_dir`` (or only the relative paths in
    ``select``) as one checkpoint at ``dest``; call on every rank. ``writer_options``
    (``step``, ``kind``, ``metadata``, ``takeover``) go to the :class:`CheckpointWriter`.
    Returns the checkpoint on rank
    0, None elsewhere; if any rank fails, every rank raises and nothing is committed
    (the claim marks what was sent as cloudckpt's, for the next save or ``gc``)."""
    store = as_store(dest, storage_options)
    root = Path(local_dir)
    writer = claim_prefix(store, group, **writer_options)
    try:
        leaders = _leaders(group)
        me = coord.rank(group)
        chosen = None if select is None else set(select)
        held = coord.each_rank(lambda: _files(root, chosen) if leaders[me] == me else [],
                               group)
        owner: dict[str, int] = {}
        for r, names in enumerate(held):
            for rel in names:
                if rel != MANIFEST_NAME:  # a downloaded copy's manifest is not data
                    owner.setdefault(rel, r)
        mine = [rel for rel, r in owner.items() if r == me]
        sent = coord.each_rank(lambda: [_send(store, root, rel) for rel in mine], group)
        return coord.on_coordinator(lambda: _commit(writer, sent) if writer else None,
                                    group, share=False)
    except BaseException:
        if writer is not None:
            writer.abandon()
        raise


def _commit(writer: CheckpointWriter, sent: list[list[tuple[str, int, str]]]) -> Checkpoint:
    for part in sent:
        for rel, size, crc in part:
            writer.add_existing(rel, size, crc)
    return writer.commit()


def download_dir(ckpt: Checkpoint, local_dir: str | os.PathLike, *, group: Any = None) -> Path:
    """Bring a committed checkpoint into ``local_dir`` on every host (each host's first
    rank downloads, every file checked); call on every rank."""
    leaders = _leaders(group)
    me = coord.rank(group)
    coord.each_rank(lambda: download(ckpt, local_dir) if leaders[me] == me else None, group)
    return Path(local_dir)
