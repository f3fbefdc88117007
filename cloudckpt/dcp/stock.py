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

from torch.distributed.checkpoint.metadata import Metadata

from cloudckpt.core.checkpoint import Checkpoint, open_checkpoint
from cloudckpt.dcp.indexread import full_metadata, is_indexed
from cloudckpt.dcp.metadata import METADATA_NAME, load_metadata
from cloudckpt.dcp.records import INDEX_NAME
from cloudckpt.errors import NotACheckpointError
from cloudckpt.storage import Store

log = logging.getLogger(__name__)


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
    return full_metadata(ckpt)[0]


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
