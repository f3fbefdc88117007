"""Checked bytes into their destination tensors.

A saved tensor whose record is plain (:mod:`cloudckpt.serialization.records`) is
copied, or read, straight into the destination's memory, or converted into it a
few rows at a time through a read-window buffer; any other record is loaded with
``weights_only``, and byte items are refused unless ``weights_only`` accepts them.
"""

from __future__ import annotations

import io
from typing import Any

import torch

from cloudckpt.dcp.readplan import RequestedItem
from cloudckpt.errors import CorruptCheckpointError
from cloudckpt.serialization.records import HEAD_BYTES, SavedTensor, try_locate
from cloudckpt.serialization.torchload import safe_torch_load
from cloudckpt.storage.transfer.window import ByteWindow
from cloudckpt.util.crc import Crc32c


def deliver(item: RequestedItem, buf: Any, at: int, uri: str) -> None:
    """Copy a checked item whose bytes lie in ``buf`` from ``at`` into its destination:
    from the bytes where its tensor is one plain record, else through ``torch.load``."""
    assert item.target is not None
    data = memoryview(buf)[at:at + item.info.length]
    saved = try_locate(data, item.info.length)
    if saved is None:  # another layout: torch.load it (weights only)
        src = safe_torch_load(_BufferReader(data), f"{uri} item {item.fqn}")
        if not isinstance(src, torch.Tensor):
            raise CorruptCheckpointError(
                f"{uri} item {item.fqn} holds a {type(src).__name__}, not a tensor",
                {item.fqn: "not a tensor"})
    else:
        src = _tensor_over(buf, at + saved.data_start, saved.nbytes, saved, saved.rows)
    data.release()
    _place(src, 0, item)


def goes_straight(item: RequestedItem, saved: SavedTensor) -> bool:
    """Whether the item's bytes can go straight into its destination's memory."""
    target, req = item.target, item.req
    return (target is not None and target.device.type == "cpu" and item.to_device is None
            and target.dtype == saved.dtype
            and target.is_contiguous() and tuple(req.lengths) == saved.shape
            and saved.nbytes > 0)


class RowBuffer:
    """A window buffer of whole rows of a saved tensor, placed (converted) into the
    destination when full: rows ``first_row``... for up to ``rows`` rows."""

    def __init__(self, item: RequestedItem, window: ByteWindow, rows: int, *, first_row: int = 0
                 ) -> None:
        assert item.saved is not None
        self.item, self.saved, self._window = item, item.saved, window
        self.row_bytes = self.saved.row_bytes
        self.rows, self.first_row, self.fill = rows, first_row, 0
        self.size = rows * self.row_bytes
        self._held = window.acquire(self.size)
        self.buffer: Any = window.mapping(self.size) if self.size else bytearray()

    def put(self, data: memoryview) -> None:
        """Append the next bytes of the tensor (in order)."""
        while data.nbytes:
            n = min(self.size - self.fill, data.nbytes)
            self.buffer[self.fill:self.fill + n] = data[:n]
            data = data[n:]
            self.filled(self.fill + n)

    def filled(self, n: int) -> None:
        """``n`` bytes of the buffer are in: place the rows once it is full."""
        self.fill = n
        if n == self.size:
            self.flush()

    def flush(self) -> None:
        if self.fill:
            rows = self.fill // self.row_bytes
            assert self.item.target is not None  # rows of a saved tensor go to a tensor
            _place(_tensor_over(self.buffer, 0, self.fill, self.saved, rows), self.first_row,
                   self.item)
            self.first_row += rows
            self.fill = 0

    def close(self) -> None:
        self._window.release(self._held, keep=self.buffer if self.size else None)
        self._held = 0


class NotStraight(Exception):
    """An item taken on the event loop whose bytes do not go straight into their
    destination: read it again off the loop (converting may wait for window bytes)."""


class ItemStream:
    """Takes a whole item's bytes in order (one request): finds its tensor in the
    first few KiB, then puts every byte where it goes, checksumming all of it.
    ``on_loop``: it runs where the bytes arrive, so it must never wait: an item that
    does not go straight into its destination raises :class:`NotStraight`."""

    def __init__(self, item: RequestedItem, window: ByteWindow, row_budget: int, *,
                 on_loop: bool = False) -> None:
        self.item, self._window, self._row_budget = item, window, row_budget
        self._on_loop = on_loop
        self.crc = Crc32c()
        self._pending: list[tuple[int, memoryview]] | None = []
        self._got = 0
        self._saved: SavedTensor | None = None
        self._dest: memoryview | None = None
        self._rows: RowBuffer | None = None
        self._whole: Any = None
        self._held = 0

    def __call__(self, offset: int, data: bytes) -> None:
        view, rel = memoryview(data), offset - self.item.info.offset
        self.crc.update(view)
        if self._pending is None:
            self._put(rel, view)
            return
        self._pending.append((rel, view))
        self._got += view.nbytes
        if self._got >= min(HEAD_BYTES, self.item.info.length):
            self._locate_pending()
        else:  # kept past this call, which is all a piece lasts: copied (a few KiB)
            self._pending[-1] = (rel, memoryview(bytes(view)))

    def space(self, offset: int, n: int) -> memoryview | None:
        """The destination's memory for the bytes from ``offset`` (up to ``n``), once
        located, where they are the tensor's: the client may receive them there."""
        if self._dest is None or self._saved is None:
            return None
        pos = offset - self.item.info.offset - self._saved.data_start
        if not 0 <= pos < self._saved.nbytes:
            return None
        return self._dest[pos:pos + min(n, self._saved.nbytes - pos)]

    def _locate_pending(self) -> None:
        """Find the tensor in the bytes held back so far, then put them where they go."""
        assert self._pending is not None
        pieces, self._pending = self._pending, None
        head = pieces[0][1] if len(pieces) == 1 else b"".join(v for _, v in pieces)
        self._choose(try_locate(head, self.item.info.length))
        for r, v in pieces:
            self._put(r, v)

    def _choose(self, saved: SavedTensor | None) -> None:
        if self._on_loop and (saved is None or not goes_straight(self.item, saved)):
            raise NotStraight(self.item.fqn)
        self._saved = self.item.saved = saved
        if saved is None:  # another layout: the whole item, torch.load'ed once checked
            self._held = self._window.acquire(self.item.info.length)
            self._whole = self._window.mapping(self.item.info.length)
        elif goes_straight(self.item, saved):
            assert self.item.target is not None
            self._dest = bytes_of(self.item.target)
        elif saved.nbytes:
            rows = min(saved.rows_within(self._row_budget), saved.rows)
            self._rows = RowBuffer(self.item, self._window, rows)

    def _put(self, rel: int, view: memoryview) -> None:
        if self._whole is not None:
            self._whole[rel:rel + view.nbytes] = view
            return
        saved = self._saved
        assert saved is not None
        a = max(rel, saved.data_start)
        b = min(rel + view.nbytes, saved.data_start + saved.nbytes)
        if a >= b:
            return
        piece, pos = view[a - rel:b - rel], a - saved.data_start
        if self._dest is not None:
            if piece.obj is not self._dest.obj:  # else received there (space)
                self._dest[pos:pos + piece.nbytes] = piece
            return
        assert self._rows is not None
        self._rows.put(piece)  # in order: the rows follow one another

    def finish(self, uri: str) -> None:
        """Check the item's CRC32C; then place what is still buffered."""
        if self._pending is not None:  # shorter than a head: nothing located yet
            self._locate_pending()
        if self.crc.hexdigest() != self.item.crc:
            raise self.item.corrupt(uri, self.crc.hexdigest())
        if self._whole is not None:
            deliver(self.item, self._whole, 0, uri)
        elif self._rows is not None:
            self._rows.flush()

    def close(self) -> None:
        if self._rows is not None:
            self._rows.close()
        if self._whole is not None:
            self._window.release(self._held, keep=self._whole)
            self._whole = None


def bytes_of(t: torch.Tensor) -> memoryview:
    """The memory of a contiguous CPU tensor, as writable bytes (any dtype)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]  # numpy's stubs: a buffer from 3.12


def _tensor_over(buf: Any, offset: int, nbytes: int, saved: SavedTensor,
                 rows: int) -> torch.Tensor:
    """``rows`` rows of the saved tensor, over ``nbytes`` of ``buf`` from ``offset``."""
    shape = (rows, *saved.shape[1:]) if saved.shape else ()
    if nbytes == 0:
        return torch.empty(shape, dtype=saved.dtype)
    flat = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=offset)
    return flat.view(saved.dtype).view(shape)


def _place(src: torch.Tensor, first_row: int, item: RequestedItem) -> None:
    """Copy the part of the item's region that lies in ``src`` (rows ``first_row``... of
    the saved tensor) into its destination, converting dtype; to a GPU through the
    item's pinned bounce buffers (``to_device``), without waiting for the copy."""
    req, target = item.req, item.target
    assert target is not None
    put = item.to_device.put if item.to_device is not None else _copy
    if src.dim() == 0 or not req.lengths:
        put(target, src.reshape(target.shape))
        return
    o0, l0 = req.storage_offsets[0], req.lengths[0]
    a, b = max(first_row, o0), min(first_row + src.shape[0], o0 + l0)
    if a >= b:
        return
    piece = src[a - first_row:b - first_row]
    for dim in range(1, src.dim()):
        piece = piece.narrow(dim, req.storage_offsets[dim], req.lengths[dim])
    put(target[a - o0:b - o0], piece)


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src)


class _BufferReader(io.RawIOBase):
    """A read-only, seekable file over a buffer, without copying it: ``torch.load``
    reads each storage straight out of it with ``readinto``."""

    def __init__(self, data: memoryview) -> None:
        super().__init__()
        self._data = data.cast("B") if data.format != "B" else data
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._data)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        with memoryview(buffer) as view, view.cast("B") as out:
            n = max(0, min(out.nbytes, len(self._data) - self._pos))
            out[:n] = self._data[self._pos : self._pos + n]
        self._pos += n
        return n


def refuse_unsafe_pickle(raw: bytes, what: str) -> None:
    """DCP's planner unpickles byte items with ``weights_only=False``; only let
    through what ``weights_only=True`` accepts, so no pickled code can run."""
    safe_torch_load(io.BytesIO(raw), what)
