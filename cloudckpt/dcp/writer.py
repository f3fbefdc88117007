"""Writing DCP checkpoints: :class:`CloudStorageWriter`.

Each rank's items are spread over files of about ``file_size`` bytes, uploaded
in parallel with a CRC32C per item; the coordinator writes ``.metadata`` and
then commits the manifest, create-only.
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, cast

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from cloudckpt.compat.torch_private import StorageInfo
from cloudckpt.core.blobs import BlobArea
from cloudckpt.core.checkpoint import Checkpoint, CheckpointWriter
from cloudckpt.dcp import options as torch_options
from cloudckpt.dcp.base import OnStore
from cloudckpt.dcp.budget import StagedState
from cloudckpt.dcp.devicecopy import Copier, PinnedPool
from cloudckpt.dcp.metadata import DCP_KIND, METADATA_NAME, SUFFIX, pack_item_crcs
from cloudckpt.dcp.records import spread_name
from cloudckpt.dcp.units import (
    BlobFiles,
    ItemInfo,
    own_files,
    sent_figures,
    serialize,
    split_by_size,
)
from cloudckpt.errors import CommitConflictError, ConfigError
from cloudckpt.storage import Store, as_store

log = logging.getLogger(__name__)

#: Target size of one uploaded file; a rank's items are split into files of about this size.
#: About one part (the store's default part size): a file goes up in one PUT and comes
#: back in one GET, and the next file's requests overlap with this one's.
DEFAULT_FILE_SIZE = 16 * 1024 * 1024
#: Most files one rank writes (and uploads at once): the store's default concurrency.
DEFAULT_MAX_FILES = 16
#: With ``key_spread=None``, one sub-prefix per this many ranks (see :func:`auto_spread`).
RANKS_PER_PREFIX = 8


def auto_spread(world_size: int) -> int:
    """Sub-prefixes for a save by ``world_size`` ranks: none up to
    :data:`RANKS_PER_PREFIX` ranks, else the power of two that puts at most that many
    ranks on each. A rank moving 1 GB/s sends up to about 300 requests a second
    (a GET per item of a few MB on resume; a PUT per 16 MiB part, and a create and
    a complete per file, on save), so a prefix takes at most about 2,400 a second,
    within S3's 3,500 PUT/POST and 5,500 GET per prefix (docs/scale.md)."""
    if world_size <= RANKS_PER_PREFIX:
        return 0
    return 1 << (-(-world_size // RANKS_PER_PREFIX) - 1).bit_length()


@dataclass(frozen=True)
class RankFiles:
    """What the coordinator tells each rank about its files: their name prefix, how
    many sub-prefixes they are spread over, and the writer area they go to when the
    coordinator's claim was not fresh (see :class:`CheckpointWriter`)."""

    prefix: str
    key_spread: int
    area: str | None = None

    @staticmethod
    def of_rank(rank: int, key_spread: int, area: str | None = None) -> RankFiles:
        """Rank ``rank``'s files, named after its position as stock DCP does."""
        return RankFiles(f"__{rank}_", key_spread, area)


#: The version string stock ``FileSystemWriter`` writes into ``.metadata``.
DCP_VERSION: str | None
try:
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION as DCP_VERSION
except ImportError:  # pragma: no cover - older torch
    DCP_VERSION = None


class CloudStorageWriter(OnStore, StorageWriter, BlockingAsyncStager):
    """DCP storage writer for any cloudckpt URI (``s3://``, ``gs://``, a path, ...).

    >>> writer = CloudStorageWriter("s3://b/run/step-100")
    >>> dcp.save(state_dict, storage_writer=writer)  # doctest: +SKIP

    A drop-in for torch's ``FileSystemWriter``/``FsspecWriter``. ``overwrite`` has their
    meaning and default: a save onto a URI holding a committed DCP checkpoint replaces
    it (safely: :mod:`cloudckpt.core.replacing`), and with ``overwrite=False`` it is
    refused (:class:`CommitConflictError`) before any rank writes. Their other options
    are taken as cloudckpt's (:mod:`.options`): ``thread_count`` is ``max_files``,
    ``single_file_per_rank=False`` is ``file_per_tensor``, ``sync_files=False`` skips
    fsync on a local path, ``cache_staged_state_dict`` keeps ``dcp.async_save``'s host
    copy for the next save, as theirs does; ``per_thread_copy_ahead`` has no effect
    (tensors are sent from their own memory, within the store's upload window);
    ``_extensions`` and another ``serialization_format`` are refused with a
    :class:`ConfigError` saying why.

    ``key_spread`` > 0 puts each file under one of that many sub-prefixes
    (``"0a/__3_0.distcp"``), so S3 can split a large world size's requests over
    partitions; None (the default) chooses by world size (:func:`auto_spread`:
    none up to 8 ranks, 128 sub-prefixes at 1,024), 0 never spreads. The layout
    is recorded in ``.metadata`` and the manifest, so readers need no listing or
    configuration. Picklable, for process-based async saves.

    ``staged`` (from :class:`~cloudckpt.dcp.budget.BudgetStager`, for async saves)
    makes the writer upload the tensors that were not staged first, in files of
    their own, and release them (:meth:`StagedState.release`) before the rest.

    ``files_of_rank`` names a one-rank save's files as that rank's of a larger job
    (``__3_0.distcp``), so they can join a job-wide checkpoint under the same names.

    ``incremental`` stores every file as a blob of the run's area (the directory
    above the checkpoint; ``blobs`` names another, for a part of a larger save),
    each tensor of at least :data:`~cloudckpt.dcp.units.OWN_FILE_BYTES` in a file of
    its own: a file whose bytes are already there is referenced, not sent again.
    ``file_per_tensor`` lays the files out so without blobs (a local save whose
    drain will send them incrementally).

    A GPU tensor's bytes are copied to host memory in chunks through ``pinned_pool``
    (a :class:`~cloudckpt.dcp.devicecopy.PinnedPool`; None: the process's shared one,
    64 MiB buffers, 256 MiB at most), each chunk checksummed and uploaded while the
    next is copied; the buffers stay for the next save. CPU tensors are sent from
    their own memory, as they are. ``copier`` (a :class:`~cloudckpt.dcp.devicecopy.Copier`)
    replaces that choice whole: other device steps, or CPU tensors through the pool too.
    """

    def __init__(
        self,
        uri: str | Store,
        *,
        storage_options: Mapping[str, Any] | None = None,
        file_size: int = DEFAULT_FILE_SIZE,
        max_files: int | None = None,
        key_spread: int | None = None,
        step: int | None = None,
        metadata: Mapping[str, Any] | None = None,
        staged: StagedState | None = None,
        files_of_rank: int | None = None,
        incremental: bool = False,
        blobs: BlobArea | None = None,
        file_per_tensor: bool = False,
        overwrite: bool = True,
        thread_count: int | None = None,
        single_file_per_rank: bool = True,
        sync_files: bool = True,
        per_thread_copy_ahead: int | None = None,
        cache_staged_state_dict: bool = False,
        _extensions: Sequence[Any] | None = None,
        serialization_format: Any = None,
        pinned_pool: PinnedPool | None = None,
        copier: Copier | None = None,
    ) -> None:
        BlockingAsyncStager.__init__(
            self, cache_staged_state_dict=torch_options.flag("cache_staged_state_dict",
                                                              cache_staged_state_dict))
        torch_opts = torch_options.TorchOptions(
            thread_count, single_file_per_rank, sync_files, per_thread_copy_ahead,
            _extensions, serialization_format)
        torch_options.check(torch_opts)
        max_files = torch_options.max_files(torch_opts, max_files, DEFAULT_MAX_FILES)
        if file_size <= 0 or max_files < 1 or (key_spread is not None and key_spread < 0):
            raise ConfigError("file_size and max_files must be positive, key_spread >= 0 "
                              "(or None: chosen by world size)")
        self.overwrite = torch_options.flag("overwrite", overwrite)
        self.storage_options = torch_options.storage_options(uri, torch_opts, storage_options)
        self.store = as_store(uri, self.storage_options)
        self.file_size = file_size
        self.max_files = max_files
        self.key_spread = key_spread
        self.step = step
        self.user_metadata = dict(metadata or {})
        self.staged = staged
        self.files_of_rank = files_of_rank
        self.file_per_tensor = file_per_tensor or not single_file_per_rank
        self.incremental = incremental or blobs is not None
        self._own_area = blobs is None
        self.blobs = blobs or (BlobArea.above(self.store, 1) if incremental else None)
        self.is_coordinator = False
        self.rank = 0
        self._spread = key_spread or 0  # the coordinator's choice, once it has planned
        self.committed: Checkpoint | None = None
        self._writer: CheckpointWriter | None = None
        #: How GPU tensors' bytes reach the upload (see ``pinned_pool``).
        self.copier = copier or Copier(pinned_pool)

    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id:
            self.store = as_store(str(checkpoint_id), self.storage_options)
            if self.incremental and self._own_area:
                self.blobs = BlobArea.above(self.store, 1)
        self.committed = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank") or 0)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.uri)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # The coordinator claims the prefix before any rank writes into it: a save to a
        # URI another one is writing stops here (CommitConflictError, on every rank), and
        # so does one onto a committed checkpoint unless it is to replace it (then every
        # rank writes under the save's own writer area: nothing committed is touched).
        area = self.claim(len(plans))
        if self.files_of_rank is not None:
            if len(plans) != 1:
                raise ConfigError("files_of_rank names the files of a one-rank save; this "
                                  f"save has {len(plans)} ranks")
            return [dataclasses.replace(plans[0], storage_data=RankFiles.of_rank(
                self.files_of_rank, self._spread, area))]
        return [dataclasses.replace(p, storage_data=RankFiles.of_rank(i, self._spread, area))
                for i, p in enumerate(plans)]

    def claim(self, world_size: int) -> str | None:
        """Coordinator only: claim the prefix for a save by ``world_size`` ranks and
        choose its spread; returns the writer area every rank's files go under (None:
        the objects' own paths)."""
        self._writer = self._checkpoint_writer()
        self._writer.claim()
        self._spread = self.spread_for(world_size)
        return self._writer.moving

    def spread_for(self, world_size: int) -> int:
        """The sub-prefixes of a save by ``world_size`` ranks (see ``key_spread``)."""
        return auto_spread(world_size) if self.key_spread is None else self.key_spread

    def _checkpoint_writer(self) -> CheckpointWriter:
        try:
            return CheckpointWriter(self.store, step=self.step, kind=DCP_KIND,
                                    blobs=self.blobs, replace=self.overwrite)
        except CommitConflictError as exc:
            raise CommitConflictError(
                f"Checkpoint already exists: one is already committed at {self.uri}, and "
                "overwrite=False. A save with overwrite=True (torch's default) replaces it, "
                "keeping it until the new one commits; or save to a new URI.") from exc

    def release_claim(self) -> None:
        """After a failed save: let a retry of it claim the prefix at once."""
        if self._writer is not None and self.committed is None:
            self._writer.abandon()

    @staticmethod
    def _file_name(files: RankFiles, i: int) -> str:
        return spread_name(f"{files.prefix}{i}{SUFFIX}", files.key_spread)

    def rank_store(self, files: RankFiles) -> Store:
        """Where a rank writes its files: the writer area its coordinator chose."""
        return self.store if files.area is None or self.store.written_under else \
            self.store.writing_under(files.area)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        files = plan.storage_data
        if not isinstance(files, RankFiles):  # planned elsewhere: name after this rank
            files = RankFiles.of_rank(self.rank, self.key_spread or 0)
        store = self.rank_store(files)
        fut: Future[list[WriteResult]] = Future()
        try:
            results: list[WriteResult] = []
            written = 0  # files are numbered on across waves
            blobs = None if self.blobs is None else BlobFiles(self.blobs, self.store, planner,
                                                              self.copier)
            write = blobs.write if blobs else partial(self._write_file, store=store,
                                                      planner=planner)
            for k, items in enumerate(self._waves(plan.items, planner)):
                buckets = (own_files(items, self.file_size, self.max_files)
                           if blobs or self.file_per_tensor
                           else split_by_size(items, self.file_size, self.max_files))
                jobs = [(self._file_name(files, written + i), b)
                        for i, b in enumerate(b for b in buckets if b)]
                written += len(jobs)
                per_file = self.store.map(lambda job: write(*job), jobs)
                results += [r for rs in per_file for r in rs]
                if self.staged is not None and k == 0:
                    if blobs:
                        blobs.settle()  # the live tensors' bytes may be needed again
                    self.staged.release()  # the live tensors are written: training may go on
            if blobs:
                blobs.settle()
        except Exception as exc:  # noqa: BLE001 - handed to DCP through the future
            # (an interrupt propagates: a torch Future cannot hold it; torch types the
            # argument as the result's)
            fut.set_exception(exc)  # type: ignore[arg-type]
            return fut
        finally:
            if self.staged is not None:
                self.staged.release()
        fut.set_result(results)
        return fut

    def _waves(self, items: Sequence[WriteItem], planner: SavePlanner) -> list[list[WriteItem]]:
        """The items in the order they must go: with a staged state, the live tensors
        (not copied to host memory) first, then the staged copies and other values."""
        if self.staged is None or not self.staged.live_bytes:
            return [list(items)]
        live = {k for k, i in enumerate(items) if i.type != WriteItemType.BYTE_IO
                and not self.staged.is_staged(cast(torch.Tensor, planner.resolve_data(i)))}
        return [[i for k, i in enumerate(items) if k in live],
                [i for k, i in enumerate(items) if k not in live]]

    def _write_file(self, name: str, items: Sequence[WriteItem], *, store: Store,
                    planner: SavePlanner) -> list[WriteResult]:
        with store.open_write(name) as out:
            placed = serialize(items, planner, out, self.copier)
        info = out.info
        assert info is not None and info.crc32c is not None
        return [
            WriteResult(index=item.index, size_in_bytes=length,
                        storage_data=ItemInfo(name, offset, length, None, crc, info.size,
                                              info.crc32c))
            for item, offset, length, crc in placed
        ]

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator only: write ``.metadata``, then commit the manifest."""
        storage: dict[MetadataIndex, StorageInfo] = {}
        items: list[tuple[str, int, str]] = []
        files: dict[str, tuple[int, str, str | None, bool]] = {}
        for result in (r for rank_results in results for r in rank_results):
            sd = result.storage_data
            storage[result.index] = StorageInfo(sd.relative_path, sd.offset, sd.length)
            files[sd.relative_path] = (sd.file_size, sd.file_crc32c, sd.blob, sd.sent)
            items.append((sd.relative_path, sd.offset, sd.crc32c))
        metadata.storage_data = storage
        if DCP_VERSION is not None:
            metadata.version = DCP_VERSION
        metadata.storage_meta = self.storage_meta()
        dcp_doc: dict[str, Any] = {"item_crcs": pack_item_crcs(items),
                                   "key_spread": self._spread}
        if self.blobs is not None:
            dcp_doc["incremental"] = sent_figures(files.values())
        self.commit_files(files, dcp_doc, {METADATA_NAME: pickle.dumps(metadata)})
        log.info("DCP checkpoint committed at %s: %d files, %d items", self.uri, len(files),
                 len(items))

    def commit_files(self, files: Mapping[str, tuple[int, str, str | None, bool]],
                     dcp_doc: Mapping[str, Any], objects: Mapping[str, bytes]) -> Checkpoint:
        """Coordinator only: commit the checkpoint of the ranks' ``files`` (name ->
        size, CRC32C, blob, sent), with ``dcp_doc`` as the manifest's ``dcp`` metadata,
        after writing ``objects`` (name -> bytes: the format's metadata)."""
        writer = self._writer or self._checkpoint_writer()
        writer.metadata = {**self.user_metadata, "dcp": dict(dcp_doc)}
        for name, (size, crc, blob, _) in sorted(files.items()):
            writer.add_existing(name, size, crc, blob, blob is None and writer.moving is not None)
        for name, data in objects.items():
            writer.put(name, data)
        self.committed = writer.commit()
        return self.committed
