"""Reading DCP checkpoints: :class:`CloudStorageReader`.

Only committed checkpoints are read, and every item's bytes are checked against
the CRC32C in the manifest. A large tensor is read straight into the memory of
the tensor it is loaded into: a small read of the item's head says where its
bytes lie (:mod:`cloudckpt.serialization.records`), then part-sized ranged reads
fill the destination, checksummed as they arrive. Items that need a conversion
(another dtype, a non-contiguous or GPU destination, part of a saved tensor) pass
through a buffer a few rows at a time (:mod:`.placement`); small items are fetched
with their neighbours in one request (:mod:`.readplan`). Buffers come from a read
window, so a load's extra host memory is bounded whatever the state size. Rows for
a GPU destination go on through pinned buffers (:class:`~.devicecopy.ToDevice`),
copied to the device without blocking while the next reads arrive; every copy is
waited for, and every item's CRC32C checked, before DCP is told the tensors are in.
"""

from __future__ import annotations

import dataclasses
import functools
import io
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from cloudckpt.compat.torch_private import StorageInfo
from cloudckpt.core.checkpoint import Checkpoint, open_checkpoint
from cloudckpt.dcp.base import OnStore
from cloudckpt.dcp.devicecopy import Copier, PinnedPool, ToDevice
from cloudckpt.dcp.indexread import full_metadata, is_indexed, read_index, whole_items
from cloudckpt.dcp.metadata import METADATA_NAME, ItemCrcs, load_metadata
from cloudckpt.dcp.placement import (
    ItemStream,
    NotStraight,
    RowBuffer,
    bytes_of,
    deliver,
    goes_straight,
    refuse_unsafe_pickle,
)
from cloudckpt.dcp.readplan import Prefetched, RequestedItem, coalesce, raw_request, split_range
from cloudckpt.dcp.records import INDEX_NAME, Index
from cloudckpt.errors import CorruptCheckpointError, IncompleteCheckpointError, StateMismatchError
from cloudckpt.names import MANIFEST_NAME
from cloudckpt.runtime import coordination as coord
from cloudckpt.serialization.records import HEAD_BYTES, try_locate
from cloudckpt.storage import Store, as_store
from cloudckpt.storage.transfer.ranges import READ_PIECE
from cloudckpt.storage.transfer.window import ByteWindow, shared_window
from cloudckpt.util import pages
from cloudckpt.util.crc import crc32c_hex

#: Bytes of buffers a load holds at once (fetched small items, rows being converted);
#: tensors read straight into their destinations take none. One item may exceed it.
DEFAULT_READ_WINDOW = 128 * 1024 * 1024
#: Tensor items at least this large are read straight into their destinations.
STREAM_MIN = 1024 * 1024
#: Items at most this large that several ranks read are read once, by the coordinator.
SHARED_ITEM_MAX = 64 * 1024
#: Most bytes of such items the coordinator of an indexed load reads and sends to every
#: rank with the index (the smallest first); larger ones each rank reads itself.
SHARED_BYTES_MAX = 16 * 1024 * 1024


@dataclass(frozen=True)
class IndexedStart:
    """What the coordinator of a load of an indexed checkpoint shares first: its index."""

    index: Index


def _open_dcp(store: Store) -> Checkpoint:
    try:
        return open_checkpoint(store)
    except IncompleteCheckpointError:
        # (With a manifest, it is a part of a save that never committed: said as it is.)
        if store.exists(METADATA_NAME) and not store.exists(MANIFEST_NAME):
            raise IncompleteCheckpointError(
                f"{store.uri} holds a DCP checkpoint without a cloudckpt manifest (written by "
                f"stock torch, or a save that crashed before committing). If it is complete, "
                f"`cloudckpt adopt {store.uri}` checks every object .metadata references and "
                "commits it; otherwise load an earlier checkpoint."
            ) from None
        raise


class CloudStorageReader(OnStore, StorageReader):
    """DCP storage reader for a committed cloudckpt DCP checkpoint at any URI.

    ``share_metadata=True`` has rank 0 of ``process_group`` (the group given to
    ``dcp.load``; None: the default group) read the manifest and ``.metadata``
    and share them, so a job reads them once instead of once per rank
    (:func:`cloudckpt.dcp.load` does this for you).

    Byte ranges are fetched concurrently (adjacent items coalesced, large ones
    split), each item's bytes are checked against the CRC32C recorded at save
    time, and nothing is unpickled beyond DCP's own metadata types and
    ``weights_only`` tensors. ``uri`` may be a :class:`Checkpoint` opened already
    (a part of a larger checkpoint, its manifest read through that one's).

    GPU destinations are filled through ``pinned_pool`` (None: the process's shared
    :class:`~cloudckpt.dcp.devicecopy.PinnedPool`); ``copier`` replaces that choice
    whole (as for :class:`~cloudckpt.dcp.writer.CloudStorageWriter`).
    """

    def __init__(
        self,
        uri: str | Store | Checkpoint,
        *,
        storage_options: Mapping[str, Any] | None = None,
        read_window: int = DEFAULT_READ_WINDOW,
        share_metadata: bool = False,
        process_group: Any = None,
        pinned_pool: PinnedPool | None = None,
        copier: Copier | None = None,
    ) -> None:
        super().__init__()
        self.copier = copier or Copier(pinned_pool)
        self.storage_options = dict(storage_options or {})
        self.read_window = read_window
        self.share_metadata = share_metadata
        self.process_group = process_group
        self.checkpoint: Checkpoint | None = None
        self._metadata: Metadata | None = None
        self._crcs: ItemCrcs | None = None  # None: the manifest's
        self._prefetched: dict[MetadataIndex, bytes] = {}
        self.storage_data: dict[MetadataIndex, StorageInfo] = {}
        self._given = isinstance(uri, Checkpoint)
        if isinstance(uri, Checkpoint):  # its manifest read already (a part of a larger one)
            self.prime(None, uri)
        else:
            self.store = as_store(uri, self.storage_options)
        self._base = self.store

    def reset(self, checkpoint_id: Any = None) -> None:
        # DCP calls this at the start of every load; keep what was already read
        # unless the checkpoint changes.
        if checkpoint_id and str(checkpoint_id) != self.uri:
            self._base = as_store(str(checkpoint_id), self.storage_options)
            self._given = False
            self._forget()
        self.storage_data = {}

    def _forget(self) -> None:
        """After a load: read the manifest and ``.metadata`` afresh for the next one, as
        the checkpoint may have been replaced since (``overwrite=True``), unless the
        checkpoint was given opened."""
        if not self._given:
            self.store = self._base
            self.checkpoint = None
            self._metadata = None
            self._crcs = None
            self._prefetched = {}

    def _ckpt(self) -> Checkpoint:
        if self.checkpoint is None:
            self.prime(None, _open_dcp(self.store))
        assert self.checkpoint is not None
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

    def _read_metadata(self) -> tuple[Metadata, Checkpoint, ItemCrcs | None]:
        ckpt = self._ckpt()
        if is_indexed(ckpt):
            # Item checksums live in the records, so they are read even where a stock
            # .metadata was written too: the index and every rank's records.
            md, crcs = full_metadata(ckpt)
        else:
            md, crcs = self._classic(ckpt), None
        self._metadata, self._crcs = md, crcs
        return md, ckpt, crcs

    def _classic(self, ckpt: Checkpoint) -> Metadata:
        """``.metadata``, read only once the manifest says the checkpoint is classic (an
        indexed one may have none, or one far larger than what a load reads)."""
        raw = ckpt.read(METADATA_NAME)
        md = load_metadata(raw, source=ckpt.store.key_uri(METADATA_NAME))
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        return md

    def open_for_load(self) -> IndexedStart | None:
        """The first step of :func:`cloudckpt.dcp.load`, on every rank: the manifest
        and, for a classic checkpoint, ``.metadata`` (primed, None returned); for an
        indexed one, the index (returned, for the rank to read the records it needs).
        With ``share_metadata``, rank 0 of ``process_group`` reads them and every rank
        gets them (or its error)."""
        if self.share_metadata:
            found = coord.on_coordinator(self._open_for_load, self.process_group)
        else:
            found = self._open_for_load()
        ckpt, md, start = found
        if self.share_metadata and not self._given and coord.rank(self.process_group) != 0:
            # The manifest read there, this rank's own store and options to read through.
            ckpt = Checkpoint(self._base, ckpt.manifest)
        self.prime(md, ckpt)
        return start

    def _open_for_load(self) -> tuple[Checkpoint, Metadata | None, IndexedStart | None]:
        ckpt = self._ckpt()
        if not is_indexed(ckpt):
            return ckpt, self._classic(ckpt), None
        return ckpt, None, IndexedStart(read_index(ckpt))

    def read_whole_items(self, index: Index) -> dict[MetadataIndex, bytes]:
        """The smallest items ``index`` holds whole (up to :data:`SHARED_BYTES_MAX` in
        all), read and checked: the replicated state every rank of a load reads, read
        once by the coordinator and sent to the others (see :meth:`prime`)."""
        located = whole_items(index)
        chosen, total = [], 0
        for idx, loc in sorted(located.items(), key=lambda kv: kv[1].length):
            if loc.length > SHARED_ITEM_MAX or total + loc.length > SHARED_BYTES_MAX:
                break
            chosen.append(idx)
            total += loc.length
        if not chosen:
            return {}
        self.storage_data = {idx: located[idx].storage_info() for idx in chosen}
        try:
            return self._fetch_raw(chosen, ItemCrcs.of(
                (located[i].file, located[i].offset, located[i].crc32c) for i in chosen))
        finally:
            self.storage_data = {}

    def prime(self, metadata: Metadata | None, checkpoint: Checkpoint,
              item_crcs: ItemCrcs | None = None,
              prefetched: Mapping[MetadataIndex, bytes] | None = None) -> None:
        """Use the ``.metadata`` and manifest (checkpoint) another rank read instead of
        reading them again: at a large world size, one read per job, not per rank.
        ``item_crcs`` are the items' checksums where the manifest does not hold them (an
        indexed checkpoint's records); ``prefetched`` the checked bytes of items read
        already (by the coordinator, once for the job)."""
        self._metadata = metadata
        self._crcs = item_crcs
        self._prefetched = dict(prefetched or {})
        self.checkpoint = checkpoint
        self.store = checkpoint.store  # reads its objects where its manifest says

    def _item_crcs(self) -> ItemCrcs:
        if self._crcs is not None:
            return self._crcs
        return ItemCrcs(self._ckpt().metadata.get("dcp"))

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
        if self._prefetched:  # read by the coordinator already (an indexed load)
            return [dataclasses.replace(plan, storage_data=Prefetched(
                {req.storage_index: self._prefetched[req.storage_index] for req in plan.items
                 if req.storage_index in self._prefetched})) for plan in plans]
        readers = Counter(req.storage_index for plan in plans for req in plan.items)
        shared = [i for i, n in readers.items()
                  if n > 1 and self.storage_data[i].length <= SHARED_ITEM_MAX]
        if not shared:
            return plans
        raw = self._fetch_raw(shared, self._item_crcs())
        return [dataclasses.replace(plan, storage_data=Prefetched(
            {req.storage_index: raw[req.storage_index] for req in plan.items
             if req.storage_index in raw})) for plan in plans]

    def _fetch_raw(self, indices: Sequence[MetadataIndex], item_crcs: ItemCrcs
                   ) -> dict[MetadataIndex, bytes]:
        """The stored bytes of items ``indices`` (of :attr:`storage_data`), checked."""
        items = [RequestedItem(raw_request(i), *self._entry(i, item_crcs), None)
                 for i in indices]
        window = shared_window(self.read_window)
        self.store.map(lambda group: self._fetch_group(*group, window),  # type: ignore[call-arg]  # mypy: *Any fills every parameter
                       coalesce(items, self.store.part_size))
        return {item.req.storage_index: cast(bytes, item.raw) for item in items}  # all fetched

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        fut: Future[None] = Future()
        try:
            given = plan.storage_data.items if isinstance(plan.storage_data, Prefetched) else {}
            self._read(plan.items, planner, given)
        except Exception as exc:  # noqa: BLE001 - handed to DCP through the future
            # (an interrupt propagates: a torch Future cannot hold it; torch types the
            # argument as the result's)
            fut.set_exception(exc)  # type: ignore[arg-type]
            return fut
        finally:
            self._forget()  # the last step of a load on every rank
        fut.set_result(None)
        return fut

    def _read(self, reqs: Sequence[ReadItem], planner: LoadPlanner,
              given: Mapping[MetadataIndex, bytes]) -> None:
        item_crcs = self._item_crcs()
        items = [self._item(req, planner, item_crcs) for req in reqs]
        to_device = None
        for item in items:
            if item.target is not None and self.copier.wants(item.target):
                to_device = to_device or self.copier.to_device()
                item.to_device = to_device
        try:
            self._read_items(items, planner, given, to_device)
        finally:
            if to_device is not None:
                to_device.close()  # after a failure: the copies in flight, then the buffers

    def _read_items(self, items: list[RequestedItem], planner: LoadPlanner,
                    given: Mapping[MetadataIndex, bytes], to_device: ToDevice | None) -> None:
        for item in items:  # read (and checked) by the coordinator
            if item.req.storage_index in given:
                item.raw = given[item.req.storage_index]
                if item.target is not None:
                    deliver(item, bytearray(item.raw), 0, self.uri)
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
            for path, start, end, members in coalesce(whole, self.store.part_size)]
        tasks += [functools.partial(self._stream, i, window)
                  for i in large if i.info.length <= split_above]
        for item in streamed:
            tasks += self._spans(item, window)
        self.store.map(lambda task: task(), tasks)
        for item in streamed:
            item.verify(self.uri)
        if to_device is not None:
            to_device.finish()  # every copy to a device done (or its failure raised)
        for item in items:  # in DCP's order, on DCP's thread
            if item.target is not None:
                planner.commit_tensor(item.req, item.target)
            else:
                assert item.raw is not None
                refuse_unsafe_pickle(item.raw, f"{self.uri} item {item.fqn}")
                planner.load_bytes(item.req, io.BytesIO(item.raw))

    def _entry(self, index: MetadataIndex, item_crcs: ItemCrcs) -> tuple[StorageInfo, str]:
        """Where an item lies and its CRC32C, checked against the manifest."""
        info = self.storage_data[index]
        path = info.relative_path
        if getattr(info, "transform_descriptors", None):
            raise CorruptCheckpointError(
                f"{self.uri}: item {index.fqn} uses stream transforms "
                f"{info.transform_descriptors}, which cloudckpt does not read")
        ckpt = self._ckpt()
        # Where the item's location was read: the index (and ranks' records) or .metadata.
        source = INDEX_NAME if is_indexed(ckpt) else METADATA_NAME
        entry = ckpt.manifest.files.get(path) if isinstance(path, str) else None
        if entry is None:
            raise CorruptCheckpointError(
                f"{self.uri}/{source} puts item {index.fqn} in {path!r}, which the "
                f"manifest does not list: the {source} is not this checkpoint's. Fall back "
                "to an earlier checkpoint.", {source: f"names {path!r}"})
        offset, length = info.offset, info.length
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                   for n in (offset, length)) or offset + length > entry.size:
            raise CorruptCheckpointError(
                f"{self.uri}: {source} puts item {index.fqn} at bytes [{offset!r}, "
                f"+{length!r}) of {path}, which the manifest lists with {entry.size} bytes",
                {path: "short"})
        expected = item_crcs.get(path, info.offset)
        if expected is None:
            raise CorruptCheckpointError(
                f"{self.uri}: the manifest has no checksum for item {index.fqn} "
                f"in {path}; the checkpoint and its manifest disagree", {path: "no checksum"})
        return info, expected

    def _item(self, req: ReadItem, planner: LoadPlanner,
              item_crcs: ItemCrcs) -> RequestedItem:
        info, expected = self._entry(req.storage_index, item_crcs)
        target = None
        if req.type != LoadItemType.BYTE_IO:
            target = planner.resolve_tensor(req).detach()
            if tuple(target.size()) != tuple(req.lengths):
                raise StateMismatchError(
                    f"loading {self.uri}: {req.storage_index.fqn} has shape "
                    f"{tuple(req.lengths)} in the checkpoint but {tuple(target.size())} in the "
                    "state to load into; the model does not match the checkpoint")
        return RequestedItem(req, info, expected, target)

    def _locate(self, item: RequestedItem) -> None:
        """Read an item's head and find its tensor's bytes (None: read it whole)."""
        n = min(item.info.length, HEAD_BYTES)
        with self._ckpt().reading(item.path):
            head = self.store.get_range(item.path, item.info.offset, item.info.offset + n)
        item.saved = try_locate(head, item.info.length)
        if item.saved is not None:
            item.head = head[:item.saved.data_start]

    def _spans(self, item: RequestedItem, window: ByteWindow) -> list[Callable[[], None]]:
        """Ranged reads of the item's body (its tensor's bytes, then the zip's tail):
        into the destination's own memory where it takes the bytes as they are, else a
        whole number of rows at a time through a buffer, converted into place."""
        saved, target = item.saved, item.target
        assert saved is not None and target is not None
        base = item.info.offset + saved.data_start
        tail = bytearray(item.info.length - saved.data_start - saved.nbytes)
        item.tail = tail
        if goes_straight(item, saved):
            dest = bytes_of(target)
            bounds = split_range(0, saved.nbytes, max(self.store.part_size, 1 << 20))
            item.crcs = [None] * len(bounds)
            return [functools.partial(self._read_direct, item, k, base + a,
                                      [dest[a:b], *([tail] if b == saved.nbytes else [])],
                                      target.data_ptr() + a)
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

    def _read_direct(self, item: RequestedItem, k: int, start: int, outs: list[Any],
                     address: int) -> None:
        # Faulted in here, not page by page on the loop as the bytes arrive.
        pages.populate(address, memoryview(outs[0]).nbytes)
        with self._ckpt().reading(item.path):
            crc = self.store.read_range_into(item.path, start, outs)
        item.crcs[k] = (crc, sum(memoryview(o).nbytes for o in outs))

    def _read_rows(self, item: RequestedItem, k: int, r0: int, r1: int, base: int,
                   window: ByteWindow, last: bool) -> None:
        assert item.saved is not None and item.target is not None and item.tail is not None
        rows = RowBuffer(item, window, r1 - r0, first_row=r0)
        try:
            outs = [rows.buffer, *([item.tail] if last else [])]
            with self._ckpt().reading(item.path):
                crc = self.store.read_range_into(item.path, base + r0 * rows.row_bytes, outs)
            item.crcs[k] = (crc, rows.size + (len(item.tail) if last else 0))
            rows.filled(rows.size)
        finally:
            rows.close()

    def _stream(self, item: RequestedItem, window: ByteWindow) -> None:
        """One request for a whole item, its bytes put where they go as they arrive: on
        the event loop that receives them where they go straight into the destination
        (as ``.metadata`` says they will; if the record says otherwise, again here)."""
        if self._straight(item):
            target = item.target
            assert target is not None
            # Here, not page by page on the loop as the bytes arrive (see util/pages).
            pages.populate(target.data_ptr(), target.numel() * target.element_size())
            try:
                self._stream_once(item, window, on_loop=True)
                return
            except NotStraight:
                pass
        self._stream_once(item, window, on_loop=False)

    def _stream_once(self, item: RequestedItem, window: ByteWindow, *, on_loop: bool) -> None:
        sink = ItemStream(item, window, self._row_budget(), on_loop=on_loop)
        try:
            with self._ckpt().reading(item.path):
                self.store.read_range_to(item.path, item.info.offset,
                                         item.info.offset + item.info.length, sink,
                                         chunk=READ_PIECE, on_loop=on_loop)
            sink.finish(self.uri)
        finally:
            sink.close()

    def _straight(self, item: RequestedItem) -> bool:
        """Whether ``.metadata`` says the item's tensor is the whole of a saved chunk
        of the destination's dtype, and the destination takes its bytes as they are."""
        target, req = item.target, item.req
        md = self._metadata.state_dict_metadata.get(req.storage_index.fqn) \
            if self._metadata is not None else None
        if target is None or md is None or not isinstance(md, TensorStorageMetadata) or \
                target.device.type != "cpu" or not target.is_contiguous() or \
                md.properties.dtype != target.dtype or any(req.storage_offsets):
            return False
        offset = tuple(req.storage_index.offset or ())
        return any(tuple(c.offsets) == offset and tuple(c.sizes) == tuple(req.lengths)
                   for c in md.chunks)

    def _fetch_group(self, path: str, start: int, end: int, members: list[RequestedItem],
                     window: ByteWindow) -> None:
        """Items close together in one file, fetched with one request into a window
        buffer; each checked, then copied into its destination (or kept, for bytes)."""
        n = end - start
        held = window.acquire(n)
        buf = window.mapping(n)
        try:
            with self._ckpt().reading(path):
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
                deliver(item, buf, item.info.offset - start, self.uri)
            view.release()
        finally:
            window.release(held, keep=buf)
