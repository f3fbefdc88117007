"""The indexed DCP save: planned on every rank alone, checked in one O(1) collective.

torch's ``dcp.save`` gathers every rank's plan on the coordinator, validates and
merges them (quadratic in places) and writes a ``.metadata`` listing every chunk:
all of it grows with ranks. Here every rank plans its own items, infers each
tensor's :class:`~cloudckpt.dcp.rules.Rule` from its own chunk and digests the
save's structure; one all-reduce of a few integers tells every rank whether all
agree. If they do, the structure is the same everywhere, so what the coordinator
knows of its own state describes every rank's: nothing is gathered to plan. Each
rank writes its items (a whole tensor or a non-tensor value only on its owner
rank) and its records; one gather of each rank's short file list lets the
coordinator write the index and commit.

The plan derived from a structure is kept by its digest, so the next save with the
same structure builds nothing (:data:`STATS` counts both). A state whose chunks
follow no rule, ranks that disagree, an incremental save or a planner with
global planning of its own take the classic path (torch's ``dcp.save``), said
once in the log.
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, cast

from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from cloudckpt.core.checkpoint import Checkpoint
from cloudckpt.dcp.metadata import METADATA_NAME
from cloudckpt.dcp.records import (
    INDEX_NAME,
    INDEXED_FORMAT,
    BytesEntry,
    Index,
    Location,
    RankRecords,
    Record,
    TensorEntry,
    records_name,
    stock_metadata,
    structure_digest,
    tensor_order,
)
from cloudckpt.dcp.rules import WHOLE, Rule, infer_rule, owner
from cloudckpt.dcp.units import ItemInfo
from cloudckpt.dcp.writer import DCP_VERSION, CloudStorageWriter, RankFiles
from cloudckpt.runtime import coordination as coord

log = logging.getLogger(__name__)

#: Chunks (a tensor's chunks over all ranks, plus one per whole tensor and
#: non-tensor item) up to which the coordinator also writes a stock ``.metadata``,
#: so stock readers load the checkpoint as it is. Building it from the records and
#: pickling it cost 36 us of CPU a chunk (``benchmarks/dcp_index_bench.py``: 2,100
#: tensors at 8 and 64 ranks, on 2 cores shared at a load average of 19), so this
#: bounds that work to under 2 s there (a Llama-70B-shaped state with Adam up to
#: about 20 ranks); a larger job's ``.metadata`` comes from ``cloudckpt download``
#: or ``cloudckpt dcp stock`` instead.
SMALL_JOB_CHUNKS = 50_000

#: Plans kept, by structure digest (a training job alternates between a few).
_CACHED_PLANS = 4


@dataclass
class Stats:
    """What this process's indexed saves did: plans built from a structure, plans
    reused from the previous save of the same structure, saves that took the
    classic path."""

    plans_built: int = 0
    plans_reused: int = 0
    classic: int = 0


STATS = Stats()


@dataclass
class Plan:
    """What every rank derives alike from a save's structure (cached by digest): the
    index without the whole items' locations, and each tensor's position in it."""

    digest: int
    world_size: int
    key_spread: int
    tensors: list[TensorEntry]
    byte_fqns: list[str]
    planner_data: dict[str, tuple[str | int, ...]] | None
    position: dict[str, int] = field(default_factory=dict)
    small: bool = False


_plans: dict[int, Plan] = {}
_said: set[str] = set()


@dataclass
class Prepared:
    """One rank's save after the structure check: its planner and local plan, and
    the plan every rank shares."""

    planner: SavePlanner
    local: SavePlan
    plan: Plan
    rank: int


@dataclass
class RankOutcome:
    """What a rank tells the coordinator once its files are written: each file
    (name -> size, CRC32C, blob, sent), the whole items it owns and where they went,
    and on a small job its records (for ``.metadata``)."""

    files: dict[str, tuple[int, str, str | None, bool]]
    located: list[tuple[str, Location]]
    records: RankRecords | None


def prepare(state_dict: dict[str, Any], writer: CloudStorageWriter,
            planner: SavePlanner | None, group: Any) -> Prepared | None:
    """Plan this rank's items and check, with every rank at once, that the indexed
    format describes the save; None (on every rank alike) when the save must take
    the classic path. A failure on any rank raises on every rank."""
    rank, world = coord.rank(group), coord.world_size(group)
    reason = _unsupported(writer, planner)
    error: Exception | None = None
    digest = 0
    shape: Shape | None = None
    local: SavePlan | None = None
    planner = planner or DefaultSavePlanner()
    if reason is None:
        try:
            planner.set_up_planner(state_dict, writer.storage_meta(), rank == 0)
            writer.set_up_storage_writer(rank == 0, rank=rank)
            local = planner.create_local_plan()
            found = _structure(local, rank, world, writer.spread_for(world))
            if isinstance(found, str):
                reason = found
            else:
                shape, digest = found, found[0]
        except Exception as exc:  # noqa: BLE001 - every rank raises it below
            error = exc
    low, high, irregular, failed = coord.all_reduce_max_ints(
        [-digest, digest, int(reason is not None), int(error is not None)], group)
    if failed:
        coord.agree(error, group)  # raises on every rank
    if irregular or -low != high:
        _classic(writer, reason or ("another rank's state is irregular" if irregular else
                                    "the ranks' states differ in structure"))
        return None
    assert shape is not None and local is not None  # no rank was irregular
    return Prepared(planner, local, _plan(*shape, world, writer.spread_for(world), local),
                    rank)


def _unsupported(writer: CloudStorageWriter, planner: SavePlanner | None) -> str | None:
    if writer.incremental:
        return "incremental saves keep the classic format"
    if writer.files_of_rank is not None:
        return "a one-rank save named as another rank's keeps the classic format"
    if planner is not None and (
            not isinstance(planner, DefaultSavePlanner)
            or type(planner).create_global_plan is not DefaultSavePlanner.create_global_plan):
        return f"the planner {type(planner).__name__} plans globally on its own"
    return None


Shape = tuple[int, dict[str, tuple[tuple[int, ...], TensorProperties, Rule]], list[str]]


def _structure(local: SavePlan, rank: int, world: int, spread: int) -> Shape | str:
    """This rank's structure (digest, tensors by name, non-tensor names), or why the
    indexed format cannot describe it."""
    if not local.usable:
        return "the planner skipped its local plan (plan caching of its own)"
    tensors: dict[str, tuple[tuple[int, ...], TensorProperties, Rule]] = {}
    byte_fqns: list[str] = []
    for item in local.items:
        fqn = item.index.fqn
        if item.type == WriteItemType.BYTE_IO:
            byte_fqns.append(fqn)
            continue
        td = item.tensor_data
        if td is None or fqn in tensors:
            return f"{fqn} is held in more than one chunk by rank {rank}"
        size = tuple(td.size)
        rule = infer_rule(size, td.chunk.offsets, td.chunk.sizes, rank, world)
        if rule is None:
            return f"{fqn}'s chunks are not a regular split over the ranks"
        tensors[fqn] = (size, td.properties, rule)
    if len(set(byte_fqns)) != len(byte_fqns) or set(byte_fqns) & tensors.keys():
        return "an item is named twice"
    mappings = local.planner_data if isinstance(local.planner_data, dict) else None
    digest = structure_digest(world, spread, ((f, s, p, r) for f, (s, p, r) in tensors.items()),
                              byte_fqns, mappings)
    return digest, tensors, byte_fqns


def _plan(digest: int, tensors: dict[str, tuple[tuple[int, ...], TensorProperties, Rule]],
          byte_fqns: list[str], world: int, spread: int, local: SavePlan) -> Plan:
    cached = _plans.get(digest)
    if cached is not None:
        STATS.plans_reused += 1
        return cached
    STATS.plans_built += 1
    entries = sorted((TensorEntry(f, s, p, r) for f, (s, p, r) in tensors.items()),
                     key=lambda t: tensor_order(t.fqn, t.size, t.rule))
    chunks = sum(1 if t.rule.kind == WHOLE else t.rule.parts for t in entries) + len(byte_fqns)
    mappings = local.planner_data if isinstance(local.planner_data, dict) else None
    plan = Plan(digest, world, spread, entries, sorted(byte_fqns),
                None if mappings is None else {k: tuple(v) for k, v in mappings.items()},
                {t.fqn: i for i, t in enumerate(entries)}, chunks <= SMALL_JOB_CHUNKS)
    while len(_plans) >= _CACHED_PLANS:
        _plans.pop(next(iter(_plans)))
    _plans[digest] = plan
    return plan


def _classic(writer: CloudStorageWriter, reason: str) -> None:
    STATS.classic += 1
    if reason not in _said:
        _said.add(reason)
        log.info("DCP save to %s writes the classic format (a .metadata of every chunk): %s",
                 writer.uri, reason)


def write(prepared: Prepared, writer: CloudStorageWriter, group: Any) -> Checkpoint | None:
    """Write this rank's items and records; the coordinator claims the prefix first
    and commits last. Returns the committed checkpoint on the coordinator."""
    plan, rank = prepared.plan, prepared.rank
    area = coord.on_coordinator(lambda: writer.claim(plan.world_size), group)
    files = RankFiles.of_rank(rank, plan.key_spread, area)
    return coord.collect(lambda: _write_rank(prepared, writer, files),
                         lambda outcomes: _commit(plan, writer, outcomes), group)


def _writes(item: WriteItem, plan: Plan, rank: int) -> bool:
    """Whether this rank writes ``item``: its non-empty chunks (an empty part has no
    bytes, and no record says where it went), and what it holds whole (as every rank
    does) only where it is the item's owner."""
    fqn = item.index.fqn
    if item.type != WriteItemType.BYTE_IO:
        entry = plan.tensors[plan.position[fqn]]
        if entry.rule.kind != WHOLE:
            return rank < entry.filled
    return owner(fqn, plan.world_size) == rank


def _write_rank(prepared: Prepared, writer: CloudStorageWriter, files: RankFiles
                ) -> RankOutcome:
    plan, rank = prepared.plan, prepared.rank
    items = [i for i in prepared.local.items if _writes(i, plan, rank)]
    final = prepared.planner.finish_plan(dataclasses.replace(prepared.local, items=items,
                                                             storage_data=files))
    results = writer.write_data(final, prepared.planner).wait()
    records: list[Record] = []
    located: list[tuple[str, Location]] = []
    written: dict[str, tuple[int, str, str | None, bool]] = {}
    for result in cast(Iterable[WriteResult], results):
        info = cast(ItemInfo, result.storage_data)
        assert info.crc32c is not None and info.file_size is not None and \
            info.file_crc32c is not None  # the writer's own results
        written[info.relative_path] = (info.file_size, info.file_crc32c, info.blob, info.sent)
        loc = Location(info.relative_path, info.offset, info.length, info.crc32c)
        fqn = result.index.fqn
        pos = plan.position.get(fqn)
        if pos is not None and plan.tensors[pos].rule.kind != WHOLE:
            records.append(Record(pos, loc))
        else:
            located.append((fqn, loc))
    mine = RankRecords(rank, plan.digest, records)
    name = records_name(rank, plan.key_spread)
    put = writer.rank_store(files).put(name, mine.encode())
    assert put.crc32c is not None  # the store computes it
    written[name] = (put.size, put.crc32c, None, True)
    return RankOutcome(written, located, mine if plan.small else None)


def _commit(plan: Plan, writer: CloudStorageWriter, outcomes: list[RankOutcome]
            ) -> Checkpoint:
    files: dict[str, tuple[int, str, str | None, bool]] = {}
    located: dict[str, Location] = {}
    for outcome in outcomes:
        files.update(outcome.files)
        located.update(outcome.located)
    tensors = [t if t.rule.kind != WHOLE else dataclasses.replace(t, location=located[t.fqn])
               for t in plan.tensors]
    index = Index(plan.world_size, plan.key_spread, plan.digest, tensors,
                  [BytesEntry(f, located[f]) for f in plan.byte_fqns], plan.planner_data,
                  DCP_VERSION)
    objects = {INDEX_NAME: index.encode()}
    if plan.small:
        records = {r: o.records for r, o in enumerate(outcomes) if o.records is not None}
        md = stock_metadata(index, records, writer.storage_meta())
        objects[METADATA_NAME] = pickle.dumps(md)
    committed = writer.commit_files(
        files, {"format": INDEXED_FORMAT, "key_spread": plan.key_spread}, objects)
    log.info("DCP checkpoint committed at %s (indexed): %d files, %d tensors", writer.uri,
             len(files), len(tensors))
    return committed
