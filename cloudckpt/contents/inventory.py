"""What a committed checkpoint holds, tensor by tensor, read from its metadata alone.

:func:`list_contents` walks the manifest: each directory holding a DCP ``.metadata``
(a DCP checkpoint, or a DCP part of a training checkpoint or a framework's layout)
is listed from that file and its manifest's item checksums, each ``*.safetensors``
file from its header (ranged reads of its head), and every other object by its
manifest entry. No tensor byte is read, so listing a checkpoint of any size costs a
few small requests.
"""

from __future__ import annotations

import fnmatch
import json
import posixpath
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from cloudckpt.core.checkpoint import Checkpoint, open_checkpoint
from cloudckpt.core.manifest import Manifest
from cloudckpt.errors import ManifestError
from cloudckpt.hf.lazy import DTYPES, INDEX_SUFFIX, read_header, tensor_checksums
from cloudckpt.names import MANIFEST_NAME

__all__ = ["Contents", "Entry", "OtherFile", "list_contents"]

DCP_METADATA = ".metadata"
DCP_INDEX = "cloudckpt-dcp-index.json"  # an indexed DCP checkpoint's (dcp.records)
DCP_RECORDS = "_records"
DCP_SUFFIX = ".distcp"
SAFETENSORS = ".safetensors"


@dataclass(frozen=True)
class Entry:
    """One tensor (or, in DCP, one pickled non-tensor value) of a checkpoint.

    ``part`` is the directory of the DCP checkpoint or safetensors file holding it
    (``""`` at the top); ``checksums`` identify its bytes without reading them: a
    (chunk offsets, CRC32C) pair per DCP item, or one ``("", CRC32C)`` for a safetensors
    tensor; ``None`` where only the files' checksums are known (``files`` name those).
    """

    name: str
    part: str
    format: str  # "dcp", "dcp-bytes" or "safetensors"
    dtype: str | None
    shape: tuple[int, ...] | None
    nbytes: int
    shards: int
    files: tuple[str, ...]
    checksums: tuple[tuple[str, str], ...] | None = field(default=None, compare=False)

    @property
    def key(self) -> str:
        """Unique within a checkpoint: the name, after its part's directory."""
        return f"{self.part}/{self.name}" if self.part else self.name

    @property
    def group(self) -> str:
        """The top-level key it belongs to (``model``, ``optimizer``, ``lm_head``, ...)."""
        return self.name.split(".", 1)[0].split("/", 1)[0]

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "part": self.part, "format": self.format,
                "dtype": self.dtype, "shape": None if self.shape is None else list(self.shape),
                "bytes": self.nbytes, "shards": self.shards, "files": list(self.files)}


@dataclass(frozen=True)
class OtherFile:
    """An object that is not tensor data a listing could read (state, configs, a
    framework's own pickles): shown with its size and checksum."""

    path: str
    nbytes: int
    crc32c: str


@dataclass(frozen=True)
class Contents:
    """A checkpoint's tensors and other files, and what reading them cost."""

    uri: str
    kind: str
    step: int | None
    entries: tuple[Entry, ...]
    others: tuple[OtherFile, ...]
    file_crcs: Mapping[str, str]
    total_bytes: int
    problems: tuple[str, ...] = ()

    def matching(self, patterns: Sequence[str]) -> Contents:
        """Only the entries whose name or key matches one of the glob ``patterns``, and
        the other files whose path does (all of them when ``patterns`` is empty)."""
        if not patterns:
            return self

        def hit(*names: str) -> bool:
            return any(fnmatch.fnmatchcase(n, p) for n in names for p in patterns)

        return replace(self, entries=tuple(e for e in self.entries if hit(e.name, e.key)),
                       others=tuple(f for f in self.others if hit(f.path)))

    def totals(self) -> dict[str, dict[str, int]]:
        """Per top-level key: tensors (and DCP values), bytes."""
        out: dict[str, dict[str, int]] = {}
        for e in self.entries:
            t = out.setdefault(e.group, {"tensors": 0, "bytes": 0})
            t["tensors"] += 1
            t["bytes"] += e.nbytes
        return dict(sorted(out.items()))

    def to_json(self) -> dict[str, Any]:
        return {"uri": self.uri, "kind": self.kind, "step": self.step,
                "total_bytes": self.total_bytes,
                "tensors": [e.to_json() for e in self.entries],
                "totals": self.totals(),
                "files": [{"path": f.path, "bytes": f.nbytes} for f in self.others],
                "problems": list(self.problems)}


def list_contents(uri: str | Checkpoint, storage_options: Mapping[str, Any] | None = None
                  ) -> Contents:
    """The contents of the committed checkpoint at ``uri``, from its metadata alone."""
    ckpt = uri if isinstance(uri, Checkpoint) else open_checkpoint(uri, storage_options)
    files = ckpt.files
    dcp_dirs = sorted({posixpath.dirname(p) for p in files
                       if posixpath.basename(p) in (DCP_METADATA, DCP_INDEX)})
    tensor_files = [p for p in files if p.endswith(SAFETENSORS)]
    entries: list[Entry] = []
    for found in ckpt.store.map(lambda d: _dcp_entries(ckpt, d), dcp_dirs):
        entries += found
    crcs = tensor_checksums(ckpt)
    for found in ckpt.store.map(lambda p: _safetensors_entries(ckpt, p, crcs), tensor_files):
        entries += found
    problems = _index_problems(ckpt, entries)
    read = {p for p in files if _in_dcp(p, dcp_dirs) or p in tensor_files
            or posixpath.basename(p) == MANIFEST_NAME}
    others = tuple(OtherFile(p, ckpt.manifest.files[p].size, ckpt.manifest.files[p].crc32c)
                   for p in files if p not in read)
    return Contents(ckpt.uri, ckpt.manifest.kind, ckpt.step,
                    tuple(sorted(entries, key=lambda e: (e.part, e.name))), others,
                    {p: e.crc32c for p, e in ckpt.manifest.files.items()},
                    ckpt.total_size, tuple(problems))


def _in_dcp(path: str, dcp_dirs: Iterable[str]) -> bool:
    """A DCP checkpoint's own file: its ``.metadata``, one of its ``.distcp`` files, or
    (indexed) its index or a rank's records."""
    d, base = posixpath.split(path)
    if base.endswith(DCP_RECORDS) and posixpath.dirname(d) in dcp_dirs:
        d = posixpath.dirname(d)  # under a key_spread sub-prefix
    return d in dcp_dirs and (base in (DCP_METADATA, DCP_INDEX) or base.endswith(DCP_SUFFIX)
                              or base.endswith(DCP_RECORDS))


def _join(part: str, path: str) -> str:
    return f"{part}/{path}" if part else path


def _part_metadata(ckpt: Checkpoint, part: str) -> Mapping[str, Any]:
    """The manifest metadata of the DCP checkpoint at ``part``: the checkpoint's own, or
    the part's manifest listed in it (a part written without one has none)."""
    if not part:
        return ckpt.metadata
    key = _join(part, MANIFEST_NAME)
    if key not in ckpt.manifest.files:
        return {}
    try:
        return Manifest.from_json(ckpt.read(key), source=f"{ckpt.uri}/{key}").metadata
    except ManifestError:
        return {}


def _dcp_entries(ckpt: Checkpoint, part: str) -> list[Entry]:
    """The items of the DCP checkpoint at ``part``, from its ``.metadata``."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from cloudckpt.dcp.indexread import full_metadata, is_indexed
    from cloudckpt.dcp.metadata import ItemCrcs, load_metadata

    own = ckpt.part(part) if part and _join(part, MANIFEST_NAME) in ckpt.manifest.files \
        else ckpt
    if is_indexed(own):  # the index and every rank's records (the checksums are there)
        md, crcs = full_metadata(own)
    else:
        key = _join(part, DCP_METADATA)
        md = load_metadata(ckpt.read(key), source=f"{ckpt.uri}/{key}")
        crcs = ItemCrcs(_part_metadata(ckpt, part).get("dcp"))
    where: dict[str, list[tuple[tuple[int, ...], str, int, str | None]]] = {}
    for index, info in (md.storage_data or {}).items():
        offset = tuple(index.offset) if index.offset is not None else ()
        where.setdefault(index.fqn, []).append(
            (offset, info.relative_path, info.length, crcs.get(info.relative_path, info.offset)))
    out = []
    for fqn, meta in md.state_dict_metadata.items():
        items = sorted(where.get(fqn, []))
        files = tuple(sorted({_join(part, rel) for _, rel, _, _ in items}))
        known = items and all(crc is not None for *_, crc in items)
        checksums = tuple((str(list(off)), str(crc)) for off, _, _, crc in items) if known \
            else None
        if isinstance(meta, TensorStorageMetadata):
            dtype = meta.properties.dtype
            numel = 1
            for d in meta.size:
                numel *= d
            out.append(Entry(fqn, part, "dcp", str(dtype).removeprefix("torch."),
                             tuple(meta.size), numel * dtype.itemsize, len(meta.chunks), files,
                             checksums))
        else:
            out.append(Entry(fqn, part, "dcp-bytes", None, None,
                             sum(n for _, _, n, _ in items), len(items), files, checksums))
    return out


def _safetensors_entries(ckpt: Checkpoint, path: str, crcs: Any) -> list[Entry]:
    """The tensors of safetensors file ``path``, from its header."""
    part = posixpath.dirname(path)
    header = read_header(ckpt, path)
    out = []
    for name, span in header.tensors.items():
        crc = crcs.get(path, span.start) if crcs is not None else None
        out.append(Entry(name, part, "safetensors", DTYPES[span.dtype][0],
                         span.shape, span.nbytes, 1, (path,),
                         None if crc is None else (("", crc),)))
    return out


def _index_problems(ckpt: Checkpoint, entries: Sequence[Entry]) -> list[str]:
    """What an export's shard index names that its files do not hold."""
    problems = []
    for index in (p for p in ckpt.files if p.endswith(SAFETENSORS + INDEX_SUFFIX)):
        part = posixpath.dirname(index)
        try:
            weight_map = json.loads(ckpt.read(index))["weight_map"]
            pairs = [(str(k), _join(part, str(v))) for k, v in weight_map.items()]
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            problems.append(f"{index} is not a shard index ({exc!r})")
            continue
        held = {(e.name, e.files[0]) for e in entries
                if e.format == "safetensors" and e.part == part}
        lost = [f"{name} ({file})" for name, file in pairs if (name, file) not in held]
        if lost:
            problems.append(f"{index} names {len(lost)} tensor(s) its files do not hold: "
                            f"{', '.join(lost[:5])}{' ...' if len(lost) > 5 else ''}")
    return problems
