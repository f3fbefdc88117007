"""Reading an indexed DCP checkpoint: its index, the records a load needs, and torch's
``Metadata`` of just those.

A load of an indexed checkpoint (:mod:`.records`) reads the index (one object,
O(tensors)) and, for each tensor split by a rule, the records of the saved ranks
whose chunks overlap what this rank loads (:meth:`Rule.holders`): on the layout it
was saved with, this rank's own records only. A resharding rank needs most records
of a few saved ranks and one or two of others (where ``torch.chunk``'s rounding
differs between the two world sizes); records are sorted by tensor, so it reads
those few by range (:func:`plan_records_read`) rather than the whole file. From
them it builds a ``Metadata`` holding only those chunks, which torch's planner plans
against as it would the whole one. A stock-style load (:func:`full_metadata`) reads
every rank's records.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet
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
    RECORD_SIZE,
    RECORDS_HEADER_SIZE,
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


def holders(index: Index, needs: Needs) -> dict[int, set[int]]:
    """Per saved rank whose records hold a chunk this rank's state overlaps, the
    positions (in the index) of the tensors it needs from that rank (names and sizes
    checked against the index first: :func:`mismatch`)."""
    entries = {t.fqn: (i, t) for i, t in enumerate(index.tensors)}
    out: dict[int, set[int]] = {}
    for fqn, (_, boxes) in needs.tensors.items():
        found = entries.get(fqn)
        if found is None or found[1].rule.kind != CHUNKED:
            continue
        i, entry = found
        for offsets, sizes in boxes:
            for rank in entry.rule.holders(entry.size, offsets, sizes):
                out.setdefault(rank, set()).add(i)
    return out


#: A records file this small is read whole, whatever a load needs of it: one GET,
#: where ranged reads take two at least, for a few kilobytes saved.
WHOLE_RECORDS_BELOW = 16 * 1024
#: ... and so is one whose needed records are at least this share of its records.
WHOLE_RECORDS_SHARE = 0.5
#: Needed records closer than this are read in one range (the bytes between cost less
#: than another request).
RECORDS_GAP = 4096
#: The most ranged GETs of one records file (its header and name table included): the
#: smallest gaps are read through beyond that.
RECORDS_RANGES = 4


def coalesce(spans: Iterable[tuple[int, int]], *, gap: int = RECORDS_GAP,
             most: int = RECORDS_RANGES) -> list[tuple[int, int]]:
    """Byte ranges ``[start, end)`` covering ``spans``: overlapping ones and those at
    most ``gap`` apart merged, then, past ``most`` ranges, the ranges either side of
    the smallest gaps merged until ``most`` remain."""
    merged: list[list[int]] = []
    for start, end in sorted(spans):
        if merged and start - merged[-1][1] <= gap:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    if len(merged) > most >= 1:
        gaps = sorted(range(1, len(merged)), key=lambda k: merged[k][0] - merged[k - 1][1])
        keep = sorted(gaps[len(gaps) - (most - 1):]) if most > 1 else []
        starts = [0, *keep]
        merged = [[merged[a][0], merged[b - 1][1]]
                  for a, b in zip(starts, [*keep, len(merged)], strict=True)]
    return [(a, b) for a, b in merged]


@dataclass(frozen=True)
class RecordsRead:
    """How one saved rank's records are read: whole (``ranges`` empty), or the bytes
    before its records (``head`` of them) and the needed records, by ranges."""

    rank: int
    name: str
    head: int
    slots: dict[int, int]
    ranges: tuple[tuple[int, int], ...]


def plan_records_read(index: Index, rank: int, name: str, size: int,
                      tensors: AbstractSet[int] | None) -> RecordsRead:
    """How to read saved rank ``rank``'s records object ``name`` of ``size`` bytes (its
    manifest's), needing the records of the tensors at positions ``tensors`` (None:
    all). Its records are its last :data:`RECORD_SIZE` x n bytes, n the number of
    tensors the index gives it a part of (:meth:`Index.held`), sorted by position; a
    size too small for them raises :class:`CorruptCheckpointError`."""
    held = index.held(rank)
    head = size - len(held) * RECORD_SIZE
    if head < RECORDS_HEADER_SIZE:
        raise CorruptCheckpointError(
            f"{name} is {size} bytes, too few for a header and the {len(held)} records the "
            "index gives its rank; the checkpoint cannot be trusted: load an earlier one",
            {name: "too short for its records"})
    if (tensors is None or size < WHOLE_RECORDS_BELOW
            or len(tensors) >= WHOLE_RECORDS_SHARE * len(held)):
        return RecordsRead(rank, name, head, {}, ())
    slots = {}
    for t in sorted(tensors):
        k = bisect.bisect_left(held, t)
        if k == len(held) or held[k] != t:
            raise ValueError(f"rank {rank} holds no part of tensor {t}: its records have "
                             "none to read")
        slots[t] = head + k * RECORD_SIZE
    spans = [(0, head), *((s, s + RECORD_SIZE) for s in slots.values())]
    return RecordsRead(rank, name, head, slots, tuple(coalesce(spans)))


def read_records(ckpt: Checkpoint, index: Index,
                 wanted: Mapping[int, AbstractSet[int]] | Iterable[int]
                 ) -> dict[int, RankRecords]:
    """The records of the saved ranks ``wanted`` names, validated against the index:
    given a mapping, only the records of the tensors (positions) each rank's set
    names, by ranged reads where they are a small part of a large file
    (:func:`plan_records_read`); given ranks, all of theirs. Every GET is sent at once.
    A file missing from the manifest or the store, short, or malformed raises
    :class:`CorruptCheckpointError` naming it."""
    needs: dict[int, AbstractSet[int] | None] = (
        {r: wanted[r] for r in wanted} if isinstance(wanted, Mapping)
        else dict.fromkeys(wanted))
    plans = []
    for rank in sorted(needs):
        name = records_name(rank, index.key_spread)
        if name not in ckpt.manifest.files:
            raise CorruptCheckpointError(
                f"{ckpt.uri} lacks {name}, the records of rank {rank}, which holds chunks this "
                "load needs (the manifest does not list it); the checkpoint is not whole. "
                "Fall back to an earlier checkpoint.", {name: "not in the manifest"})
        plans.append(plan_records_read(index, rank, name,
                                       ckpt.entry(name).size, needs[rank]))
    gets: list[tuple[str, int, int] | str] = []
    for p in plans:
        gets += [(p.name, a, b) for a, b in p.ranges] if p.ranges else [p.name]
    raw = ckpt.store.map(lambda g: ckpt.read(g) if isinstance(g, str)
                         else ckpt.read_range(*g), gets)
    got = iter(raw)
    out = {}
    for p in plans:
        source = ckpt.store.key_uri(p.name)
        if not p.ranges:
            out[p.rank] = RankRecords.decode(next(got), source=source, rank=p.rank,
                                             index=index)
            continue
        pieces = [(a, next(got)) for a, _ in p.ranges]

        def at(start: int, end: int, pieces: list[tuple[int, bytes]] = pieces) -> bytes:
            for a, data in pieces:
                if a <= start and end <= a + len(data):
                    return data[start - a:end - a]
            raise AssertionError(f"bytes [{start}, {end}) were not read")

        out[p.rank] = RankRecords.decode_part(
            at(0, p.head), {t: at(s, s + RECORD_SIZE) for t, s in p.slots.items()},
            source=source, rank=p.rank, index=index)
    return out


def metadata_for(index: Index, records: Mapping[int, RankRecords], fqns: Iterable[str]
                 ) -> tuple[Metadata, ItemCrcs]:
    """torch's ``Metadata`` of the items ``fqns`` with the chunks in ``records`` only
    (of each saved rank, the tensors its records cover: :meth:`RankRecords.covering`),
    and the checksums of their items. Records covering a tensor but lacking a chunk
    the rule says that rank holds raise :class:`CorruptCheckpointError`."""
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
                if not records[rank].covering(i):
                    continue  # not read: this rank's state needs nothing of it from there
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
