"""Read some tensors of an HF export in a bucket without downloading the rest.

A safetensors file is an 8-byte header length, a JSON header naming each tensor's
dtype, shape and byte range, then the raw bytes. :func:`read_header` fetches the
header alone (one ranged read, a second only for a header over
:data:`HEADER_PROBE`); :class:`ExportReader`, like ``safetensors.safe_open`` over a
whole export, then reads exactly the byte ranges of the tensors asked for.

Reading headers needs no torch, so ``cloudckpt inspect`` of an export stays quick.
When the export's manifest holds a CRC32C per tensor (``tensor_crcs``, written by
:func:`cloudckpt.hf.export`), every tensor read is checked against it; an export
written by another tool has only per-file checksums, which a ranged read cannot
check, so its tensors are checked for shape and size only.
"""

from __future__ import annotations

import fnmatch
import json
import struct
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cloudckpt.core.checkpoint import Checkpoint, open_checkpoint
from cloudckpt.errors import CheckpointNotFoundError, ConfigError, CorruptCheckpointError
from cloudckpt.util.crc import crc32c_hex

if TYPE_CHECKING:
    import torch

__all__ = ["HEADER_PROBE", "ExportReader", "SafetensorsHeader", "TensorSpan", "load_tensors",
           "open_export", "read_header"]

#: Bytes read from the start of a safetensors file to find its header: the header of a
#: shard of a few hundred tensors fits, so one request usually suffices.
HEADER_PROBE = 64 * 1024
#: A header larger than this is refused as corrupt (safetensors' own limit is 100 MB).
HEADER_MAX = 100 * 1000 * 1000
#: Each safetensors dtype code: torch's name for it and the bytes of one element.
DTYPES = {"F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2),
          "BF16": ("bfloat16", 2), "I64": ("int64", 8), "I32": ("int32", 4),
          "I16": ("int16", 2), "I8": ("int8", 1), "U8": ("uint8", 1), "BOOL": ("bool", 1),
          "U16": ("uint16", 2), "U32": ("uint32", 4), "U64": ("uint64", 8),
          "F8_E4M3": ("float8_e4m3fn", 1), "F8_E5M2": ("float8_e5m2", 1),
          "C64": ("complex64", 8)}
INDEX_SUFFIX = ".index.json"
#: Manifest metadata key of the per-tensor checksums (packed as DCP item checksums are).
TENSOR_CRCS = "tensor_crcs"


@dataclass(frozen=True)
class TensorSpan:
    """One tensor of a safetensors file: dtype code, shape and absolute byte range."""

    name: str
    file: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class SafetensorsHeader:
    """A safetensors file's header: its tensors (name -> span) and ``__metadata__``."""

    file: str
    size: int
    tensors: Mapping[str, TensorSpan]
    metadata: Mapping[str, str]

    @property
    def header_bytes(self) -> int:
        """Bytes before the first tensor: the length prefix and the JSON header."""
        return min((s.start for s in self.tensors.values()), default=self.size)


def _corrupt(ckpt: Checkpoint, path: str, why: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{path} of {ckpt.uri} is not a valid safetensors file: "
                                  f"{why}. Export the model again", {path: why})


def read_header(ckpt: Checkpoint, path: str) -> SafetensorsHeader:
    """The header of safetensors file ``path`` of ``ckpt``, from ranged reads of its head."""
    size = ckpt.entry(path).size
    if size < 8:
        raise _corrupt(ckpt, path, f"{size} bytes, shorter than the length prefix")
    head = ckpt.read_range(path, 0, min(size, HEADER_PROBE))
    (length,) = struct.unpack("<Q", head[:8])
    if length > HEADER_MAX or 8 + length > size:
        raise _corrupt(ckpt, path, f"a header of {length} bytes in a file of {size}")
    raw = head[8:8 + length]
    if len(raw) < length:
        raw += ckpt.read_range(path, len(head), 8 + length)
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise _corrupt(ckpt, path, f"its header is not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise _corrupt(ckpt, path, "its header is not a JSON object")
    base = 8 + length
    meta = doc.pop("__metadata__", None) or {}
    tensors = {name: _span(ckpt, path, name, info, base, size) for name, info in doc.items()}
    return SafetensorsHeader(path, size, tensors, meta if isinstance(meta, dict) else {})


def _span(ckpt: Checkpoint, path: str, name: str, info: Any, base: int, size: int
          ) -> TensorSpan:
    """One header entry, checked: a known dtype and a byte range that holds its shape."""
    try:
        dtype, shape = info["dtype"], tuple(int(d) for d in info["shape"])
        begin, end = (int(x) for x in info["data_offsets"])
    except (TypeError, KeyError, ValueError) as exc:
        raise _corrupt(ckpt, path, f"tensor {name!r} has a malformed entry ({exc!r})") from None
    if dtype not in DTYPES:
        raise _corrupt(ckpt, path, f"tensor {name!r} has unknown dtype {dtype!r}")
    numel = 1
    for d in shape:
        numel *= d
    if not 0 <= begin <= end or base + end > size or end - begin != numel * DTYPES[dtype][1]:
        raise _corrupt(ckpt, path, f"tensor {name!r} has bytes [{begin}, {end}) that do not "
                       f"hold {dtype}{list(shape)} inside the file")
    return TensorSpan(name, path, dtype, shape, base + begin, base + end)


def safetensors_files(ckpt: Checkpoint) -> list[str]:
    """The safetensors files of ``ckpt`` at its top level (an export's weights)."""
    return sorted(p for p in ckpt.files if "/" not in p and p.endswith(".safetensors"))


class ExportReader:
    """Tensors of an HF export read on demand, like ``safetensors.safe_open``: only the
    headers are read when it opens, and only the requested tensors' bytes after."""

    def __init__(self, ckpt: Checkpoint, files: Iterable[str] | None = None) -> None:
        self.checkpoint = ckpt
        names = list(files) if files is not None else safetensors_files(ckpt)
        if not names:
            raise ConfigError(f"{ckpt.uri} holds no safetensors files: not an HF export")
        headers = ckpt.store.map(lambda p: read_header(ckpt, p), names)
        self.headers = dict(zip(names, headers, strict=True))
        self._spans = {name: span for h in headers for name, span in h.tensors.items()}
        self._crcs: Any = None  # unpacked on the first read (it needs torch's DCP module)

    def __enter__(self) -> ExportReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def keys(self) -> list[str]:
        return sorted(self._spans)

    def __contains__(self, name: object) -> bool:
        return name in self._spans

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def span(self, name: str) -> TensorSpan:
        try:
            return self._spans[name]
        except KeyError:
            near = [k for k in self.keys() if name.split(".")[-1] in k][:5]
            raise CheckpointNotFoundError(
                f"{self.checkpoint.uri} has no tensor {name!r}"
                + (f"; similar names: {', '.join(near)}" if near else
                   f" ({len(self._spans)} tensors; `cloudckpt inspect` lists them)")) from None

    def select(self, patterns: Iterable[str]) -> list[str]:
        """The tensor names matching any of the glob ``patterns`` (an exact name is one)."""
        pats = list(patterns)
        return [k for k in self.keys() if any(fnmatch.fnmatchcase(k, p) for p in pats)]

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.get_tensors([name])[name]

    def get_tensors(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The named tensors, read straight into their memory by parallel ranged reads
        of at most ``part_size`` each, and checked."""
        import torch

        spans = [self.span(n) for n in names]
        out = {s.name: torch.empty(s.shape, dtype=_torch_dtype(s)) for s in spans}
        store = self.checkpoint.store
        piece = max(store.part_size, 1 << 20)
        jobs = [(s, a, min(a + piece, s.end)) for s in spans
                for a in range(s.start, s.end, piece)]

        def read(job: tuple[TensorSpan, int, int]) -> None:
            span, a, b = job
            view = _bytes_of(out[span.name])

            def sink(offset: int, data: bytes) -> None:
                view[offset - span.start:offset - span.start + len(data)] = data

            with self.checkpoint.reading(span.file):
                store.read_range_to(span.file, a, b, sink)

        store.map(read, jobs)
        for span in spans:
            self._check(span, _bytes_of(out[span.name]))
        return out

    def _check(self, span: TensorSpan, data: memoryview) -> None:
        if self._crcs is None:
            self._crcs = tensor_checksums(self.checkpoint) or False
        expected = self._crcs.get(span.file, span.start) if self._crcs else None
        if expected is None:
            return
        actual = crc32c_hex(data)
        if actual != expected:
            raise CorruptCheckpointError(
                f"tensor {span.name} in {span.file} of {self.checkpoint.uri} is corrupt: its "
                f"CRC32C is {actual}, the manifest says {expected}. Restore the export from "
                "a copy or export it again", {span.file: f"tensor {span.name}"})


def tensor_checksums(ckpt: Checkpoint) -> Any:
    """The export's per-tensor CRC32C (an ``ItemCrcs``, keyed by file and the tensor's
    first byte), or ``None`` for an export written without them."""
    packed = ckpt.metadata.get(TENSOR_CRCS)
    if not packed:
        return None
    from cloudckpt.dcp.metadata import ItemCrcs

    return ItemCrcs({"item_crcs": packed})


def _torch_dtype(span: TensorSpan) -> torch.dtype:
    import torch

    dtype = getattr(torch, DTYPES[span.dtype][0], None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"tensor {span.name} has dtype {span.dtype}, which this torch "
                          "cannot hold")
    return dtype


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory."""
    import torch

    return memoryview(t.view(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(  # type: ignore[arg-type]  # numpy's stubs: a buffer from 3.12
        bytearray())


def open_export(uri: str | Checkpoint, storage_options: Mapping[str, Any] | None = None
                ) -> ExportReader:
    """An :class:`ExportReader` over the committed HF export at ``uri``."""
    ckpt = uri if isinstance(uri, Checkpoint) else open_checkpoint(uri, storage_options)
    return ExportReader(ckpt)


def load_tensors(uri: str | Checkpoint, names: Iterable[str],
                 storage_options: Mapping[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """The tensors ``names`` (exact names or glob patterns) of the HF export at ``uri``,
    reading only their bytes and the headers of the files holding them (all the files'
    for a glob, or for an export without a shard index). A name that matches nothing
    raises :class:`~cloudckpt.errors.CheckpointNotFoundError`."""
    ckpt = uri if isinstance(uri, Checkpoint) else open_checkpoint(uri, storage_options)
    names = list(names)
    reader = ExportReader(ckpt, _files_holding(ckpt, names))
    wanted: list[str] = []
    for name in names:
        found = reader.select([name]) if _is_glob(name) else [name]
        if not found:
            raise CheckpointNotFoundError(f"no tensor of {ckpt.uri} matches {name!r}")
        wanted += [n for n in found if n not in wanted]
    return reader.get_tensors(wanted)


def _is_glob(name: str) -> bool:
    return any(c in name for c in "*?[")


def _files_holding(ckpt: Checkpoint, names: list[str]) -> list[str] | None:
    """The shards the export's index says hold ``names`` (exact names, all in the index),
    or None: every shard's header is needed."""
    index = next((p for p in ckpt.files if "/" not in p and p.endswith(
        ".safetensors" + INDEX_SUFFIX)), None)
    if index is None or any(_is_glob(n) for n in names):
        return None
    try:
        weight_map = json.loads(ckpt.read(index))["weight_map"]
        files = sorted({str(weight_map[n]) for n in names})
    except (ValueError, KeyError, TypeError):
        return None  # a name the index lacks: the full reader says what there is
    return files if all(f in ckpt.manifest.files for f in files) else None
