"""Stock ``.metadata`` for an indexed DCP checkpoint, for readers that need it.

A small job's indexed save writes ``.metadata`` itself
(:data:`~cloudckpt.dcp.ranksave.SMALL_JOB_CHUNKS`); a larger one's is built here
from the index and every rank's records, when asked: by ``cloudckpt dcp stock``, and
by ``cloudckpt download``, so torch's ``FileSystemReader`` loads the local copy.
It costs a read of every rank's records (one small object a rank) and tens of
microseconds of CPU a chunk (``benchmarks/dcp_index_bench.py``).
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Mapping
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from cloudckpt.core.checkpoint import Checkpoint, open_checkpoint
from cloudckpt.dcp import records as fmt
from cloudckpt.dcp.metadata import METADATA_NAME, load_metadata
from cloudckpt.dcp.records import INDEX_NAME, MAX_INDEX_BYTES, Index, RankRecords
from cloudckpt.errors import CorruptCheckpointError, NotACheckpointError
from cloudckpt.storage import Store

log = logging.getLogger(__name__)


def is_indexed(ckpt: Checkpoint) -> bool:
    """Whether ``ckpt`` is a DCP checkpoint in the indexed format."""
    doc = ckpt.metadata.get("dcp")
    return isinstance(doc, Mapping) and doc.get("format") == fmt.INDEXED_FORMAT


def stock_metadata(checkpoint: str | Store | Checkpoint, *,
                   storage_options: Mapping[str, Any] | None = None) -> Metadata:
    """torch's ``Metadata`` of the committed DCP checkpoint ``checkpoint``: its
    ``.metadata`` where it has one, else built from its index and every rank's records
    (each read checked against the manifest)."""
    ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else \
        open_checkpoint(checkpoint, storage_options)
    if METADATA_NAME in ckpt.files:
        return load_metadata(ckpt.read(METADATA_NAME), source=ckpt.store.key_uri(METADATA_NAME))
    if not is_indexed(ckpt):
        raise NotACheckpointError(f"{ckpt.uri} is not a DCP checkpoint (it has neither "
                                  f"{METADATA_NAME} nor {INDEX_NAME})")
    index = _index(ckpt)
    names = {r: fmt.records_name(r, index.key_spread) for r in range(index.world_size)}
    data = ckpt.read_many([n for n in names.values() if n in ckpt.files])
    records = {r: RankRecords.decode(data[n], source=ckpt.store.key_uri(n), rank=r,
                                     index=index)
               for r, n in names.items() if n in data}
    return fmt.stock_metadata(index, records, StorageMeta(checkpoint_id=ckpt.uri))


def _index(ckpt: Checkpoint) -> Index:
    if INDEX_NAME not in ckpt.files:
        raise CorruptCheckpointError(
            f"{ckpt.uri}'s manifest says it is an indexed DCP checkpoint but lists no "
            f"{INDEX_NAME}; fall back to an earlier checkpoint", {INDEX_NAME: "missing"})
    if ckpt.entry(INDEX_NAME).size > MAX_INDEX_BYTES:
        raise CorruptCheckpointError(f"{ckpt.store.key_uri(INDEX_NAME)} is larger than any "
                                     "index cloudckpt writes", {INDEX_NAME: "too large"})
    return Index.decode(ckpt.read(INDEX_NAME), source=ckpt.store.key_uri(INDEX_NAME))


def indexed_parts(ckpt: Checkpoint) -> list[str]:
    """The prefixes inside ``ckpt`` (``""``: itself) holding an indexed DCP checkpoint:
    a DCP checkpoint, or a training checkpoint's DCP part."""
    return sorted(f.removesuffix(INDEX_NAME).rstrip("/") for f in ckpt.files
                  if f == INDEX_NAME or f.endswith(f"/{INDEX_NAME}"))


def add_stock_metadata(ckpt: Checkpoint) -> list[str]:
    """Write a stock ``.metadata`` into each indexed DCP checkpoint in ``ckpt`` (a local
    copy, such as a download) that lacks one, beside the objects the manifest lists
    (so it is not one of them: the copy stays the checkpoint committed); returns the
    URIs written."""
    written = []
    for prefix in indexed_parts(ckpt):
        part = ckpt.part(prefix) if prefix else ckpt
        if not is_indexed(part) or METADATA_NAME in part.files:
            continue
        md = stock_metadata(part)
        part.store.put(METADATA_NAME, pickle.dumps(md))
        written.append(part.store.key_uri(METADATA_NAME))
        log.info("wrote %s for stock DCP readers", written[-1])
    return written
