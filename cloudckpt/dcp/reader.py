"""Reading DCP checkpoints: :class:`CloudStorageReader`.

Only committed checkpoints are read, and every item's bytes are checked against
the CRC32C in the manifest. A large tensor is read straight into the memory of
the tensor it is loaded into: a small read of the item's head says where its
bytes lie (:mod:`.records`), then part-sized ranged reads fill the destination,
checksummed as they arrive. Items that need a conversion (another dtype, a
non-contiguous or GPU destination, part of a saved tensor) pass through a
buffer a few rows at a time; small items are fetched with their neighbours in
one request. Buffers come from a read window, so a load's extra host memory is
bounded whatever the state size.
"""

from __future__ import annotations

import dataclasses
import functools
import io
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from cloudckpt.core.checkpoint import Checkpoint, open_checkpoint
from cloudckpt.dcp.base import _OnStore
from cloudckpt.dcp.metadata import METADATA_NAME, ItemCrcs, load_metadata
from cloudckpt.dcp.records import HEAD_BYTES, SavedTensor, try_locate
from cloudckpt.errors import CorruptCheckpointError, IncompleteCheckpointError, StateMismatchError
from cloudckpt.runtime import coordination as coord
from cloudckpt.runtime.state import safe_torch_load
from cloudckpt.storage import Store, as_store
from cloudckpt.storage.ranges import READ_PIECE
from cloudckpt.storage.window import ByteWindow, shared_window
from cloudckpt.util.crc import Crc32c, crc32c_hex

#: Bytes of buffers a load holds at once (fetched small items, rows being converted);
#: tensors read straight into their destinations take none. One item may exceed it.
DEFAULT_READ_WINDOW = 128 * 1024 * 1024
#: Tensor items at least this large are read straight into their destinations.
STREAM_MIN = 1024 * 1024
#: Adjacent items closer than this are fetched with one ranged GET.
COALESCE_GAP = 1024 * 1024
#: Items at most this large that several ranks read are read once, by the coordinator.
SHARED_ITEM_MAX = 64 * 1024


def _open_dcp(store: Store) -> Checkpoint:
    try:
        return open_checkpoint(store)
    except IncompleteCheckpointError:
        if store.exists(METADATA_NAME):
            raise IncompleteCheckpointError(
                f"{store.uri} holds a DCP checkpoint without a cloudckpt manifest (written by "
                f"stock torch, or a save that crashed before committing). If it is complete, "
                f"`cloudckpt adopt {store.uri}` checks every object .metadata references and "
                "commits it; otherwise load an earlier checkpoint."
            ) from None
        raise


class CloudStorageReader(_OnStore, StorageReader):
    """DCP storage reader for a committed cloudckpt DCP checkpoint at any URI.

    ``share_metadata=True`` has rank 0 of ``process_group`` (the group given to
    ``dcp.load``; None: the default group) read the manifest and ``.metadata``
    and share them, so a job reads them once instead of once per rank
    (:func:`cloudckpt.dcp.load` does this for you).

    Byte ranges are fetched concurrently (adjacent items coalesced, large ones
    split), each item's bytes are checked against the CRC32C recorded at save
    time, and nothing is unpickled beyond DCP's own metadata types and
    ``weights_only`` tensors.
    """

    def __init__(
        self,
        uri: str | Store,
        *,
        storage_options: Mapping[str, Any] | None = None,
        read_window: int = DEFAULT_READ_WINDOW,
        share_metadata: bool = False,
        process_group: Any = None,
    ) -> None:
        super().__init__()
        self.storage_options = dict(storage_options or {})
        self.store = as_store(uri, self.storage_options)
        self.read_window = read_window
        self.share_metadata = share_metadata
        self.process_group = process_group
        self.checkpoint: Checkpoint | None = None
        self._metadata: Metadata | None = None
        self.storage_data: dict[MetadataIndex, _StorageInfo] = {}

    def reset(self, checkpoint_id: Any = None) -> None:
        # DCP calls this at the start of every load; keep what was already read
        # unless the checkpoint changes.
        if checkpoint_id and str(checkpoint_id) != self.uri:
            self.store = as_store(str(checkpoint_id), self.storage_options)
            self.checkpoint = None
            self._metadata = None
        self.storage_data = {}

    def _ckpt(self) -> Checkpoint:
        if self.checkpoint is None:
            self.checkpoint = _open_dcp(self.store)
        return self.checkpoint

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint's ``.metadata`` (after its manifest). With ``share_metadata``,
        rank 0 of ``process_group`` reads both and every rank gets them (its error,
        if it fails): call it on every rank, as DCP's ``load`` does."""
        if self._metadata is None:
            if self.share_metadata:
                found = coord.on_coordinator(self._read_metadata, self.process_group)
                assert found is not None
                self.prime(*found)
            else:
                self._read_metadata()
        assert self._metadata is not None
        return self._metadata

    def _read_metadata(self) -> tuple[Metadata, Checkpoint]:
        ckpt = self._ckpt()
        md = load_metadata(ckpt.read(METADATA_NAME), source=ckpt.store.key_uri(METADATA_NAME))
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        self._metadata = md
        return md, ckpt

    def prime(self, metadata: Metadata, checkpoint: Checkpoint) -> None:
        """Use the ``.metadata`` and manifest (checkpoint) another rank read instead of
        reading them again: at a large world size, one read per job, not per rank."""
        self._metadata = metadata
        self.checkpoint = checkpoint

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        if metadata.storage_data is None:
            raise CorruptCheckpointError(f"{self.uri}/.metadata has no storage data")
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Coordinator: small items that several ranks read (replicated state such as
        Adam's step counts and hyper-parameters) are read here, once, checked, and
        sent to the ranks with their plans. Otherwise every rank would ask the bucket
        for the same few bytes at the same moment: 1,024 GETs on one key."""
        readers = Counter(req.storage_index for plan in plans for req in plan.items)
        shared = [i for i, n in readers.items()
                  if n > 1 and self.storage_data[i].length <= SHARED_ITEM_MAX]
        if not shared:
            return plans
        item_crcs = ItemCrcs(self._ckpt().metadata.get("dcp"))
        items = [_Item(_raw_request(i), *self._entry(i, item_crcs), None) for i in shared]
        window = shared_window(self.read_window)
        self.store.map(lambda group: self._fetch_group(*group, window),
                       _coalesce(items, self.store.part_size))
        raw = {item.req.storage_index: item.raw for item in items}
        return [dataclasses.replace(plan, storage_data=_Prefetched(
            {req.storage_index: raw[req.storage_index] for req in plan.items
             if req.storage_index in raw})) for plan in plans]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        fut: Future[None] = Future()
        try:
            given = plan.storage_data.items if isinstance(plan.storage_data, _Prefetched) else {}
            self._read(plan.items, planner, given)
        except Exception as exc:  # noqa: BLE001 - handed to DCP through the future
            fut.set_exception(exc)  # (an interrupt propagates: a torch Future cannot hold it)
            return fut
        fut.set_result(None)
        return fut

    def _read(self, reqs: Sequence[ReadItem], planner: LoadPlanner,
              given: Mapping[MetadataIndex, bytes]) -> None:
        ckpt = self._ckpt()
        item_crcs = ItemCrcs(ckpt.metadata.get("dcp"))
        items = [self._item(req, planner, item_crcs) for req in reqs]
        for item in items:  # read (and checked) by the coordinator
            if item.req.storage_index in given:
                item.raw = given[item.req.storage_index]
                if item.target is not None:
                    _deliver(item, bytearray(item.raw), 0, self.uri)
        # Large tensors go straight into their destinations. One of up to two parts
        # comes in one request whose first bytes say where the tensor lies; a larger
        # one is located by a read of its head, then fetched as parallel spans. The
        # rest, and split items of another layout, are fetched with their neighbours.
        window = shared_window(self.read_window)
        split_above = 2 * self.store.part_size
        todo = [i for i in items if i.raw is None]
        large = [i for i in todo if i.target is not None and i.info.length >= STREAM_MIN]
        split = [i for i in large if i.info.length > split_above]
        self.store.map(self._locate, split)
        streamed = [i for i in split if i.saved is not None]
        apart = {id(i) for i in large} - {id(i) for i in split if i.saved is None}
        whole = [i for i in todo if id(i) not in apart]
        tasks: list[Callable[[], None]] = [
            functools.partial(self._fetch_group, path, start, end, members, window)
            for path, start, end, members in _coalesce(whole, self.store.part_size)]
        tasks += [functools.partial(self._stream, i, window)
                  for i in large if i.info.length <= split_above]
        for item in streamed:
            tasks += self._spans(item, window)
        self.store.map(lambda task: task(), tasks)
        for item in streamed:
            item.verify(self.uri)
        for item in items:  # in DCP's order, on DCP's thread
            if item.target is not None:
                planner.commit_tensor(item.req, item.target)
            else:
                assert item.raw is not None
                _refuse_unsafe_pickle(item.raw, f"{self.uri} item {item.fqn}")
                planner.load_bytes(item.req, io.BytesIO(item.raw))

    def _entry(self, index: MetadataIndex, item_crcs: ItemCrcs) -> tuple[_StorageInfo, str]:
        """Where an item lies and its CRC32C, checked against the manifest."""
        info = self.storage_data[index]
        path = info.relative_path
        if getattr(info, "transform_descriptors", None):
            raise CorruptCheckpointError(
                f"{self.uri}: item {index.fqn} uses stream transforms "
                f"{info.transform_descriptors}, which cloudckpt does not read")
        entry = self._ckpt().entry(path)  # must be in the manifest
        if info.offset + info.length > entry.size:
            raise CorruptCheckpointError(
                f"{self.uri}: item {index.fqn} lies past the end of {path}", {path: "short"})
        expected = item_crcs.get(path, info.offset)
        if expected is None:
            raise CorruptCheckpointError(
                f"{self.uri}: the manifest has no checksum for item {index.fqn} "
                f"in {path}; the checkpoint and its manifest disagree", {path: "no checksum"})
        return info, expected

    def _item(self, req: ReadItem, planner: LoadPlanner,
              item_crcs: ItemCrcs) -> _Item:
        info, expected = self._entry(req.storage_index, item_crcs)
        target = None
        if req.type != LoadItemType.BYTE_IO:
            target = planner.resolve_tensor(req).detach()
            if tuple(target.size()) != tuple(req.lengths):
                raise StateMismatchError(
                    f"loading {self.uri}: {req.storage_index.fqn} has shape "
                    f"{tuple(req.lengths)} in the checkpoint but {tuple(target.size())} in the "
                    "state to load into; the model does not match the checkpoint")
        return _Item(req, info, expected, target)

    def _locate(self, item: _Item) -> None:
        """Read an item's head and find its tensor's bytes (None: read it whole)."""
        n = min(item.info.length, HEAD_BYTES)
        head = self.store.get_range(item.path, item.info.offset, item.info.offset + n)
        item.saved = try_locate(head, item.info.length)
        if item.saved is not None:
            item.head = head[:item.saved.data_start]

    def _spans(self, item: _Item, window: ByteWindow) -> list[Callable[[], None]]:
        """Ranged reads of the item's body (its tensor's bytes, then the zip's tail):
        into the destination's own memory where it takes the bytes as they are, else a
        whole number of rows at a time through a buffer, converted into place."""
        saved, target = item.saved, item.target
        assert saved is not None and target is not None
        base = item.info.offset + saved.data_start
        tail = bytearray(item.info.length - saved.data_start - saved.nbytes)
        item.tail = tail
        if _direct(item, saved):
            dest = _bytes_of(target)
            bounds = _split_range(0, saved.nbytes, max(self.store.part_size, 1 << 20))
            item.crcs = [None] * len(bounds)
            return [functools.partial(self._read_direct, item, k, base + a,
                                      [dest[a:b], *([tail] if b == saved.nbytes else [])])
                    for k, (a, b) in enumerate(bounds)]
        step = saved.rows_within(self._row_budget())
        spans = [(r, min(r + step, saved.rows)) for r in range(0, saved.rows, step)] or [(0, 0)]
        item.crcs = [None] * len(spans)
        return [functools.partial(self._read_rows, item, k, r0, r1, base, window,
                                  k == len(spans) - 1)
                for k, (r0, r1) in enumerate(spans)]

    def _row_budget(self) -> int:
        """Bytes of rows converted at once: about a part, within the read window."""
        return max(1, min(max(self.store.part_size, 1 << 20), self.read_window))

    def _read_direct(self, item: _Item, k: int, start: int, outs: list[Any]) -> None:
        item.crcs[k] = (self.store.read_range_into(item.path, start, outs),
                        sum(memoryview(o).nbytes for o in outs))

    def _read_rows(self, item: _Item, k: int, r0: int, r1: int, base: int,
                   window: ByteWindow, last: bool) -> None:
        assert item.saved is not None and item.target is not None and item.tail is not None
        rows = _Rows(item, window, r1 - r0, first_row=r0)
        try:
            outs = [rows.buffer, *([item.tail] if last else [])]
            crc = self.store.read_range_into(item.path, base + r0 * rows.row_bytes, outs)
            item.crcs[k] = (crc, rows.size + (len(item.tail) if last else 0))
            rows.filled(rows.size)
        finally:
            rows.close()

    def _stream(self, item: _Item, window: ByteWindow) -> None:
        """One request for a whole item, its bytes put where they go as they arrive."""
        sink = _Stream(item, window, self._row_budget())
        try:
            self.store.read_range_to(item.path, item.info.offset,
                                     item.info.offset + item.info.length, sink, chunk=READ_PIECE)
            sink.finish(self.uri)
        finally:
            sink.close()

    def _fetch_group(self, path: str, start: int, end: int, members: list[_Item],
                     window: ByteWindow) -> None:
        """Items close together in one file, fetched with one request into a window
        buffer; each checked, then copied into its destination (or kept, for bytes)."""
        n = end - start
        held = window.acquire(n)
        buf = window.mapping(n)
        try:
            self.store.read_range_into(path, start, [buf])
            view = memoryview(buf)
            for item in members:
                data = view[item.info.offset - start:item.info.offset - start + item.info.length]
                actual = crc32c_hex(data)
                if actual != item.crc:
                    raise item.corrupt(self.uri, actual)
                if item.target is None:
                    item.raw = bytes(data)
                    continue
                _deliver(item, buf, item.info.offset - start, self.uri)
            view.release()
        finally:
            window.keep(buf)
            window.release(held)


@dataclass(eq=False)
class _Item:
    """One requested item: where it is, its checksum, where it goes, what arrived."""

    req: ReadItem
    info: _StorageInfo
    crc: str
    target: torch.Tensor | None  # None: a bytes item
    saved: SavedTensor | None = None
    head: bytes = b""  # the item's bytes before its tensor's (streamed items)
    tail: bytearray | None = None  # the item's bytes after its tensor's
    crcs: list[tuple[int, int] | None] = field(default_factory=list)  # per span
    raw: bytes | None = None  # a bytes item's bytes

    @property
    def path(self) -> str:
        return self.info.relative_path

    @property
    def fqn(self) -> str:
        return self.req.storage_index.fqn

    def verify(self, uri: str) -> None:
        """Check a streamed item's CRC32C from its head's and its spans' (in order)."""
        crc = Crc32c()
        crc.update(self.head)
        for got in self.crcs:
            assert got is not None
            crc.append(*got)
        if crc.hexdigest() != self.crc:
            raise self.corrupt(uri, crc.hexdigest())

    def corrupt(self, uri: str, actual: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"object {self.path!r} of {uri} is corrupt: item {self.fqn} at offset "
            f"{self.info.offset} has crc32c {actual}, manifest says {self.crc}. Fall back to "
            "an earlier checkpoint.", {self.path: f"crc32c mismatch in {self.fqn}"})


def _deliver(item: _Item, buf: Any, at: int, uri: str) -> None:
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
    _place(src, 0, item.req, item.target)


def _direct(item: _Item, saved: SavedTensor) -> bool:
    """Whether the item's bytes can go straight into its destination's memory."""
    target, req = item.target, item.req
    return (target is not None and target.device.type == "cpu" and target.dtype == saved.dtype
            and target.is_contiguous() and tuple(req.lengths) == saved.shape
            and saved.nbytes > 0)


class _Rows:
    """A window buffer of whole rows of a saved tensor, placed (converted) into the
    destination when full: rows ``first_row``... for up to ``rows`` rows."""

    def __init__(self, item: _Item, window: ByteWindow, rows: int, *, first_row: int = 0
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
            _place(_tensor_over(self.buffer, 0, self.fill, self.saved, rows), self.first_row,
                   self.item.req, self.item.target)
            self.first_row += rows
            self.fill = 0

    def close(self) -> None:
        if self.size:
            self._window.keep(self.buffer)
        self._window.release(self._held)
        self._held = 0


class _Stream:
    """Takes a whole item's bytes in order (one request): finds its tensor in the
    first few KiB, then puts every byte where it goes, checksumming all of it."""

    def __init__(self, item: _Item, window: ByteWindow, row_budget: int) -> None:
        self.item, self._window, self._row_budget = item, window, row_budget
        self.crc = Crc32c()
        self._pending: list[tuple[int, memoryview]] | None = []
        self._got = 0
        self._saved: SavedTensor | None = None
        self._dest: memoryview | None = None
        self._rows: _Rows | None = None
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

    def _locate_pending(self) -> None:
        """Find the tensor in the bytes held back so far, then put them where they go."""
        assert self._pending is not None
        pieces, self._pending = self._pending, None
        head = pieces[0][1] if len(pieces) == 1 else b"".join(v for _, v in pieces)
        self._choose(try_locate(head, self.item.info.length))
        for r, v in pieces:
            self._put(r, v)

    def _choose(self, saved: SavedTensor | None) -> None:
        self._saved = self.item.saved = saved
        if saved is None:  # another layout: the whole item, torch.load'ed once checked
            self._held = self._window.acquire(self.item.info.length)
            self._whole = self._window.mapping(self.item.info.length)
        elif _direct(self.item, saved):
            assert self.item.target is not None
            self._dest = _bytes_of(self.item.target)
        elif saved.nbytes:
            rows = min(saved.rows_within(self._row_budget), saved.rows)
            self._rows = _Rows(self.item, self._window, rows)

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
            _deliver(self.item, self._whole, 0, uri)
        elif self._rows is not None:
            self._rows.flush()

    def close(self) -> None:
        if self._rows is not None:
            self._rows.close()
        if self._whole is not None:
            self._window.keep(self._whole)
            self._window.release(self._held)
            self._whole = None


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The memory of a contiguous CPU tensor, as writable bytes (any dtype)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _tensor_over(buf: Any, offset: int, nbytes: int, saved: SavedTensor,
                 rows: int) -> torch.Tensor:
    """``rows`` rows of the saved tensor, over ``nbytes`` of ``buf`` from ``offset``."""
    shape = (rows, *saved.shape[1:]) if saved.shape else ()
    if nbytes == 0:
        return torch.empty(shape, dtype=saved.dtype)
    flat = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=offset)
    return flat.view(saved.dtype).view(shape)


def _place(src: torch.Tensor, first_row: int, req: ReadItem, target: torch.Tensor) -> None:
    """Copy the part of ``req``'s region that lies in ``src`` (rows ``first_row``... of
    the saved tensor) into ``target`` (the region's destination), converting dtype."""
    if src.dim() == 0 or not req.lengths:
        target.copy_(src.reshape(target.shape))
        return
    o0, l0 = req.storage_offsets[0], req.lengths[0]
    a, b = max(first_row, o0), min(first_row + src.shape[0], o0 + l0)
    if a >= b:
        return
    piece = src[a - first_row:b - first_row]
    for dim in range(1, src.dim()):
        piece = piece.narrow(dim, req.storage_offsets[dim], req.lengths[dim])
    target[a - o0:b - o0].copy_(piece)


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


def _split_range(start: int, end: int, chunk: int) -> list[tuple[int, int]]:
    """``[start, end)`` as about-equal ranges of about ``chunk`` bytes (at least one)."""
    n = max(1, round((end - start) / chunk))
    return [(start + (end - start) * i // n, start + (end - start) * (i + 1) // n)
            for i in range(n)]


def _refuse_unsafe_pickle(raw: bytes, what: str) -> None:
    """DCP's planner unpickles byte items with ``weights_only=False``; only let
    through what ``weights_only=True`` accepts, so no pickled code can run."""
    safe_torch_load(io.BytesIO(raw), what)


def _coalesce(items: Sequence[_Item], limit: int
              ) -> list[tuple[str, int, int, list[_Item]]]:
    """Items of one file closer than :data:`COALESCE_GAP` as one range of at most about
    ``limit`` bytes (one item may be longer): ``(path, start, end, members)``."""
    groups: list[tuple[str, int, int, list[_Item]]] = []
    for item in sorted(items, key=lambda i: (i.path, i.info.offset)):
        end = item.info.offset + item.info.length
        if groups:
            path, start, last, members = groups[-1]
            if (path == item.path and item.info.offset - last <= COALESCE_GAP
                    and end - start <= limit):
                groups[-1] = (path, start, max(last, end), [*members, item])
                continue
        groups.append((item.path, item.info.offset, end, [item]))
    return groups


@dataclass(frozen=True)
class _Prefetched:
    """A rank's plan data: the checked bytes of the shared small items it reads."""

    items: dict[MetadataIndex, bytes]


def _raw_request(index: MetadataIndex) -> ReadItem:
    """A request for an item's stored bytes as they are (read whole, kept raw)."""
    return ReadItem(LoadItemType.BYTE_IO, index, torch.Size(), index, torch.Size(),
                    torch.Size())
