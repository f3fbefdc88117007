"""Where a tensor's bytes lie inside a ``torch.save`` record, read from its head.

A DCP tensor item is one ``torch.save`` archive (an uncompressed zip): a small
pickle naming the storage, dtype, shape and strides, a few tiny records, the
storage's raw bytes, then the zip's directory. Knowing where the raw bytes
start lets a reader fetch them straight into the destination tensor instead of
into a buffer that ``torch.load`` then copies. :func:`locate` finds that from
the first few KiB of the item, without unpickling anything but plain values:
the pickle's globals resolve to stand-ins here, never to real code.
"""

from __future__ import annotations

import io
import math
import pickle
import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from cloudckpt.compat import torch_private

#: Bytes of an item fetched to find its tensor: enough for the pickle and the
#: records before the data (about 700 bytes from torch.save of one tensor).
HEAD_BYTES = 4096

_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")
_LOCAL_SIGNATURE = 0x04034B50

# The storage classes torch.save names for each dtype (``torch.FloatStorage``, ...).
_STORAGE_DTYPES = {
    "DoubleStorage": torch.float64, "FloatStorage": torch.float32,
    "HalfStorage": torch.float16, "BFloat16Storage": torch.bfloat16,
    "LongStorage": torch.int64, "IntStorage": torch.int32, "ShortStorage": torch.int16,
    "CharStorage": torch.int8, "ByteStorage": torch.uint8, "BoolStorage": torch.bool,
    "ComplexFloatStorage": torch.complex64, "ComplexDoubleStorage": torch.complex128,
}


@dataclass(frozen=True)
class SavedTensor:
    """A tensor inside a ``torch.save`` record: ``nbytes`` raw bytes at ``data_start``
    (relative to the item), a C-contiguous ``shape`` of ``dtype``, little-endian."""

    data_start: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def rows(self) -> int:
        """Rows along the first dimension (a 0-d tensor is one row)."""
        return self.shape[0] if self.shape else 1

    @property
    def row_bytes(self) -> int:
        return self.nbytes // max(1, self.rows)

    def rows_within(self, budget: int) -> int:
        """How many whole rows fit in ``budget`` bytes (at least one)."""
        return max(1, budget // self.row_bytes) if self.row_bytes else max(self.rows, 1)


class _Unsupported(Exception):
    """Something :func:`locate` does not handle; the caller falls back to ``torch.load``."""


@dataclass(frozen=True)
class _Storage:
    key: str
    dtype: torch.dtype | None  # None: an untyped storage (the dtype comes with the tensor)
    numel: int


@dataclass(frozen=True)
class _Tensor:
    storage: _Storage
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


def _rebuild_v2(storage: _Storage, offset: int, size: Any, stride: Any, *_: Any) -> _Tensor:
    if storage.dtype is None:
        raise _Unsupported("untyped storage without a dtype")
    return _Tensor(storage, int(offset), tuple(size), tuple(stride), storage.dtype)


def _rebuild_v3(storage: _Storage, offset: int, size: Any, stride: Any, requires_grad: Any,
                hooks: Any, dtype: Any, *_: Any) -> _Tensor:
    if not isinstance(dtype, torch.dtype):
        raise _Unsupported(f"dtype {dtype!r}")
    return _Tensor(storage, int(offset), tuple(size), tuple(stride), dtype)


class _StorageType:
    def __init__(self, dtype: torch.dtype | None) -> None:
        self.dtype = dtype


class _Describe(pickle.Unpickler):
    """Reads a tensor pickle into a :class:`_Tensor`; every global it may name is a
    stand-in, anything else is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == torch_private.REBUILD_TENSOR_V2:
            return _rebuild_v2
        if (module, name) == torch_private.REBUILD_TENSOR_V3:
            return _rebuild_v3
        if module == "collections" and name == "OrderedDict":
            return OrderedDict
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageType(_STORAGE_DTYPES[name])
        if module in ("torch", "torch.storage") and name == "UntypedStorage":
            return _StorageType(None)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _Unsupported(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> _Storage:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], _StorageType)):
            raise _Unsupported(f"persistent id {pid!r}")
        _, kind, key, _location, numel = pid
        return _Storage(str(key), kind.dtype, int(numel))


def _records(head: bytes) -> dict[str, tuple[int, int]]:
    """Name -> (header offset, data offset) of the zip's local headers found in
    ``head``, walking from the first (torch.save writes sizes only after the data,
    so each next header is found by its name in the directory-less stream)."""
    out: dict[str, tuple[int, int]] = {}
    pos = 0
    while pos + _LOCAL_HEADER.size <= len(head):
        (sig, _ver, _flags, method, _t, _d, _crc, _cs, _us, name_len,
         extra_len) = _LOCAL_HEADER.unpack_from(head, pos)
        if sig != _LOCAL_SIGNATURE or method != 0:
            break
        name_end = pos + _LOCAL_HEADER.size + name_len
        if name_end > len(head):
            break
        name = head[pos + _LOCAL_HEADER.size:name_end].decode("utf-8", "replace")
        out[name] = (pos, name_end + extra_len)
        nxt = head.find(b"PK\x03\x04", name_end + extra_len)
        if nxt < 0:
            break
        pos = nxt
    return out


def locate(head: memoryview | bytes, item_length: int) -> SavedTensor:
    """Where the tensor of a ``torch.save`` item lies, from its first bytes.

    Raises :class:`_Unsupported` (via :func:`try_locate`) for anything but one
    C-contiguous, little-endian tensor that owns exactly its storage (what
    cloudckpt's writer and DCP's default planner write).
    """
    # One copy of at most HEAD_BYTES, whatever the caller holds (a whole item, a
    # network piece): the pickle and the records before the data lie within it.
    view = memoryview(head)
    head = bytes((view.cast("B") if view.format != "B" else view)[:HEAD_BYTES])
    records = _records(head)
    first = next(iter(records), "")
    if not first.endswith("data.pkl"):
        raise _Unsupported("no data.pkl record first")
    prefix = first[: -len("data.pkl")]
    pkl_at = records[first][1]
    stream = io.BytesIO(head)
    stream.seek(pkl_at)
    described = _Describe(stream).load()
    if not isinstance(described, _Tensor):
        raise _Unsupported(f"a {type(described).__name__}, not a tensor")
    order = records.get(f"{prefix}byteorder")
    if order is not None and bytes(head[order[1]:order[1] + 6]) != b"little":
        raise _Unsupported("not little-endian")
    data = records.get(f"{prefix}data/{described.storage.key}")
    if data is None:
        raise _Unsupported("the storage record is not in the head")
    t = described
    storage_bytes = t.storage.numel * (t.storage.dtype.itemsize if t.storage.dtype else 1)
    found = SavedTensor(data[1], t.dtype, t.shape)
    if found.data_start > len(head):  # a head read stops at HEAD_BYTES
        raise _Unsupported("the tensor's bytes start past the head")
    if (t.offset != 0 or t.stride != _contiguous_strides(t.shape)
            or storage_bytes != found.nbytes or found.data_start + found.nbytes > item_length):
        raise _Unsupported("not a compact C-contiguous tensor")
    return found


def try_locate(head: memoryview | bytes, item_length: int) -> SavedTensor | None:
    """:func:`locate`, or None where the item is something else (read it whole)."""
    try:
        return locate(head, item_length)
    except (_Unsupported, pickle.UnpicklingError, EOFError, ValueError, TypeError,
            struct.error, IndexError, AttributeError):
        return None


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, n = [], 1
    for s in reversed(shape):
        strides.append(n)
        n *= max(s, 1)
    return tuple(reversed(strides))
