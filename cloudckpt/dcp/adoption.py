"""Adopting a DCP checkpoint written without cloudckpt: checked, then committed."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cloudckpt.compat.torch_private import StorageInfo
from cloudckpt.core.checkpoint import Checkpoint, CheckpointWriter, read_manifest
from cloudckpt.core.ownership import COMMITTED, EMPTY, ROOT, survey
from cloudckpt.dcp.metadata import (
    DCP_KIND,
    METADATA_NAME,
    load_metadata,
    missing_files,
    pack_item_crcs,
)
from cloudckpt.errors import CommitConflictError, CorruptCheckpointError
from cloudckpt.storage import Store, as_store
from cloudckpt.util.crc import crc32c_hex


def adopt(uri: str | Store, storage_options: Mapping[str, Any] | None = None, *,
          step: int | None = None) -> Checkpoint:
    """Commit a DCP checkpoint written without cloudckpt (e.g. stock ``FileSystemWriter``
    output uploaded to a bucket).

    Reads ``.metadata`` safely, checks that every file it references exists and
    covers every item, checksums every file and item, and writes the manifest
    create-only. Raises :class:`CorruptCheckpointError` naming what is missing.
    """
    store = as_store(uri, storage_options)
    found = survey(store)
    if found.kind == COMMITTED:
        raise CommitConflictError(f"{store.uri} is already committed; nothing to adopt")
    if found.kind in (EMPTY, ROOT):  # nothing there, or checkpoints below: say which
        read_manifest(store)
    try:
        raw_md = store.get(METADATA_NAME)
    except FileNotFoundError:
        raise CorruptCheckpointError(
            f"{store.uri} has no .metadata: it is not a complete DCP checkpoint",
            {METADATA_NAME: "missing"}) from None
    md = load_metadata(raw_md, source=store.key_uri(METADATA_NAME))
    needed: dict[str, list[StorageInfo]] = {}
    for info in (md.storage_data or {}).values():
        needed.setdefault(info.relative_path, []).append(info)
    problems = missing_files(md, {o.key: o.size for o in store.list()})
    if problems:
        raise CorruptCheckpointError(
            f"cannot adopt {store.uri}: " + ", ".join(f"{p} ({w})" for p, w in problems.items()),
            problems)
    writer = CheckpointWriter(store, step=step, kind=DCP_KIND, adopting=True)
    try:
        return _adopt(store, writer, needed, raw_md)
    except BaseException:
        writer.abandon()  # removes its claim: the objects stay someone else's
        raise


def _adopt(store: Store, writer: CheckpointWriter, needed: dict[str, list[StorageInfo]],
           raw_md: bytes) -> Checkpoint:
    items: list[tuple[str, int, str]] = []

    def checksum(path: str) -> tuple[str, int, str, list[tuple[str, int, str]]]:
        data = store.get(path)
        crcs = [(path, i.offset, crc32c_hex(memoryview(data)[i.offset:i.offset + i.length]))
                for i in needed[path]]
        return path, len(data), crc32c_hex(data), crcs

    for path, size, crc, crcs in store.map(checksum, sorted(needed)):
        writer.add_existing(path, size, crc)
        items += crcs
    writer.add_existing(METADATA_NAME, len(raw_md), crc32c_hex(raw_md))
    writer.metadata["dcp"] = {"item_crcs": pack_item_crcs(items), "key_spread": 0,
                              "adopted": True}
    return writer.commit()
