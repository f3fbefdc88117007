"""The indexed DCP format: the checkpoint's index and each rank's chunk records.

A classic DCP checkpoint's ``.metadata`` lists every chunk of every tensor: items
x ranks entries, on one object every rank reads. The indexed format splits it:

- the index (:data:`INDEX_NAME`, JSON, written by the coordinator) describes each
  tensor once: its global size, its properties, its :class:`~cloudckpt.dcp.rules.Rule`,
  and for a tensor held whole (and each non-tensor item) where its bytes are; so it
  grows with tensors, not ranks;
- each rank's records (:func:`records_name`, binary) say where that rank's chunks
  went (file, offset, length, CRC32C), the chunk itself following from the rule.

Both are read as hostile input: anything malformed is a
:class:`~cloudckpt.errors.CorruptCheckpointError`. :func:`stock_metadata` builds
torch's own ``Metadata`` from them, for stock readers.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import struct
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from cloudckpt.compat.torch_private import StorageInfo
from cloudckpt.core.manifest import validate_path
from cloudckpt.dcp.rules import CHUNKED, WHOLE, Rule
from cloudckpt.errors import CorruptCheckpointError
from cloudckpt.names import DCP_INDEX_NAME

#: The manifest's ``dcp.format`` of a checkpoint in this format.
INDEXED_FORMAT = "indexed"
#: The coordinator's index of an indexed DCP checkpoint.
INDEX_NAME = DCP_INDEX_NAME
INDEX_FORMAT = "cloudckpt.dcp.index"
INDEX_VERSION = 1
#: Largest index read (about 2 KB a tensor: a million tensors).
MAX_INDEX_BYTES = 2 * 1024**3
_MAX_DIMS = 64
_MAX_INT = 2**62
_MAX_NAME = 4096

_RECORDS_MAGIC = b"CKDR"
_RECORDS_VERSION = 1
_HEADER = struct.Struct("<4sHHIQII")  # magic, version, 0, rank, digest, files, records
_NAME_LEN = struct.Struct("<H")
_RECORD = struct.Struct("<IIQQI")  # tensor, file, offset, length, crc32c


def records_name(rank: int, key_spread: int) -> str:
    """The object holding rank ``rank``'s records, spread over sub-prefixes as its
    data files are (``key_spread``)."""
    return spread_name(f"__{rank}_records", key_spread)


def spread_name(name: str, key_spread: int) -> str:
    """``name`` under its sub-prefix of ``key_spread`` (none when 0): the files of a
    large job spread over partitions of the store."""
    if not key_spread:
        return name
    bucket = zlib.crc32(name.encode()) % key_spread
    return f"{bucket:0{max(2, len(f'{key_spread - 1:x}'))}x}/{name}"


@dataclass(frozen=True)
class Location:
    """Where an item's bytes lie: its file (relative to the checkpoint), offset,
    length, and the CRC32C (hex) of those bytes."""

    file: str
    offset: int
    length: int
    crc32c: str

    def to_json(self) -> list[Any]:
        return [self.file, self.offset, self.length, self.crc32c]

    def storage_info(self) -> StorageInfo:
        return StorageInfo(self.file, self.offset, self.length)


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the index: ``location`` for a ``whole`` tensor, else None (its
    chunks are in the ranks' records)."""

    fqn: str
    size: tuple[int, ...]
    properties: TensorProperties
    rule: Rule
    location: Location | None = None

    @property
    def filled(self) -> int:
        """How many saved ranks hold a non-empty part, and so write it and a record of
        it: ranks ``0 .. filled - 1`` (:meth:`Rule.filled`)."""
        return self.rule.filled(self.size)


@dataclass(frozen=True)
class BytesEntry:
    """One non-tensor item of the index (written once, by its owner rank)."""

    fqn: str
    location: Location


def tensor_order(fqn: str, size: Sequence[int], rule: Rule) -> tuple[int, int, int, str]:
    """Where a tensor goes in the index, and so its record in a rank's records file:
    tensors split alike (the same rows in the split dimension, the same parts) side by
    side. A resharding rank needs of a saved rank mostly the tensors of one such
    group (where the two layouts' splits of those rows do not line up), which then
    lie in one range of the file rather than spread through it."""
    if rule.kind != CHUNKED:
        return (0, 0, 0, fqn)
    return (1, size[rule.dim], rule.parts, fqn)


@dataclass
class Index:
    """The index of an indexed DCP checkpoint (see the module's docstring). A record
    names its tensor by position in ``tensors``, which the saver orders by
    :func:`tensor_order`."""

    world_size: int
    key_spread: int
    digest: int
    tensors: list[TensorEntry]
    byte_items: list[BytesEntry] = field(default_factory=list)
    planner_data: dict[str, tuple[str | int, ...]] | None = None
    dcp_version: str | None = None

    #: :meth:`held`'s answers, by how many distinct part counts a rank is past
    #: (the index is not changed once built).
    _held: dict[int, tuple[int, ...]] = field(default_factory=dict, init=False,
                                              repr=False, compare=False)
    _parts: list[int] | None = field(default=None, init=False, repr=False, compare=False)

    def position(self) -> dict[str, int]:
        """Tensor name -> its position in :attr:`tensors`."""
        return {t.fqn: i for i, t in enumerate(self.tensors)}

    def held(self, rank: int) -> tuple[int, ...]:
        """The positions, ascending, of the tensors split by rule of which saved rank
        ``rank`` holds a non-empty part (``rank < rule.filled(size)``): exactly the
        tensors its records file has a record of, in that order, so the record of the
        k-th of them is the k-th of the file. An empty part has no bytes to find, so no
        record: a rank past a small tensor's rows reads nothing of it."""
        if self._parts is None:
            self._parts = sorted({t.filled for t in self.tensors
                                  if t.rule.kind == CHUNKED})
        past = bisect.bisect_right(self._parts, rank)
        found = self._held.get(past)
        if found is None:
            found = tuple(i for i, t in enumerate(self.tensors)
                          if t.rule.kind == CHUNKED and t.filled > rank)
            self._held[past] = found
        return found

    def encode(self) -> bytes:
        doc = {
            "format": INDEX_FORMAT, "version": INDEX_VERSION,
            "world_size": self.world_size, "key_spread": self.key_spread,
            "digest": f"{self.digest:016x}", "dcp_version": self.dcp_version,
            "tensors": [{"fqn": t.fqn, "size": list(t.size),
                         "properties": properties_json(t.properties),
                         "rule": t.rule.to_json(),
                         "location": None if t.location is None else t.location.to_json()}
                        for t in self.tensors],
            "bytes": [{"fqn": b.fqn, "location": b.location.to_json()}
                      for b in self.byte_items],
            "planner_data": None if self.planner_data is None else
            {k: list(v) for k, v in self.planner_data.items()},
        }
        return json.dumps(doc, separators=(",", ":")).encode()

    @staticmethod
    def decode(data: bytes, *, source: str = INDEX_NAME) -> Index:
        """The index in ``data``, validated: anything malformed raises
        :class:`CorruptCheckpointError` naming ``source`` and what is wrong."""
        return _IndexReader(source).read(data)


def properties_json(p: TensorProperties) -> list[Any]:
    """``TensorProperties`` as JSON: dtype, layout, requires_grad, memory format,
    pin_memory (names as torch spells them)."""
    return [str(p.dtype).removeprefix("torch."), str(p.layout).removeprefix("torch."),
            bool(p.requires_grad), str(p.memory_format).removeprefix("torch."),
            bool(p.pin_memory)]


_MEMORY_FORMATS = ("contiguous_format", "channels_last", "preserve_format",
                   "channels_last_3d")
_LAYOUTS = ("strided", "sparse_coo", "sparse_csr", "sparse_csc", "sparse_bsr",
            "sparse_bsc", "_mkldnn", "jagged")


class _IndexReader:
    def __init__(self, source: str) -> None:
        self.source = source

    def bad(self, what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"{self.source} is malformed ({what}); the checkpoint cannot be trusted: load "
            "an earlier one", {self.source: what})

    def read(self, data: bytes) -> Index:
        if len(data) > MAX_INDEX_BYTES:
            raise self.bad(f"{len(data)} bytes, more than {MAX_INDEX_BYTES}")
        try:
            doc = json.loads(bytes(data).decode("utf-8"), object_pairs_hook=_unique)
        except (ValueError, RecursionError) as exc:
            raise self.bad(f"not JSON: {str(exc)[:200]}") from None
        if not isinstance(doc, dict) or doc.get("format") != INDEX_FORMAT:
            raise self.bad("not a cloudckpt DCP index")
        if doc.get("version") != INDEX_VERSION:
            raise CorruptCheckpointError(
                f"{self.source} has index version {_short(doc.get('version'))}; this "
                f"cloudckpt reads version {INDEX_VERSION}: upgrade cloudckpt to load it",
                {self.source: "version"})
        world = self.integer(doc.get("world_size"), "world_size", 1, 2**31 - 1)
        spread = self.integer(doc.get("key_spread"), "key_spread", 0, 2**31 - 1)
        digest = doc.get("digest")
        if not (isinstance(digest, str) and len(digest) == 16):
            raise self.bad("digest is not 16 hex digits")
        try:
            digest_value = int(digest, 16)
        except ValueError:
            raise self.bad("digest is not 16 hex digits") from None
        version = doc.get("dcp_version")
        if version is not None and not (isinstance(version, str) and len(version) < 64):
            raise self.bad("dcp_version is not a short string")
        tensors = [self.tensor(t) for t in self.seq(doc.get("tensors"), "tensors")]
        byte_items = [BytesEntry(self.fqn(b, "bytes"), self.location(self.get(b, "location")))
                      for b in self.seq(doc.get("bytes"), "bytes")]
        for t in tensors:
            if t.rule.kind == CHUNKED and t.rule.parts > world:
                raise self.bad(f"{t.fqn} is split into {t.rule.parts} parts by "
                               f"{world} ranks")
        every = [t.fqn for t in tensors] + [b.fqn for b in byte_items]
        if len(set(every)) != len(every):
            raise self.bad("an item is named twice")
        return Index(world, spread, digest_value, tensors, byte_items,
                     self.planner_data(doc.get("planner_data")), version)

    def get(self, doc: Any, key: str) -> Any:
        if not isinstance(doc, dict) or key not in doc:
            raise self.bad(f"an entry lacks {key!r}")
        return doc[key]

    def seq(self, value: Any, what: str) -> list[Any]:
        if not isinstance(value, list):
            raise self.bad(f"{what} is not a list")
        return value

    def integer(self, value: Any, what: str, low: int = 0, high: int = _MAX_INT) -> int:
        if type(value) is not int or not low <= value <= high:
            raise self.bad(f"{what} is {_short(value)}, not an integer in [{low}, {high}]")
        return value

    def fqn(self, doc: Any, what: str) -> str:
        name = self.get(doc, "fqn")
        if not isinstance(name, str) or not name or len(name) > _MAX_NAME \
                or not _utf8(name):
            raise self.bad(f"a name in {what} is {_short(name)}")
        return name

    def location(self, doc: Any) -> Location:
        if not (isinstance(doc, list) and len(doc) == 4):
            raise self.bad(f"location {_short(doc)} is not [file, offset, length, crc32c]")
        file = validate_path(doc[0], source=self.source)
        crc = doc[3]
        if not (isinstance(crc, str) and len(crc) == 8 and all(c in "0123456789abcdef"
                                                               for c in crc)):
            raise self.bad(f"CRC32C {_short(crc)} is not 8 hex digits")
        return Location(file, self.integer(doc[1], "an offset"),
                        self.integer(doc[2], "a length"), crc)

    def tensor(self, doc: Any) -> TensorEntry:
        fqn = self.fqn(doc, "tensors")
        size = self.seq(self.get(doc, "size"), f"{fqn}'s size")
        if len(size) > _MAX_DIMS:
            raise self.bad(f"{fqn} has {len(size)} dimensions")
        dims = tuple(self.integer(s, f"{fqn}'s size") for s in size)
        rule = Rule.from_json(self.get(doc, "rule"), ndim=len(dims))
        loc = self.get(doc, "location")
        location = None if loc is None else self.location(loc)
        if (location is None) != (rule.kind == CHUNKED):
            raise self.bad(f"{fqn} is {rule.kind} but {'lacks' if location is None else 'has'}"
                           " a location")
        return TensorEntry(fqn, dims, self.properties(self.get(doc, "properties"), fqn), rule,
                           location)

    def properties(self, doc: Any, fqn: str) -> TensorProperties:
        if not (isinstance(doc, list) and len(doc) == 5):
            raise self.bad(f"{fqn}'s properties are {_short(doc)}")
        dtype_name, layout_name, grad, fmt, pin = doc
        dtype = getattr(torch, dtype_name, None) if isinstance(dtype_name, str) else None
        if not isinstance(dtype, torch.dtype):
            raise self.bad(f"{fqn}'s dtype {_short(dtype_name)} is not a torch dtype")
        if layout_name not in _LAYOUTS or fmt not in _MEMORY_FORMATS \
                or type(grad) is not bool or type(pin) is not bool:
            raise self.bad(f"{fqn}'s properties {_short(doc)} are not valid")
        layout = getattr(torch, layout_name, None)
        memory_format = getattr(torch, fmt, None)
        if not isinstance(layout, torch.layout) or \
                not isinstance(memory_format, torch.memory_format):
            raise self.bad(f"{fqn}'s properties {_short(doc)} are not valid on this torch")
        return TensorProperties(dtype=dtype, layout=layout, requires_grad=grad,
                                memory_format=memory_format, pin_memory=pin)

    def planner_data(self, doc: Any) -> dict[str, tuple[str | int, ...]] | None:
        if doc is None:
            return None
        if not isinstance(doc, dict):
            raise self.bad("planner_data is not an object")
        out = {}
        for key, path in doc.items():
            if not (isinstance(path, list) and len(path) <= _MAX_DIMS and all(
                    isinstance(p, str) or type(p) is int for p in path)):
                raise self.bad(f"planner_data of {_short(key)} is {_short(path)}")
            out[key] = tuple(path)
        return out


# ------------------------------------------------------------------ records


@dataclass(frozen=True)
class Record:
    """One chunk a rank wrote: the tensor (its position in the index) and where its
    bytes lie. The chunk itself is the tensor's rule's for that rank."""

    tensor: int
    location: Location


#: Bytes of one record; a rank's records are its file's last ``RECORD_SIZE`` x n bytes.
RECORD_SIZE = _RECORD.size
#: Bytes of a records file's header (its file-name table follows).
RECORDS_HEADER_SIZE = _HEADER.size


@dataclass
class RankRecords:
    """Chunks one rank wrote of the tensors its index splits by rule: all of them, or
    (``covers``) those of the tensors at the positions a partial read asked for."""

    rank: int
    digest: int
    records: list[Record]
    #: The tensor positions read, where only some records were (None: every record).
    covers: frozenset[int] | None = None

    def covering(self, tensor: int) -> bool:
        """Whether these records say what the rank holds of ``tensor`` (its record, or
        that it has none), rather than not having been read."""
        return self.covers is None or tensor in self.covers

    def encode(self) -> bytes:
        """The records file: header, file-name table, then the records sorted by tensor
        position, so that a reader finds the record of any tensor at a place it
        computes from the index (:meth:`Index.held`) and reads it by range."""
        ordered = sorted(self.records, key=lambda r: r.tensor)
        files: dict[str, int] = {}
        for r in ordered:
            files.setdefault(r.location.file, len(files))
        out = [_HEADER.pack(_RECORDS_MAGIC, _RECORDS_VERSION, 0, self.rank, self.digest,
                            len(files), len(ordered))]
        for name in files:
            raw = name.encode()
            out += [_NAME_LEN.pack(len(raw)), raw]
        out += [_RECORD.pack(r.tensor, files[r.location.file], r.location.offset,
                             r.location.length, int(r.location.crc32c, 16))
                for r in ordered]
        return b"".join(out)

    @staticmethod
    def decode(data: bytes, *, source: str, rank: int | None = None,
               index: Index | None = None) -> RankRecords:
        """The records in ``data``, validated (and against ``rank`` and ``index``
        when given: the same save, and exactly one record, in order, of each tensor the
        index splits by rule and gives this rank a part of: :meth:`Index.held`);
        anything else raises :class:`CorruptCheckpointError`."""
        return _decode_records(memoryview(data).cast("B"), source, rank, index)

    @staticmethod
    def decode_part(head: bytes, records: Mapping[int, bytes], *, source: str, rank: int,
                    index: Index) -> RankRecords:
        """The records of the tensors at the positions ``records`` keys, from ranged
        reads of a records file: ``head``, its bytes before the records (header and
        file-name table), and each record's :data:`RECORD_SIZE` bytes read at its place
        (:meth:`Index.held`). Validated as :meth:`decode` does, and each record must
        name the tensor expected at its place; else :class:`CorruptCheckpointError`."""
        bad = _bad_records(source)
        view = memoryview(head).cast("B")
        saved_rank, digest, names, end, n_records = _decode_head(view, source, rank, index)
        if end != len(view):
            raise bad(f"its file names take {end - _HEADER.size} bytes, not the "
                      f"{len(view) - _HEADER.size} before its records")
        held = index.held(saved_rank)
        if n_records != len(held):
            raise bad(f"{n_records} records, where the index gives rank {saved_rank} a part "
                      f"of {len(held)} tensors")
        out = []
        for tensor in sorted(records):
            raw = records[tensor]
            if len(raw) != RECORD_SIZE:
                raise bad(f"the record of tensor {tensor} is {len(raw)} bytes")
            got, file, offset, length, crc = _RECORD.unpack(raw)
            if got != tensor:
                raise bad(f"the record where {_fqn(index, tensor)} belongs names tensor "
                          f"{got}")
            if file >= len(names):
                raise bad(f"a record names file {file} of {len(names)}")
            if offset > _MAX_INT or length > _MAX_INT:
                raise bad("a record's offset or length is out of range")
            out.append(Record(tensor, Location(names[file], offset, length, f"{crc:08x}")))
        return RankRecords(saved_rank, digest, out, frozenset(records))


def _fqn(index: Index, tensor: int) -> str:
    return index.tensors[tensor].fqn if 0 <= tensor < len(index.tensors) else f"#{tensor}"


def _bad_records(source: str) -> Callable[[str], CorruptCheckpointError]:
    def bad(what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"{source} is malformed ({what}); the checkpoint cannot be trusted: load an "
            "earlier one", {source: what})
    return bad


def _decode_head(data: memoryview, source: str, rank: int | None, index: Index | None
                 ) -> tuple[int, int, list[str], int, int]:
    """A records file's header and file-name table, validated: (rank, digest, file
    names, where the names end, number of records)."""
    bad = _bad_records(source)
    if len(data) < _HEADER.size:
        raise bad(f"{len(data)} bytes, shorter than its header")
    magic, version, _, saved_rank, digest, n_files, n_records = _HEADER.unpack_from(data)
    if magic != _RECORDS_MAGIC:
        raise bad("not a cloudckpt records file")
    if version != _RECORDS_VERSION:
        raise bad(f"records version {version}, this cloudckpt reads {_RECORDS_VERSION}")
    if rank is not None and saved_rank != rank:
        raise bad(f"it holds rank {saved_rank}'s records, not rank {rank}'s")
    if index is not None and digest != index.digest:
        raise bad("its save is not the index's (another structure digest)")
    pos = _HEADER.size
    names = []
    for _ in range(n_files):
        if pos + _NAME_LEN.size > len(data):
            raise bad("its file names end early")
        (n,) = _NAME_LEN.unpack_from(data, pos)
        pos += _NAME_LEN.size
        if pos + n > len(data):
            raise bad("its file names end early")
        try:
            name = bytes(data[pos:pos + n]).decode("utf-8")
        except UnicodeDecodeError:
            raise bad("a file name is not UTF-8") from None
        names.append(validate_path(name, source=source))
        pos += n
    return saved_rank, digest, names, pos, n_records


def _decode_records(data: memoryview, source: str, rank: int | None,
                    index: Index | None) -> RankRecords:
    bad = _bad_records(source)
    saved_rank, digest, names, pos, n_records = _decode_head(data, source, rank, index)
    n_files = len(names)
    if len(data) - pos != n_records * _RECORD.size:
        raise bad(f"{len(data) - pos} bytes of records, not {n_records} of {_RECORD.size}")
    held = index.held(saved_rank) if index is not None else ()
    records = []
    seen: set[int] = set()
    for k, (tensor, file, offset, length, crc) in enumerate(_RECORD.iter_unpack(data[pos:])):
        if file >= n_files:
            raise bad(f"a record names file {file} of {n_files}")
        if offset > _MAX_INT or length > _MAX_INT:
            raise bad("a record's offset or length is out of range")
        if index is not None:
            if tensor >= len(index.tensors):
                raise bad(f"a record names tensor {tensor} of {len(index.tensors)}")
            rule = index.tensors[tensor].rule
            if rule.kind != CHUNKED or saved_rank >= index.tensors[tensor].filled:
                raise bad(f"rank {saved_rank} holds no part of {index.tensors[tensor].fqn}")
            if tensor in seen:
                raise bad(f"{index.tensors[tensor].fqn} is recorded twice")
            seen.add(tensor)
            if k >= len(held) or held[k] != tensor:
                raise bad(f"record {k} names {index.tensors[tensor].fqn}, out of order or "
                          "with another missing before it")
        records.append(Record(tensor, Location(names[file], offset, length, f"{crc:08x}")))
    if index is not None and len(records) != len(held):
        raise bad(f"{len(records)} records, where the index gives rank {saved_rank} a part "
                  f"of {len(held)} tensors")
    return RankRecords(saved_rank, digest, records)


# ------------------------------------------------------------ structure digest


def structure_digest(world_size: int, key_spread: int,
                     tensors: Iterable[tuple[str, Sequence[int], TensorProperties, Rule]],
                     byte_fqns: Iterable[str],
                     planner_data: Mapping[str, Sequence[str | int]] | None = None) -> int:
    """A 63-bit digest of a save's structure: what every rank must agree on for the
    index to describe the save (world, spread, each tensor's name, size, properties
    and rule, the non-tensor items' names, where each flattened name came from).
    Equal digests on every rank, and equal to the previous save's, mean the previous
    plan holds."""
    doc = [world_size, key_spread,
           sorted([f, list(s), properties_json(p), r.to_json()] for f, s, p, r in tensors),
           sorted(byte_fqns),
           None if planner_data is None else sorted([k, list(v)]
                                                    for k, v in planner_data.items())]
    raw = hashlib.blake2b(json.dumps(doc, separators=(",", ":")).encode(),
                          digest_size=8).digest()
    return int.from_bytes(raw, "little") >> 1


# ------------------------------------------------------------ stock metadata


def stock_metadata(index: Index, records_by_rank: Mapping[int, RankRecords],
                   storage_meta: StorageMeta | None = None) -> Metadata:
    """torch's own ``Metadata`` (what stock ``.metadata`` holds) of the checkpoint
    ``index`` describes, from every rank's records. A rank's records missing where
    the rules say it holds a non-empty chunk raise :class:`CorruptCheckpointError`."""
    chunks: dict[int, list[tuple[int, Location]]] = {}
    for rank in sorted(records_by_rank):
        for rec in records_by_rank[rank].records:
            if rec.tensor >= len(index.tensors):
                raise CorruptCheckpointError(
                    f"rank {rank}'s records name tensor {rec.tensor} of "
                    f"{len(index.tensors)}", {f"records of rank {rank}": "tensor"})
            chunks.setdefault(rec.tensor, []).append((rank, rec.location))
    sd_md: dict[str, Any] = {}
    storage: dict[MetadataIndex, StorageInfo] = {}
    for i, t in enumerate(index.tensors):
        size = torch.Size(t.size)
        if t.rule.kind == WHOLE:
            assert t.location is not None  # the index refuses a whole tensor without one
            zeros = torch.Size([0] * len(t.size))
            sd_md[t.fqn] = TensorStorageMetadata(t.properties, size,
                                                 [ChunkStorageMetadata(zeros, size)])
            storage[MetadataIndex(t.fqn, zeros, 0)] = t.location.storage_info()
            continue
        held = {rank for rank, _ in chunks.get(i, [])}
        for r in set(range(t.filled)) - held if len(held) < t.filled else ():
            box = t.rule.chunk(t.size, r)
            if box is not None and all(box[1]):
                raise CorruptCheckpointError(
                    f"no records of rank {r} for {t.fqn}, which the rule says it holds; the "
                    "checkpoint is incomplete", {records_name(r, index.key_spread): "missing"})
        md_chunks = []
        for k, (rank, loc) in enumerate(chunks.get(i, [])):
            box = t.rule.chunk(t.size, rank)
            assert box is not None  # records of ranks past parts were refused
            offsets, sizes = torch.Size(box[0]), torch.Size(box[1])
            md_chunks.append(ChunkStorageMetadata(offsets, sizes))
            storage[MetadataIndex(t.fqn, offsets, k)] = loc.storage_info()
        sd_md[t.fqn] = TensorStorageMetadata(t.properties, size, md_chunks)
    for b in index.byte_items:
        sd_md[b.fqn] = BytesStorageMetadata()
        storage[MetadataIndex(b.fqn)] = b.location.storage_info()
    md = Metadata(state_dict_metadata=sd_md,
                  planner_data=None if index.planner_data is None else dict(index.planner_data),
                  storage_data=storage, storage_meta=storage_meta)
    if index.dcp_version is not None:
        md.version = index.dcp_version
    return md


def item_crcs(index: Index, records: Iterable[RankRecords]) -> list[tuple[str, int, str]]:
    """``(file, offset, crc32c)`` of every item the index and ``records`` locate:
    what a reader checks each read against."""
    out = [(t.location.file, t.location.offset, t.location.crc32c)
           for t in index.tensors if t.location is not None]
    out += [(b.location.file, b.location.offset, b.location.crc32c) for b in index.byte_items]
    out += [(r.location.file, r.location.offset, r.location.crc32c)
            for rr in records for r in rr.records]
    return out


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key[:100]!r} twice")
        out[key] = value
    return out


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:197] + "..."
