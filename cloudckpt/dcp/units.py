"""How a rank's DCP items become files, and files blobs.

Items are spread over files of about a target size (:func:`split_by_size`). An
incremental save gives each tensor of at least :data:`OWN_FILE_BYTES` a file of
its own (:func:`own_files`), so a tensor that did not change (a frozen base, a
reference model) is a file whose bytes are already in the blob area: its digest
is computed (a pass over the bytes, nothing sent) and the file is referenced.
"""

from __future__ import annotations

import hashlib
import io
import logging
import mmap
from collections.abc import Iterable, Sequence
from contextlib import closing
from dataclasses import dataclass
from threading import Lock
from typing import Any, cast

import numpy as np
import torch
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from cloudckpt.compat.torch_private import StorageInfo, element_size
from cloudckpt.core.blobs import BlobArea, Holding
from cloudckpt.dcp.devicecopy import Copier
from cloudckpt.errors import CorruptCheckpointError
from cloudckpt.serialization.torchsave import save_item, save_item_unread
from cloudckpt.storage import Store
from cloudckpt.util.crc import Crc32c, crc32c_value

log = logging.getLogger(__name__)

#: In an incremental save, a tensor of at least this many bytes is a file of its own.
OWN_FILE_BYTES = 1 << 20


@dataclass
class ItemInfo(StorageInfo):
    """Where an item went, plus what the coordinator needs for the manifest.

    Travels from each rank to the coordinator inside WriteResults; the
    coordinator writes plain ``StorageInfo`` into ``.metadata``.
    """

    crc32c: str | None = None
    file_size: int | None = None
    file_crc32c: str | None = None
    #: Saved incrementally: the file's blob, and whether this save sent it.
    blob: str | None = None
    sent: bool = True


class Sink:
    """Write-only stream that tracks position and a CRC32C per item. ``out`` is an
    :class:`~cloudckpt.storage.ObjectWriter` or anything with its ``write(data,
    crc32c=None)``: a large write comes with its CRC32C, computed once for both.

    ``torch.save`` hands over each item as about 40 writes, all but one a few bytes
    (zip headers, the pickle); they are gathered and passed on as one, so the
    stream beneath (checksum, window, parts) is called a few times per item, not
    forty. ``item_crc`` passes on what is gathered: an item ends on a boundary.

    The one large write is the tensor's storage, from its own memory: when the item
    is a tensor of the state itself (``start_item(tensor)``), a stream that can
    send borrowed bytes (``lend``) gets a view of the tensor, which keeps it alive,
    and sends it without a copy (torch's own view is valid only during the call).

    A GPU tensor's bytes come through host buffers instead (:meth:`stream_tensor`):
    ``torch.save`` writes a stand-in of its shape over untouched memory, and in
    place of the stand-in's bytes the stream gets the tensor's, chunk by chunk,
    each checksummed and written while the next is being copied from the device.
    """

    SMALL = 64 << 10

    def __init__(self, out: Any) -> None:
        self._out = out
        self._lend = getattr(out, "lend", None)
        self.pos = 0
        self._crc = Crc32c()
        self._small = bytearray()
        self._tensor: torch.Tensor | None = None
        #: While a tensor is streamed: the stand-in's address and size, the tensor,
        #: and how its bytes come (None once they have been written).
        self._stand_in: tuple[int, int, torch.Tensor, Copier] | None = None

    def start_item(self, tensor: torch.Tensor | None = None) -> int:
        """An item begins; ``tensor``: its bytes may be lent to the stream."""
        self._crc = Crc32c()
        self._tensor = tensor if self._lend is not None else None
        return self.pos

    def item_crc(self) -> str:
        self._pass_small()
        return self._crc.hexdigest()

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n = view.nbytes
        self.pos += n
        if n < self.SMALL:
            self._small += view  # copied: torch's buffer is only valid during the call
            if len(self._small) >= self.SMALL:
                self._pass_small()
        else:
            self._pass_small()
            if self._stand_in is not None and self._is_stand_in(view):
                self._stream_chunks()
                return n
            own = self._tensor_bytes(view)
            # One pass over the bytes: the stream beneath combines this CRC into the
            # file's rather than computing its own (3.5 ms per 16 MiB, GIL held).
            crc = crc32c_value(view)
            self._crc.append(crc, n)
            if own is None:
                self._out.write(view, crc)
            else:
                assert self._lend is not None  # own bytes only where the stream lends
                self._lend(own, crc)
        return n

    def stream_tensor(self, tensor: torch.Tensor, copier: Copier) -> bool:
        """Write ``tensor`` (an item, of at least :data:`SMALL` bytes) in ``torch.save``'s
        format, its bytes through ``copier``; False, nothing written, where torch's
        writer would read the stand-in's bytes (the caller saves a host copy then)."""
        nbytes = tensor.numel() * tensor.element_size()
        anon = mmap.mmap(-1, nbytes)  # never touched: no memory behind it
        stand_in = torch.frombuffer(anon, dtype=torch.uint8).view(tensor.dtype) \
            .view(tensor.shape)
        self._stand_in = (stand_in.data_ptr(), nbytes, tensor, copier)
        try:
            written = save_item_unread(stand_in, self)  # type: ignore[arg-type]  # torch.save needs only write()
        finally:
            left, self._stand_in = self._stand_in, None
        if written and left is not None:
            raise RuntimeError(
                f"torch.save did not write the bytes of a {tuple(tensor.shape)} "
                f"{tensor.dtype} tensor in one piece, so they could not be streamed from "
                f"{tensor.device}; nothing was committed. Report this with your torch version.")
        return written

    def _is_stand_in(self, view: memoryview) -> bool:
        assert self._stand_in is not None
        address, nbytes = self._stand_in[:2]
        return view.nbytes == nbytes and np.frombuffer(view, np.uint8).ctypes.data == address

    def _stream_chunks(self) -> None:
        assert self._stand_in is not None
        tensor, copier = self._stand_in[2:]
        self._stand_in = None
        # Closed here when a write fails: the buffers go back now, not when the
        # traceback that holds this frame is freed.
        with closing(copier.chunks(tensor)) as chunks:
            for chunk in chunks:
                crc = crc32c_value(chunk)
                self._crc.append(crc, chunk.nbytes)
                self._out.write(chunk, crc)  # copied into the upload's parts

    def _tensor_bytes(self, view: memoryview) -> memoryview | None:
        """The item's tensor's own bytes if ``view`` is exactly them, else None."""
        t = self._tensor
        if t is None or view.nbytes != t.numel() * t.element_size() or \
                np.frombuffer(view, np.uint8).ctypes.data != t.data_ptr():
            return None
        return memoryview(t.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]  # numpy's stubs: a buffer from 3.12

    def _pass_small(self) -> None:
        if self._small:
            small, self._small = self._small, bytearray()
            self._pass(small)

    def _pass(self, data: Any) -> None:
        self._out.write(data)
        self._crc.update(data)

    def flush(self) -> None:
        pass


def cpu_compact(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor that owns exactly its bytes (``torch.save`` writes whole storages),
    a conjugate or negative view's values among them (not the bytes it views)."""
    t = tensor.detach().resolve_conj().resolve_neg()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size() or not t.is_contiguous():
        t = t.clone(memory_format=torch.contiguous_format)
    return t


def item_bytes(item: WriteItem) -> int:
    if item.tensor_data is None:
        return 1024
    n = 1
    for s in item.tensor_data.size:
        n *= s
    return n * element_size(item.tensor_data.properties.dtype)


def split_by_size(items: Sequence[WriteItem], file_size: int,
                   max_files: int) -> list[list[WriteItem]]:
    """Spread items over files of about ``file_size`` bytes (largest first, to the emptiest)."""
    total = sum(item_bytes(i) for i in items)
    n = max(1, min(max_files, len(items), -(-total // file_size)))
    buckets: list[list[WriteItem]] = [[] for _ in range(n)]
    sizes = [0] * n
    for item in sorted(items, key=item_bytes, reverse=True):
        k = sizes.index(min(sizes))
        buckets[k].append(item)
        sizes[k] += item_bytes(item)
    return buckets


class _Digest:
    """A write-only stream that only hashes: the first pass over a file's bytes."""

    def __init__(self) -> None:
        self.sha = hashlib.sha256()
        self.crc = Crc32c()

    def write(self, data: Any, crc32c: int | None = None) -> int:
        view = memoryview(data).cast("B")
        self.sha.update(view)
        self.crc.add(view, crc32c)
        return view.nbytes


def serialize(items: Sequence[WriteItem], planner: SavePlanner, out: Any,
              copier: Copier | None = None) -> list[tuple[WriteItem, int, int, str]]:
    """Write ``items`` to the stream ``out`` as DCP's file format has them (raw bytes
    for a byte item, ``torch.save``'s format for a tensor: see
    :mod:`cloudckpt.serialization.torchsave`); each item's offset, length, CRC32C.
    A GPU tensor's bytes come in chunks through ``copier``'s pinned buffers (None: a
    :class:`Copier` of the process's shared pool), not as one host copy."""
    placed: list[tuple[WriteItem, int, int, str]] = []
    sink = Sink(out)
    copier = copier or Copier()
    for item in items:
        data = planner.resolve_data(item)
        if item.type == WriteItemType.BYTE_IO:
            start = sink.start_item()
            sink.write(cast(io.BytesIO, data).getbuffer())
        elif _streamed(cast(torch.Tensor, data), copier):
            start = sink.start_item()
            if not sink.stream_tensor(cast(torch.Tensor, data), copier):
                save_item(cpu_compact(cast(torch.Tensor, data)), sink)  # type: ignore[arg-type]  # torch.save needs only write()
        else:
            data = cast(torch.Tensor, data)
            tensor = cpu_compact(data)
            # Lent only when it is the state's own memory: a copy made here (from a
            # GPU, or compacted) would be held until its upload, outside the window.
            start = sink.start_item(tensor if tensor.data_ptr() == data.data_ptr() and
                                    data.device.type == "cpu" else None)
            save_item(tensor, sink)  # type: ignore[arg-type]  # torch.save needs only write()
        placed.append((item, start, sink.pos - start, sink.item_crc()))
    return placed


def _streamed(tensor: torch.Tensor, copier: Copier) -> bool:
    """Whether a tensor item's bytes go through ``copier`` (a small one is copied whole:
    its bytes would be gathered with the zip's headers, see :class:`Sink`)."""
    return copier.wants(tensor) and tensor.numel() * tensor.element_size() >= Sink.SMALL


def own_files(items: Sequence[WriteItem], file_size: int, max_files: int
              ) -> list[list[WriteItem]]:
    """Files for an incremental save: each large tensor alone, the rest spread (in the
    planner's order, so that unchanged small items make the same file again)."""
    big = [[i] for i in items if i.type != WriteItemType.BYTE_IO
           and item_bytes(i) >= OWN_FILE_BYTES]
    rest = [i for i in items if [i] not in big]
    return big + split_by_size(rest, file_size, max_files)


class BlobFiles:
    """One rank's files of an incremental save, each a blob of ``area``."""

    def __init__(self, area: BlobArea, store: Store, planner: SavePlanner,
                 copier: Copier | None = None) -> None:
        self.area = area
        self.planner = planner
        self.copier = copier
        self.holding: Holding = area.holding(area.top_of(store))
        self._files: dict[str, tuple[Sequence[WriteItem], int, str]] = {}
        self._lock = Lock()

    def write(self, name: str, items: Sequence[WriteItem]) -> list[WriteResult]:
        digest = _Digest()
        placed = serialize(items, self.planner, digest, self.copier)
        blob, size, crc = digest.sha.hexdigest(), digest.crc.size, digest.crc.hexdigest()
        with self._lock:
            self._files[blob] = (items, size, crc)
        there = self.area.store.info(blob)
        sent = there is None or there.size != size
        if sent:
            self._send(blob)
        return [WriteResult(index=item.index, size_in_bytes=length,
                            storage_data=ItemInfo(name, offset, length, None, item_crc, size,
                                                  crc, blob, sent))
                for item, offset, length, item_crc in placed]

    def _send(self, blob: str) -> None:
        items, size, crc = self._files[blob]
        with self.area.store.open_write(blob) as out:
            serialize(items, self.planner, out, self.copier)
        info = out.info
        assert info is not None
        if (info.size, info.crc32c) != (size, crc):
            self.area.store.delete([blob])  # its name no longer says what it holds
            raise CorruptCheckpointError(
                f"a tensor changed while it was saved to {self.area.store.key_uri(blob)} "
                "(its bytes differ between the digest and the upload); nothing was "
                "committed. Do not change the state during a save.", {blob: "changed"})

    def settle(self) -> None:
        """Hold every blob this rank relies on; send again any a sweep took meanwhile."""
        with self._lock:
            blobs = list(self._files)
        self.holding.settle(blobs, self._send)


def sent_figures(files: Iterable[tuple[int, str, str | None, bool]]) -> dict[str, int]:
    """What an incremental save sent and what it referenced, in files and bytes."""
    files = list(files)
    sent = [f for f in files if f[3]]
    return {"files": len(files), "bytes": sum(f[0] for f in files),
            "sent_files": len(sent), "sent_bytes": sum(f[0] for f in sent)}
