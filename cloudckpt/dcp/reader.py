"""Reading DCP checkpoints: :class:`CloudStorageReader`.

Only committed checkpoints are read. Requested items are grouped by file,
adjacent ones coalesced into one ranged GET and large ranges split, fetched
concurrently within a read window; each item's bytes are checked against the
CRC32C in the manifest before DCP's planner sees them.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ..checkpoint import Checkpoint, open_checkpoint
from ..crc import crc32c_hex
from ..errors import CorruptCheckpointError, IncompleteCheckpointError, StateMismatchError
from ..state import safe_torch_load
from ..storage import Store, as_store
from .base import _OnStore
from .metadata import METADATA_NAME, load_metadata

#: Bytes a reader requests ahead of what it has consumed, at most (one range may exceed it).
DEFAULT_READ_WINDOW = 256 * 1024 * 1024
#: Adjacent items closer than this are fetched with one ranged GET.
COALESCE_GAP = 1024 * 1024


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
    ) -> None:
        super().__init__()
        self.storage_options = dict(storage_options or {})
        self.store = as_store(uri, self.storage_options)
        self.read_window = read_window
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
        if self._metadata is None:
            ckpt = self._ckpt()
            md = load_metadata(ckpt.read(METADATA_NAME),
                               source=ckpt.store.key_uri(METADATA_NAME))
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            self._metadata = md
        return self._metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        if metadata.storage_data is None:
            raise CorruptCheckpointError(f"{self.uri}/.metadata has no storage data")
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        fut: Future[None] = Future()
        try:
            self._read(plan.items, planner)
        except BaseException as exc:  # noqa: BLE001 - handed to DCP through the future
            fut.set_exception(exc)
            return fut
        fut.set_result(None)
        return fut

    def _read(self, reqs: Sequence[ReadItem], planner: LoadPlanner) -> None:
        ckpt = self._ckpt()
        item_crcs: Mapping[str, str] = (ckpt.metadata.get("dcp") or {}).get("items") or {}
        # Group requests by file; fetch each coalesced byte range once.
        by_file: dict[str, list[tuple[_StorageInfo, ReadItem]]] = {}
        for req in reqs:
            info = self.storage_data[req.storage_index]
            if getattr(info, "transform_descriptors", None):
                raise CorruptCheckpointError(
                    f"{self.uri}: item {req.storage_index.fqn} uses stream transforms "
                    f"{info.transform_descriptors}, which cloudckpt does not read")
            entry = ckpt.entry(info.relative_path)  # must be in the manifest
            if info.offset + info.length > entry.size:
                raise CorruptCheckpointError(
                    f"{self.uri}: item {req.storage_index.fqn} lies past the end of "
                    f"{info.relative_path}", {info.relative_path: "short"})
            by_file.setdefault(info.relative_path, []).append((info, req))
        groups = [g for path in sorted(by_file) for g in _coalesce(path, by_file[path])]
        # Each group is fetched as ranges of about one part (a group of about one
        # part size is one request), streamed: items are checked and delivered
        # while later ranges are still being fetched, with at most read_window
        # bytes fetched ahead.
        chunk = max(self.store.part_size, 1 << 20)
        pieces = [_split_range(start, end, chunk) for _, start, end, _ in groups]
        ranges = [(path, s, e) for (path, _, _, _), bounds in zip(groups, pieces, strict=True)
                  for s, e in bounds]
        fetched = self.store.iter_ranges(ranges, max_bytes=self.read_window)
        try:
            for (path, start, _, members), bounds in zip(groups, pieces, strict=True):
                parts = [next(fetched) for _ in bounds]
                blob = memoryview(parts[0] if len(parts) == 1 else b"".join(parts))
                del parts
                for info, req in members:
                    data = blob[info.offset - start : info.offset - start + info.length]
                    self._check_item(path, info, req, data, item_crcs)
                    self._deliver(req, data, planner)
        finally:
            fetched.close()

    def _check_item(self, path: str, info: _StorageInfo, req: ReadItem, data: memoryview,
                    item_crcs: Mapping[str, str]) -> None:
        expected = item_crcs.get(f"{path}@{info.offset}")
        if expected is None:
            raise CorruptCheckpointError(
                f"{self.uri}: the manifest has no checksum for item {req.storage_index.fqn} "
                f"in {path}; the checkpoint and its manifest disagree", {path: "no checksum"})
        actual = crc32c_hex(data)
        if actual != expected:
            raise CorruptCheckpointError(
                f"object {path!r} of {self.uri} is corrupt: item {req.storage_index.fqn} at "
                f"offset {info.offset} has crc32c {actual}, manifest says {expected}. Fall back "
                "to an earlier checkpoint.", {path: f"crc32c mismatch in {req.storage_index.fqn}"})

    def _deliver(self, req: ReadItem, data: memoryview, planner: LoadPlanner) -> None:
        if req.type == LoadItemType.BYTE_IO:
            raw = bytes(data)
            _refuse_unsafe_pickle(raw, f"{self.uri} item {req.storage_index.fqn}")
            planner.load_bytes(req, io.BytesIO(raw))
            return
        tensor = safe_torch_load(_BufferReader(data), f"{self.uri} item {req.storage_index.fqn}")
        if not isinstance(tensor, torch.Tensor):
            raise CorruptCheckpointError(
                f"{self.uri} item {req.storage_index.fqn} holds a {type(tensor).__name__}, "
                "not a tensor", {req.storage_index.fqn: "not a tensor"})
        for dim, (off, length) in enumerate(zip(req.storage_offsets, req.lengths, strict=True)):
            tensor = tensor.narrow(dim, off, length)
        target = planner.resolve_tensor(req).detach()
        if target.size() != tensor.size():
            raise StateMismatchError(
                f"loading {self.uri}: {req.storage_index.fqn} has shape "
                f"{tuple(tensor.size())} in the checkpoint but {tuple(target.size())} in the "
                "state to load into; the model does not match the checkpoint")
        target.copy_(tensor)
        planner.commit_tensor(req, target)


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


def _coalesce(path: str, members: list[tuple[_StorageInfo, ReadItem]]
              ) -> list[tuple[str, int, int, list[tuple[_StorageInfo, ReadItem]]]]:
    members = sorted(members, key=lambda m: m[0].offset)
    groups: list[tuple[str, int, int, list[tuple[_StorageInfo, ReadItem]]]] = []
    for info, req in members:
        end = info.offset + info.length
        if groups and info.offset - groups[-1][2] <= COALESCE_GAP:
            p, s, e, ms = groups[-1]
            groups[-1] = (p, s, max(e, end), [*ms, (info, req)])
        else:
            groups.append((path, info.offset, end, [(info, req)]))
    return groups
