"""Copy a committed checkpoint between any two stores, verified end to end.

Every object is checked against the source manifest as it passes (size and
CRC32C), written to the destination, and only then is the source's manifest
written there create-only: the copy is committed exactly like a save, with
the same step, metadata and commit id.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from .checkpoint import Checkpoint, CheckpointWriter, _store_for, open_checkpoint
from .crc import Crc32c
from .errors import CheckpointNotFoundError, CommitConflictError, CorruptCheckpointError
from .manifest import Manifest
from .storage import Store

log = logging.getLogger("cloudckpt")

Progress = Callable[[int], Any]


def copy_checkpoint(
    src: str | Checkpoint,
    dst: str | Store,
    *,
    src_options: Mapping[str, Any] | None = None,
    dst_options: Mapping[str, Any] | None = None,
    progress: Progress | None = None,
) -> Checkpoint:
    """Copy the committed checkpoint ``src`` to ``dst`` and commit it there.

    If ``dst`` already holds the very same checkpoint (same commit id), nothing
    is copied. ``progress`` is called with the number of bytes of each chunk done.
    """
    ckpt = src if isinstance(src, Checkpoint) else open_checkpoint(src, src_options)
    store = _store_for(dst, dst_options)
    try:
        existing = open_checkpoint(store)
    except CheckpointNotFoundError:
        existing = None
    except CorruptCheckpointError:
        existing = None
    if existing is not None:
        if existing.manifest.commit_id == ckpt.manifest.commit_id:
            log.info("%s already holds commit %s; nothing to copy", store.uri,
                     ckpt.manifest.commit_id)
            if progress:
                progress(ckpt.total_size)
            return existing
        raise CommitConflictError(
            f"{store.uri} already holds a different checkpoint; delete it first or copy "
            "to another URI"
        )
    writer = CheckpointWriter(store, step=ckpt.step, metadata=ckpt.metadata,
                              kind=ckpt.manifest.kind)
    chunk = max(ckpt.store.part_size, 1 << 20)
    small = [p for p in ckpt.files if ckpt.manifest.files[p].size <= chunk]
    large = [p for p in ckpt.files if ckpt.manifest.files[p].size > chunk]
    batch = max(ckpt.store.max_concurrency, 1)
    for i in range(0, len(small), batch):
        items = ckpt.read_many(small[i : i + batch])  # each checked against the manifest
        writer.put_many(items)
        if progress:
            progress(sum(len(v) for v in items.values()))
    for path in large:
        _copy_streamed(ckpt, writer, path, chunk, progress)
    return commit_as(writer, ckpt.manifest)


def _copy_streamed(ckpt: Checkpoint, writer: CheckpointWriter, path: str, chunk: int,
                   progress: Progress | None) -> None:
    entry = ckpt.manifest.files[path]
    crc = Crc32c()
    with writer.open(path) as out:
        window = max(ckpt.store.max_concurrency // 2, 1)
        starts = list(range(0, entry.size, chunk))
        for i in range(0, len(starts), window):
            ranges = [(path, s, min(s + chunk, entry.size)) for s in starts[i : i + window]]
            for data in ckpt.store.get_ranges(ranges):
                crc.update(data)
                out.write(data)
                if progress:
                    progress(len(data))
        if crc.size != entry.size or crc.hexdigest() != entry.crc32c:
            raise CorruptCheckpointError(
                f"object {path!r} of {ckpt.uri} does not match its manifest while copying "
                f"(crc32c {crc.hexdigest()} != {entry.crc32c}); nothing was committed",
                {path: "crc32c mismatch"},
            )


def commit_as(writer: CheckpointWriter, manifest: Manifest) -> Checkpoint:
    """Commit ``writer`` with ``manifest`` after checking it wrote exactly those objects."""
    return writer.commit(manifest)
