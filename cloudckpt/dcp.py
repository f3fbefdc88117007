"""torch.distributed.checkpoint (DCP) straight to object storage.

``CloudStorageWriter``/``CloudStorageReader`` implement DCP's public
``StorageWriter``/``StorageReader``: the planner decides what to write, these
decide how. The on-store format is DCP's own (``__{rank}_{i}.distcp`` files of
``torch.save``-serialised items and a pickled ``.metadata``), so a checkpoint
copied to local disk loads with stock ``FileSystemReader``. On top of it:

- every rank uploads its files in parallel (multipart, several parts in flight);
- the coordinator writes ``.metadata`` and then the cloudckpt manifest,
  create-only, listing every rank's files with their CRC32C; no manifest, no
  checkpoint (a failed rank means no commit);
- each item's CRC32C is recorded in the manifest, so readers verify exactly the
  bytes they fetch, even when resharding reads only parts of a file;
- ``.metadata`` is unpickled with an allowlist and byte items are checked with
  ``weights_only=True`` before DCP's planner sees them: nothing in a checkpoint
  can execute code on load.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import pickle
import re
import sys
import zlib
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future as ConcurrentFuture
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from .checkpoint import Checkpoint, CheckpointWriter, open_checkpoint, read_manifest
from .crc import Crc32c, crc32c_hex
from .errors import (
    CloudCkptError,
    CommitConflictError,
    ConfigError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    StateMismatchError,
    StorageError,
)
from .manifest import MANIFEST_NAME
from .ownership import COMMITTED, EMPTY, ROOT, survey
from .state import refusal, safe_torch_load
from .storage import Store, as_store, split_uri

log = logging.getLogger("cloudckpt.dcp")

__all__ = [
    "CloudStorageReader",
    "CloudStorageWriter",
    "adopt",
    "async_save",
    "load",
    "load_metadata",
    "save",
]

METADATA_NAME = ".metadata"
SUFFIX = ".distcp"
DCP_KIND = "dcp"
#: Target size of one uploaded file; a rank's items are split into files of about this size.
#: About one part (the store's default part size): a file goes up in one PUT and comes
#: back in one GET, and the next file's requests overlap with this one's.
DEFAULT_FILE_SIZE = 16 * 1024 * 1024
#: Most files one rank writes (and uploads at once): the store's default concurrency.
DEFAULT_MAX_FILES = 16
#: Bytes a reader requests ahead of what it has consumed, at most (one range may exceed it).
DEFAULT_READ_WINDOW = 256 * 1024 * 1024
#: Adjacent items closer than this are fetched with one ranged GET.
COALESCE_GAP = 1024 * 1024

try:  # the version string stock FileSystemWriter writes
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION as _DCP_VERSION
except ImportError:  # pragma: no cover - older torch
    _DCP_VERSION = None


@dataclass
class _ItemInfo(_StorageInfo):
    """Where an item went, plus what the coordinator needs for the manifest.

    Travels from each rank to the coordinator inside WriteResults; the
    coordinator writes plain ``_StorageInfo`` into ``.metadata``.
    """

    crc32c: str | None = None
    file_size: int | None = None
    file_crc32c: str | None = None


def _valid_id(checkpoint_id: Any) -> bool:
    try:
        split_uri(str(checkpoint_id))
    except ConfigError:
        return False
    return True


class _OnStore:
    """What the writer and the reader share: a store, its URI, URI validation."""

    store: Store

    @property
    def uri(self) -> str:
        return self.store.uri

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return _valid_id(checkpoint_id)


# --------------------------------------------------------------------- writing


class CloudStorageWriter(_OnStore, StorageWriter):
    """DCP storage writer for any cloudckpt URI (``s3://``, ``gs://``, a path, ...).

    >>> writer = CloudStorageWriter("s3://b/run/step-100")
    >>> dcp.save(state_dict, storage_writer=writer)  # doctest: +SKIP

    ``key_spread`` > 0 puts each file under one of that many sub-prefixes
    (``"0a/__3_0.distcp"``), so S3 can split a large world size's requests over
    partitions; the layout is recorded in ``.metadata`` and the manifest, so
    readers need no configuration. Picklable, for process-based async saves.
    """

    def __init__(
        self,
        uri: str | Store,
        *,
        storage_options: Mapping[str, Any] | None = None,
        file_size: int = DEFAULT_FILE_SIZE,
        max_files: int = DEFAULT_MAX_FILES,
        key_spread: int = 0,
        step: int | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if file_size <= 0 or max_files < 1 or key_spread < 0:
            raise ConfigError("file_size and max_files must be positive, key_spread >= 0")
        self.storage_options = dict(storage_options or {})
        self.store = as_store(uri, self.storage_options)
        self.file_size = file_size
        self.max_files = max_files
        self.key_spread = key_spread
        self.step = step
        self.user_metadata = dict(metadata or {})
        self.is_coordinator = False
        self.rank = 0
        self.committed: Checkpoint | None = None
        self._writer: CheckpointWriter | None = None

    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id:
            self.store = as_store(str(checkpoint_id), self.storage_options)
        self.committed = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank") or 0)
        if is_coordinator and self.store.exists(MANIFEST_NAME):
            # Refuse before any rank writes: objects of a committed checkpoint
            # must never be overwritten.
            raise CommitConflictError(
                f"a checkpoint is already committed at {self.uri}; DCP checkpoints are "
                "immutable here. Save to a new URI (e.g. one per step) or delete it first."
            )

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.uri)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # The coordinator claims the prefix before any rank writes into it: a second
        # save to the same URI stops here instead of overwriting this one's files.
        self._writer = CheckpointWriter(self.store, step=self.step, kind=DCP_KIND)
        self._writer.claim()
        # Each rank's files are named after its position, as stock DCP does.
        return [dataclasses.replace(p, storage_data=f"__{i}_") for i, p in enumerate(plans)]

    def release_claim(self) -> None:
        """After a failed save: let a retry of it claim the prefix at once."""
        if self._writer is not None and self.committed is None:
            self._writer.abandon()

    def _file_name(self, prefix: str, i: int) -> str:
        name = f"{prefix}{i}{SUFFIX}"
        if self.key_spread:
            bucket = zlib.crc32(name.encode()) % self.key_spread
            return f"{bucket:0{max(2, len(f'{self.key_spread - 1:x}'))}x}/{name}"
        return name

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        prefix = plan.storage_data if isinstance(plan.storage_data, str) else f"__{self.rank}_"
        buckets = _split_by_size(plan.items, self.file_size, self.max_files)
        jobs = [(self._file_name(prefix, i), b) for i, b in enumerate(buckets) if b]
        fut: Future[list[WriteResult]] = Future()
        try:
            per_file = self.store.map(lambda job: self._write_file(job[0], job[1], planner), jobs)
        except BaseException as exc:  # noqa: BLE001 - handed to DCP through the future
            fut.set_exception(exc)
            return fut
        fut.set_result([r for results in per_file for r in results])
        return fut

    def _write_file(self, name: str, items: Sequence[WriteItem],
                    planner: SavePlanner) -> list[WriteResult]:
        placed: list[tuple[WriteItem, int, int, str]] = []
        with self.store.open_write(name) as out:
            sink = _Sink(out)
            for item in items:
                data = planner.resolve_data(item)
                start = sink.start_item()
                if item.type == WriteItemType.BYTE_IO:
                    sink.write(data.getbuffer())
                else:
                    torch.save(_cpu_compact(data), sink)
                placed.append((item, start, sink.pos - start, sink.item_crc()))
        info = out.info
        assert info is not None and info.crc32c is not None
        return [
            WriteResult(index=item.index, size_in_bytes=length,
                        storage_data=_ItemInfo(name, offset, length, None, crc, info.size,
                                               info.crc32c))
            for item, offset, length, crc in placed
        ]

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator only: write ``.metadata``, then commit the manifest."""
        storage: dict[MetadataIndex, _StorageInfo] = {}
        files: dict[str, tuple[int, str]] = {}
        items: dict[str, str] = {}
        for result in (r for rank_results in results for r in rank_results):
            sd = result.storage_data
            storage[result.index] = _StorageInfo(sd.relative_path, sd.offset, sd.length)
            files[sd.relative_path] = (sd.file_size, sd.file_crc32c)
            items[f"{sd.relative_path}@{sd.offset}"] = sd.crc32c
        metadata.storage_data = storage
        if _DCP_VERSION is not None:
            metadata.version = _DCP_VERSION
        metadata.storage_meta = self.storage_meta()
        writer = self._writer or CheckpointWriter(self.store, step=self.step, kind=DCP_KIND)
        writer.metadata = {**self.user_metadata,
                           "dcp": {"items": items, "key_spread": self.key_spread}}
        for name, (size, crc) in sorted(files.items()):
            writer.add_existing(name, size, crc)
        writer.put(METADATA_NAME, pickle.dumps(metadata))
        self.committed = writer.commit()
        log.info("DCP checkpoint committed at %s: %d files, %d items", self.uri, len(files),
                 len(items))


class _Sink:
    """Write-only stream that tracks position and a CRC32C per item."""

    def __init__(self, out: Any) -> None:
        self._out = out
        self.pos = 0
        self._crc = Crc32c()

    def start_item(self) -> int:
        self._crc = Crc32c()
        return self.pos

    def item_crc(self) -> str:
        return self._crc.hexdigest()

    def write(self, data: Any) -> int:
        n = self._out.write(data)
        self._crc.update(data)
        self.pos += n
        return n

    def flush(self) -> None:
        pass


def _cpu_compact(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor that owns exactly its bytes (``torch.save`` writes whole storages)."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size() or not t.is_contiguous():
        t = t.clone(memory_format=torch.contiguous_format)
    return t


def _item_bytes(item: WriteItem) -> int:
    if item.tensor_data is None:
        return 1024
    n = 1
    for s in item.tensor_data.size:
        n *= s
    return n * torch._utils._element_size(item.tensor_data.properties.dtype)


def _split_by_size(items: Sequence[WriteItem], file_size: int,
                   max_files: int) -> list[list[WriteItem]]:
    """Spread items over files of about ``file_size`` bytes (largest first, to the emptiest)."""
    total = sum(_item_bytes(i) for i in items)
    n = max(1, min(max_files, len(items), -(-total // file_size)))
    buckets: list[list[WriteItem]] = [[] for _ in range(n)]
    sizes = [0] * n
    for item in sorted(items, key=_item_bytes, reverse=True):
        k = sizes.index(min(sizes))
        buckets[k].append(item)
        sizes[k] += _item_bytes(item)
    return buckets


# --------------------------------------------------------------------- reading


_ALLOWED_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP ``.metadata`` and nothing else: no callable outside an allowlist."""

    def find_class(self, module: str, name: str) -> Any:
        if "." in name:  # protocol 4 resolves dotted names: "os.system" via a module's imports
            raise pickle.UnpicklingError(f"dotted global {module}.{name} is not allowed in "
                                         "DCP metadata")
        if module == "torch.distributed.checkpoint.metadata":
            # Only the classes the module defines, not what it imports (os, torch, ...).
            obj = getattr(sys.modules.get(module), name, None)
            if isinstance(obj, type) and obj.__module__ == module:
                return obj
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in DCP metadata")


def load_metadata(data: bytes, *, source: str = METADATA_NAME) -> Metadata:
    """Unpickle DCP metadata without executing anything outside DCP's own types."""
    try:
        md = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as exc:  # noqa: BLE001 - any failure means: do not trust it
        raise CorruptCheckpointError(
            f"{source} is not safe DCP metadata ({exc}); refusing to load it", {source: str(exc)}
        ) from None
    if not isinstance(md, Metadata):
        raise CorruptCheckpointError(f"{source} does not hold DCP Metadata", {source: "type"})
    return md


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


# ----------------------------------------------------------------------- adopt


def adopt(uri: str | Store, storage_options: Mapping[str, Any] | None = None, *,
          step: int | None = None) -> Checkpoint:
    """Commit a DCP checkpoint written without cloudckpt (e.g. stock ``FileSystemWriter``
    output uploaded to a bucket).

    Reads ``.metadata`` safely, checks that every file it references exists and
    covers every item, checksums every file and item, and writes the manifest
    create-only. Raises :class:`CorruptCheckpointError` naming what is missing.
    """
    store = as_store(uri, storage_options)
    found = survey(store)
    if found.kind == COMMITTED:
        raise CommitConflictError(f"{store.uri} is already committed; nothing to adopt")
    if found.kind in (EMPTY, ROOT):  # nothing there, or checkpoints below: say which
        read_manifest(store)
    try:
        raw_md = store.get(METADATA_NAME)
    except FileNotFoundError:
        raise CorruptCheckpointError(
            f"{store.uri} has no .metadata: it is not a complete DCP checkpoint",
            {METADATA_NAME: "missing"}) from None
    md = load_metadata(raw_md, source=store.key_uri(METADATA_NAME))
    needed: dict[str, list[_StorageInfo]] = {}
    for info in (md.storage_data or {}).values():
        needed.setdefault(info.relative_path, []).append(info)
    listed = {o.key: o.size for o in store.list()}
    problems = {}
    for path, infos in needed.items():
        if path not in listed:
            problems[path] = "missing"
        elif max(i.offset + i.length for i in infos) > listed[path]:
            problems[path] = f"short: {listed[path]} bytes, items need more"
    if problems:
        raise CorruptCheckpointError(
            f"cannot adopt {store.uri}: " + ", ".join(f"{p} ({w})" for p, w in problems.items()),
            problems)
    writer = CheckpointWriter(store, step=step, kind=DCP_KIND, adopting=True)
    try:
        return _adopt(store, writer, needed, raw_md)
    except BaseException:
        writer.abandon()  # removes its claim: the objects stay someone else's
        raise


def _adopt(store: Store, writer: CheckpointWriter, needed: dict[str, list[_StorageInfo]],
           raw_md: bytes) -> Checkpoint:
    items: dict[str, str] = {}

    def checksum(path: str) -> tuple[str, int, str, dict[str, str]]:
        data = store.get(path)
        crcs = {f"{path}@{i.offset}": crc32c_hex(memoryview(data)[i.offset:i.offset + i.length])
                for i in needed[path]}
        return path, len(data), crc32c_hex(data), crcs

    for path, size, crc, crcs in store.map(checksum, sorted(needed)):
        writer.add_existing(path, size, crc)
        items.update(crcs)
    writer.add_existing(METADATA_NAME, len(raw_md), crc32c_hex(raw_md))
    writer.metadata["dcp"] = {"items": items, "key_spread": 0, "adopted": True}
    return writer.commit()


# ------------------------------------------------------------ convenience API


@contextmanager
def _unwrapped(what: str) -> Iterator[None]:
    """DCP wraps every rank's failure in ``CheckpointException`` (a BaseException, which
    ``except Exception`` misses); raise a cloudckpt error instead, so callers can catch
    ours: the first cloudckpt error inside, else :func:`_translate`'s."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as exc:
        raise _ours(exc) or _translate(exc, what) from exc


def _failures(exc: BaseException) -> list[tuple[int, BaseException]]:
    out = []
    for rank, failure in sorted(getattr(exc, "failures", {}).items()):
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, BaseException):
            out.append((rank, inner))
    return out


def _ours(exc: BaseException) -> CloudCkptError | None:
    for _, inner in _failures(exc):
        if isinstance(inner, CloudCkptError):
            return inner
    return None


_SIZE_MISMATCH = re.compile(r"Size mismatch between saved (?P<saved>.+?) and current: "
                            r"(?P<current>.+?) for (?P<key>\S+)")
_MISSING_KEY = re.compile(r"Missing key in checkpoint state_dict: (?P<key>\S+?)\.?$")


def _translate(exc: BaseException, what: str) -> CloudCkptError:
    """A cloudckpt error for a failure DCP reported: the state to load not matching the
    checkpoint (a key's shape, a key the checkpoint lacks) is a
    :class:`StateMismatchError` naming the key; anything else a :class:`StorageError`."""
    failures = _failures(exc)
    if not failures:
        return StorageError(f"{what} failed: {refusal(exc)}")
    rank, inner = failures[0]
    text = refusal(inner)
    m = _SIZE_MISMATCH.search(str(inner))
    if m:
        return StateMismatchError(
            f"{what}: {m['key']} has shape {_shape(m['saved'])} in the checkpoint but "
            f"{_shape(m['current'])} in the state to load into. The model (or optimizer) does "
            "not match the checkpoint: build it with the configuration it was saved with.")
    m = _MISSING_KEY.search(str(inner))
    if m:
        return StateMismatchError(
            f"{what}: the state to load into has {m['key']}, which the checkpoint lacks. The "
            "model does not match the checkpoint; load with a matching model, or drop the key "
            "(or pass a planner allowing partial loads, e.g. DefaultLoadPlanner("
            "allow_partial_load=True)).")
    if isinstance(inner, (ValueError, KeyError, TypeError)):
        return StateMismatchError(f"{what} failed on rank {rank}: {type(inner).__name__}: "
                                  f"{text}; the state to load does not match the checkpoint")
    return StorageError(f"{what} failed on rank {rank}: {type(inner).__name__}: {text}")


def _shape(torch_size: str) -> str:
    """``torch.Size([3, 4])`` -> ``(3, 4)``."""
    m = re.fullmatch(r"torch\.Size\(\[(.*)\]\)", torch_size.strip())
    return f"({m[1]})" if m else torch_size


def _no_dist() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized())


def save(
    state_dict: dict[str, Any],
    uri: str | Store,
    *,
    storage_options: Mapping[str, Any] | None = None,
    process_group: Any = None,
    planner: SavePlanner | None = None,
    step: int | None = None,
    metadata: Mapping[str, Any] | None = None,
    **writer_options: Any,
) -> Checkpoint | None:
    """``dcp.save`` to ``uri`` with a :class:`CloudStorageWriter`; cloudckpt errors
    are raised as themselves. Returns the committed checkpoint on the coordinator."""
    import torch.distributed.checkpoint as dcp

    writer = CloudStorageWriter(uri, storage_options=storage_options, step=step,
                                metadata=metadata, **writer_options)
    try:
        with _unwrapped(f"saving {writer.uri}"):
            dcp.save(state_dict, storage_writer=writer, planner=planner,
                     process_group=process_group, no_dist=_no_dist())
    except BaseException:
        writer.release_claim()
        raise
    return writer.committed


def load(
    state_dict: dict[str, Any],
    uri: str | Store,
    *,
    storage_options: Mapping[str, Any] | None = None,
    process_group: Any = None,
    planner: LoadPlanner | None = None,
) -> None:
    """``dcp.load`` in place from the committed DCP checkpoint at ``uri``.

    The manifest is read first, so a missing, torn or unadopted checkpoint raises
    :class:`CheckpointNotFoundError`/:class:`IncompleteCheckpointError` at once.
    """
    import torch.distributed.checkpoint as dcp

    reader = CloudStorageReader(uri, storage_options=storage_options)
    reader.read_metadata()  # manifest and metadata problems surface as our own errors
    with _unwrapped(f"loading {reader.uri}"):
        dcp.load(state_dict, storage_reader=reader, planner=planner,
                 process_group=process_group, no_dist=_no_dist())


# ----------------------------------------------------------------------- async


def async_save(
    state_dict: dict[str, Any],
    uri: str | Store,
    *,
    storage_options: Mapping[str, Any] | None = None,
    process_group: Any = None,
    planner: SavePlanner | None = None,
    step: int | None = None,
    metadata: Mapping[str, Any] | None = None,
    **writer_options: Any,
) -> ConcurrentFuture:
    """Save with only staging on the caller's thread; the upload runs in the background.

    Staging copies every tensor to host memory (pinned, with non-blocking
    copies, when CUDA is available) before this returns; then DCP's save runs
    on a background thread. ``result()`` on the returned future returns the
    DCP metadata once the checkpoint is committed, or raises what went wrong.
    Use a gloo process group (or ``cpu:gloo,cuda:nccl``) for the background
    collectives.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    cuda = torch.cuda.is_available()
    stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                          use_async_staging=False, use_non_blocking_copy=cuda))
    writer = CloudStorageWriter(uri, storage_options=storage_options, step=step,
                                metadata=metadata, **writer_options)
    inner = dcp.async_save(state_dict, storage_writer=writer, planner=planner,
                           process_group=process_group, async_stager=stager,
                           no_dist=_no_dist())
    outer: ConcurrentFuture = ConcurrentFuture()

    def done(f: Any) -> None:
        stager.close()
        try:
            outer.set_result(f.result())
        except BaseException as exc:  # noqa: BLE001 - surfaced on result()
            writer.release_claim()
            outer.set_exception(_ours(exc) or (_translate(exc, f"saving {writer.uri}")
                                               if _failures(exc) else exc))

    inner.add_done_callback(done)
    return outer
