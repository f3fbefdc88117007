"""Reading an indexed DCP checkpoint: its index, the records a load needs, and torch's
``Metadata`` of just those.

A load of an indexed checkpoint (:mod:`.records`) reads the index (one object,
O(tensors)) and, for each tensor split by a rule, the records of the saved ranks
whose chunks overlap what this rank loads (:meth:`Rule.holders`): on the layout it
was saved with, this rank's own records only. From them it builds a ``Metadata``
holding only those chunks, which torch's planner plans against as it would the
whole one. A stock-style load (:func:`full_metadata`) reads every rank's records.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)

from cloudckpt.compat.torch_private import StorageInfo
from cloudckpt.core.checkpoint import Checkpoint
from cloudckpt.dcp.metadata import ItemCrcs
from cloudckpt.dcp.records import (
    INDEX_NAME,
    INDEXED_FORMAT,
    MAX_INDEX_BYTES,
    Index,
    Location,
    RankRecords,
    item_crcs,
    records_name,
    stock_metadata,
)
from cloudckpt.dcp.rules import CHUNKED, WHOLE
from cloudckpt.errors import CorruptCheckpointError

Box = tuple[tuple[int, ...], tuple[int, ...]]


def is_indexed(ckpt: Checkpoint) -> bool:
    """Whether ``ckpt`` is in the indexed format (its manifest says so)."""
    doc = ckpt.metadata.get("dcp")
    return isinstance(doc, Mapping) and doc.get("format") == INDEXED_FORMAT


def read_index(ckpt: Checkpoint) -> Index:
    """The checkpoint's index, read through its manifest and validated."""
    if INDEX_NAME not in ckpt.manifest.files:
        raise CorruptCheckpointError(
            f"the manifest of {ckpt.uri} says its DCP checkpoint is indexed but lists no "
            f"{INDEX_NAME}; the checkpoint is not whole. Fall back to an earlier checkpoint.",
            {INDEX_NAME: "not in the manifest"})
    if ckpt.entry(INDEX_NAME).size > MAX_INDEX_BYTES:
        raise CorruptCheckpointError(f"{ckpt.store.key_uri(INDEX_NAME)} is larger than any "
                                     "index cloudckpt writes", {INDEX_NAME: "too large"})
    index = Index.decode(ckpt.read(INDEX_NAME), source=ckpt.store.key_uri(INDEX_NAME))
    for t in index.tensors:
        if t.rule.kind == CHUNKED and t.rule.parts > index.world_size:
            raise CorruptCheckpointError(
                f"{ckpt.store.key_uri(INDEX_NAME)} splits {t.fqn} into {t.rule.parts} parts "
                f"but was saved by {index.world_size} ranks; the checkpoint cannot be trusted",
                {INDEX_NAME: f"rule of {t.fqn}"})
    return index


@dataclass(frozen=True)
class Needs:
    """What one rank's state loads: each tensor's global size and the boxes
    ``(offsets, sizes)`` it holds of it (several for a sharded tensor of several local
    shards), and the names of its other values."""

    tensors: dict[str, tuple[tuple[int, ...], list[Box]]]
    byte_items: frozenset[str]


def holders(index: Index, needs: Needs) -> set[int]:
    """The saved ranks whose records hold a chunk this rank's state overlaps (its
    names and sizes checked against the index first: :func:`mismatch`)."""
    entries = {t.fqn: t for t in index.tensors}
    out: set[int] = set()
    for fqn, (_, boxes) in needs.tensors.items():
        entry = entries.get(fqn)
        if entry is None or entry.rule.kind != CHUNKED:
            continue
        for offsets, sizes in boxes:
            out.update(entry.rule.holders(entry.size, offsets, sizes))
    return out


def read_records(ckpt: Checkpoint, index: Index, ranks: Iterable[int]
                 ) -> dict[int, RankRecords]:
    """The records of saved ``ranks``, read in parallel and validated against the index;
    one missing from the manifest or the store, short, or malformed raises
    :class:`CorruptCheckpointError` naming it."""
    wanted = sorted(set(ranks))
    names = [records_name(r, index.key_spread) for r in wanted]
    for rank, name in zip(wanted, names, strict=True):
        if name not in ckpt.manifest.files:
            raise CorruptCheckpointError(
                f"{ckpt.uri} lacks {name}, the records of rank {rank}, which holds chunks this "
                "load needs (the manifest does not list it); the checkpoint is not whole. "
                "Fall back to an earlier checkpoint.", {name: "not in the manifest"})
    raw = ckpt.store.map(ckpt.read, names)
    return {rank: RankRecords.decode(data, source=ckpt.store.key_uri(name), rank=rank,
                                     index=index)
            for rank, name, data in zip(wanted, names, raw, strict=True)}


def metadata_for(index: Index, records: Mapping[int, RankRecords], fqns: Iterable[str]
                 ) -> tuple[Metadata, ItemCrcs]:
    """torch's ``Metadata`` of the items ``fqns`` with the chunks of the saved ranks in
    ``records`` only, and the checksums of their items. A rank whose records lack a
    chunk its rule says it holds raises :class:`CorruptCheckpointError`."""
    entries = {t.fqn: (i, t) for i, t in enumerate(index.tensors)}
    byte_items = {b.fqn: b.location for b in index.byte_items}
    located: dict[tuple[int, int], Location] = {
        (rank, rec.tensor): rec.location for rank, rr in records.items() for rec in rr.records}
    sd_md: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    storage: dict[MetadataIndex, StorageInfo] = {}
    crcs: list[tuple[str, int, str]] = []
    for fqn in fqns:
        if fqn in byte_items:
            loc = byte_items[fqn]
            sd_md[fqn] = BytesStorageMetadata()
            storage[MetadataIndex(fqn)] = loc.storage_info()
            crcs.append((loc.file, loc.offset, loc.crc32c))
            continue
        if fqn not in entries:
            continue
        i, t = entries[fqn]
        size = torch.Size(t.size)
        chunks = []
        if t.rule.kind == WHOLE:
            assert t.location is not None  # the index refuses a whole tensor without one
            zeros = torch.Size([0] * len(t.size))
            chunks.append(ChunkStorageMetadata(zeros, size))
            storage[MetadataIndex(fqn, zeros, 0)] = t.location.storage_info()
            crcs.append((t.location.file, t.location.offset, t.location.crc32c))
        else:
            for rank in sorted(records):
                box = t.rule.chunk(t.size, rank)
                if box is None or not all(box[1]):
                    continue  # this rank holds nothing of it
                found = located.get((rank, i))
                if found is None:
                    raise CorruptCheckpointError(
                        f"the records of rank {rank} have no entry for {fqn}, which its rule "
                        "says that rank holds; the checkpoint cannot be trusted",
                        {records_name(rank, index.key_spread): f"lacks {fqn}"})
                offsets = torch.Size(box[0])
                storage[MetadataIndex(fqn, offsets, len(chunks))] = found.storage_info()
                chunks.append(ChunkStorageMetadata(offsets, torch.Size(box[1])))
                crcs.append((found.file, found.offset, found.crc32c))
        sd_md[fqn] = TensorStorageMetadata(t.properties, size, chunks)
    md = Metadata(state_dict_metadata=dict(sd_md),
                  planner_data=None if index.planner_data is None else dict(index.planner_data),
                  storage_data=storage, storage_meta=StorageMeta())
    if index.dcp_version is not None:
        md.version = index.dcp_version
    return md, ItemCrcs.of(crcs)


def all_records(ckpt: Checkpoint) -> tuple[Index, dict[int, RankRecords]]:
    """The index and the records of every rank that wrote any (items x ranks entries:
    what a stock ``.metadata`` holds)."""
    index = read_index(ckpt)
    ranks = [r for r in range(index.world_size)
             if records_name(r, index.key_spread) in ckpt.manifest.files]
    return index, read_records(ckpt, index, ranks)


def full_metadata(ckpt: Checkpoint) -> tuple[Metadata, ItemCrcs]:
    """The whole ``Metadata`` of an indexed checkpoint, as a stock ``.metadata`` would hold
    it, and every item's checksum (:func:`all_records`)."""
    index, records = all_records(ckpt)
    md = stock_metadata(index, records, StorageMeta(checkpoint_id=ckpt.uri))
    return md, ItemCrcs.of(item_crcs(index, records.values()))


def whole_items(index: Index) -> dict[MetadataIndex, Location]:
    """Where each item held whole lies (tensors saved whole, non-tensor values), by the
    index torch's planner reads it under."""
    out = {MetadataIndex(b.fqn): b.location for b in index.byte_items}
    for t in index.tensors:
        if t.location is not None:
            out[MetadataIndex(t.fqn, torch.Size([0] * len(t.size)))] = t.location
    return out
