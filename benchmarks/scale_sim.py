"""What a save and a resume at 8 to 16,384 ranks ask of the bucket, simulated and bounded.

N ranks run as threads of this process over an in-process process group
(:mod:`cloudckpt_testkit.threadranks`), against ``count://``, a store that
records every request as the S3 request it stands for, with its key, rank and
time (:mod:`cloudckpt_testkit.counting`). Each rank holds its FSDP shard
(``Shard(0)``, ``torch.chunk`` rows) of a Llama-2-70B-shaped model and its Adam
moments, all float32: 723 parameters, 69 billion values, 828 GB in all, and
2,169 items per rank (plus Adam's step counts and hyper-parameters, which DCP
writes once). Per N, three phases, each on every rank:

1. ``save``: a :class:`~cloudckpt.CheckpointManager` save at step 100. Its model
   part is a ``cloudckpt.dcp.save`` (the same call a user makes), then every
   rank writes its state file and the coordinator commits the root manifest;
2. ``save + retention``: the save at step 200; ``keep_last=1`` deletes step 100;
3. ``resume``: a fresh manager's ``restore`` finds step 200 and loads it.

Everything above the bytes is cloudckpt's and DCP's own code: planning, the
collectives, claims, commits, manifests, ``.metadata``, listing, retention,
restore. The bytes are not: each shard is a one-element placeholder, so a data
object is a few kilobytes. Its size at full scale is taken from the
checkpoint's own ``.metadata`` (the chunk each item holds), and the requests
an object of that size takes are those of the S3 store's upload policy (one
PUT up to a part; else create, a PUT per part, complete) and of the reader's
read policy (:func:`reader_gets`). Two shortcuts keep 1,024 ranks within
minutes on two cores: ``torch.save`` of the shared placeholder is memoised (the
same bytes), and the resume plans each rank's reads of the chunks it holds by
offset (:class:`ShardLoadPlanner`; DCP's default planner compares every local
chunk with every saved one, O(N) per tensor per rank: hours for 1,024 threads
here). ``tests/test_scale.py`` checks that both planners plan the same reads.

The per-prefix rate model: every rank uploads (or downloads) at ``--bandwidth``
bytes/s, its files in parallel, all ranks starting together; a request counts
in the second it is sent. S3's documented limits per prefix are 3,500
PUT/COPY/POST/DELETE and 5,500 GET/HEAD requests per second.

With ``--sample K`` only K ranks run (the coordinator, the last, K - 2 between:
:class:`~cloudckpt_testkit.threadranks.SampledWorld`); every collective still
carries all N ranks' contributions at full size, the absent ranks' computed as they
would compute them (:class:`AbsentRanks`, checked against the ranks that ran), and
their objects stand in the store unwritten (phantoms: listed, sized, deleted). The
coordinator's work is the full job's; requests are counted for the ranks that ran.
``tests/test_scale.py`` checks that a sampled run at 16 ranks counts what the full
run counts. The modelled restore time (:func:`restore_model`) adds the
coordinator's serial part of a resume to the slowest rank's data at the bandwidth.

Usage::

    python benchmarks/scale_sim.py [--ranks 8 64 256 1024] [--bandwidth 1e9]
        [--layout flat|per-param] [--sample K] [--reshard] [--jobs J] [--json]

Prints a Markdown table (the one in docs/scale.md) and checks the bounds of
docs/scale.md for every N (:func:`check_bounds`); exits 1 if any is broken.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import multiprocessing
import os
import resource
import sys
import threading
import time
import zlib
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from cloudckpt_testkit.counting import Request, phantom, recorder
from cloudckpt_testkit.threadranks import (
    Collective,
    RankModel,
    SampledWorld,
    ThreadWorld,
    sample_ranks,
)
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    create_default_local_load_plan,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult

from cloudckpt import CheckpointManager, ManagerOptions, StepInfo
from cloudckpt.core.checkpoint import open_checkpoint
from cloudckpt.core.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, Written
from cloudckpt.dcp import rankload, ranksave
from cloudckpt.dcp import records as records_format
from cloudckpt.dcp.indexread import holders, is_indexed, read_index, whole_items
from cloudckpt.dcp.metadata import METADATA_NAME, SUFFIX, load_metadata
from cloudckpt.dcp.reader import (
    SHARED_BYTES_MAX,
    SHARED_ITEM_MAX,
    STREAM_MIN,
    CloudStorageReader,
)
from cloudckpt.dcp.records import (
    INDEX_NAME,
    INDEXED_FORMAT,
    RECORD_SIZE,
    Location,
    RankRecords,
    Record,
    records_name,
)
from cloudckpt.dcp.rules import WHOLE, owner
from cloudckpt.dcp.units import ItemInfo, serialize, split_by_size
from cloudckpt.dcp.writer import (
    DEFAULT_FILE_SIZE,
    DEFAULT_MAX_FILES,
    CloudStorageWriter,
    auto_spread,
)
from cloudckpt.serialization.records import HEAD_BYTES
from cloudckpt.storage import Store, open_store
from cloudckpt.storage.options import DEFAULT_PART_SIZE
from cloudckpt.training.reports import RankFigures
from cloudckpt.util.crc import Crc32c

BUCKET = "scale-sim"
#: S3's documented request rates per prefix (per second).
S3_WRITE_LIMIT = 3500
S3_READ_LIMIT = 5500
WRITE_KINDS = ("PUT", "POST", "DELETE", "COPY")
READ_KINDS = ("GET", "HEAD")

# ------------------------------------------------------------------ the model

#: Llama-2-70B: hidden 8192, MLP 28672, 80 layers, 64 heads with 8 KV heads, vocab 32000.
HIDDEN, MLP, LAYERS, KV, VOCAB = 8192, 28672, 80, 1024, 32000


#: How the parameters reach DCP: ``flat``, FSDP1's (``use_orig_params=False``) one
#: FlatParameter per decoder layer plus one for the root, Adam state per flat
#: parameter (81 tensors); ``per-param``, FSDP2's one DTensor per parameter (723).
LAYOUTS = ("flat", "per-param")


def param_shapes(layout: str = "flat", world: int = 1) -> dict[str, tuple[int, ...]]:
    """The tensors one rank's model state holds a ``Shard(0)`` of, by FQN."""
    per_param = _llama_70b()
    if layout == "per-param":
        return per_param
    if layout != "flat":
        raise ValueError(f"layout is one of {LAYOUTS}, not {layout!r}")
    units: dict[str, int] = defaultdict(int)
    for fqn, shape in per_param.items():
        parts = fqn.split(".")
        unit = ".".join(parts[:3]) + "." if fqn.startswith("model.layers.") else ""
        units[unit + "_flat_param"] += math.prod(shape)
    # FSDP pads a flat parameter to a multiple of the world size.
    return {fqn: (-(-n // world) * world,) for fqn, n in units.items()}


def _llama_70b() -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (VOCAB, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (HIDDEN, HIDDEN),
            p + "self_attn.k_proj.weight": (KV, HIDDEN),
            p + "self_attn.v_proj.weight": (KV, HIDDEN),
            p + "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
            p + "mlp.gate_proj.weight": (MLP, HIDDEN),
            p + "mlp.up_proj.weight": (MLP, HIDDEN),
            p + "mlp.down_proj.weight": (HIDDEN, MLP),
            p + "input_layernorm.weight": (HIDDEN,),
            p + "post_attention_layernorm.weight": (HIDDEN,),
        })
    shapes["model.norm.weight"] = (HIDDEN,)
    shapes["lm_head.weight"] = (VOCAB, HIDDEN)
    return shapes


_PLACEHOLDERS: dict[int, torch.Tensor] = {}


def placeholder(ndim: int) -> torch.Tensor:
    """The one-element tensor every shard of ``ndim`` dimensions stands on."""
    if ndim not in _PLACEHOLDERS:
        _PLACEHOLDERS[ndim] = torch.zeros((1,) * ndim)
    return _PLACEHOLDERS[ndim]


class SimShard(torch.Tensor):
    """This rank's ``Shard(0)`` of a float32 tensor, as FSDP2 hands it to DCP (the
    chunk it covers), standing on a one-element placeholder instead of its bytes.
    DCP finds shards through these hooks, as it finds a DTensor's."""

    offsets: torch.Size
    sizes: torch.Size
    full: torch.Size

    @staticmethod
    def __new__(cls, shape: tuple[int, ...], rank: int, world: int) -> SimShard:
        # Sized as the whole tensor (as a DTensor is), holding no bytes.
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=torch.float32)
        rows = -(-shape[0] // world)  # torch.chunk: ceil rows per rank, the last ones short
        start = min(rank * rows, shape[0])
        t.offsets = torch.Size((start,) + (0,) * (len(shape) - 1))
        t.sizes = torch.Size((min(rows, shape[0] - start),) + shape[1:])
        t.full = torch.Size(shape)
        return t

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        raise NotImplementedError(f"{func} on a simulated shard: it holds no bytes")

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [WriteItem(
            index=MetadataIndex(fqn, self.offsets), type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=self.offsets, sizes=self.sizes),
                properties=TensorProperties(dtype=torch.float32), size=self.full))]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=self.offsets, sizes=self.sizes)]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return placeholder(len(self.sizes))


_STEP = torch.tensor(1000.0)  # Adam's step count: a replicated 0-d tensor per parameter


def rank_state(rank: int, world: int, layout: str = "flat") -> dict[str, Any]:
    """Model and Adam state of one rank, as DCP gets them from FSDP (see :data:`LAYOUTS`)."""
    shapes = param_shapes(layout, world)
    # Every rank holds a shard of every tensor, empty past its rows (as FSDP2's are).
    model = {fqn: SimShard(s, rank, world) for fqn, s in shapes.items()}
    optim_state = {fqn: {"step": _STEP, "exp_avg": SimShard(shapes[fqn], rank, world),
                         "exp_avg_sq": SimShard(shapes[fqn], rank, world)} for fqn in model}
    groups = [{"lr": 1e-5, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1,
               "params": list(shapes)}]
    return {"model": model, "optim": {"state": optim_state, "param_groups": groups}}


@contextlib.contextmanager
def memoised_placeholder_saves() -> Iterator[None]:
    """``torch.save`` of a placeholder writes the bytes it wrote the first time (the
    same bytes: same tensor, same pickle); anything else is saved as usual."""
    real_save = torch.save
    cache: dict[tuple[int, int], bytes] = {}
    for n in range(1, 3):
        placeholder(n)
    ptrs = {t.data_ptr() for t in (*_PLACEHOLDERS.values(), _STEP)}

    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(obj, torch.Tensor) and obj.data_ptr() in ptrs and not args and not kwargs:
            key = (obj.data_ptr(), obj.dim())
            if key not in cache:
                buf = io.BytesIO()
                real_save(obj, buf)
                cache[key] = buf.getvalue()
            f.write(cache[key])
            return
        real_save(obj, f, *args, **kwargs)

    torch.save = save
    try:
        yield
    finally:
        torch.save = real_save


# -------------------------------------------------------------- the resume plan


class ShardLoadPlanner(DefaultLoadPlanner):
    """Plans each rank's reads of exactly the chunks it holds, looked up by offset
    (what DCP's planner finds when the sharding is unchanged, without comparing
    every chunk with every other), then reads them into placeholders."""

    #: Each item is read from the saved item of its own name: the indexed load may
    #: plan rank by rank (cloudckpt.dcp.load).
    plans_by_name = True
    _index_cache: dict[int, dict[tuple[str, tuple[int, ...]], int]] = {}
    _lock = threading.Lock()

    def __init__(self, plans: dict[int, list[ReadItem]] | None = None) -> None:
        super().__init__()
        self.full_plans = plans  # rank -> the full-size read items, for the model

    def _chunk_index(self) -> dict[tuple[str, tuple[int, ...]], int]:
        md = self.metadata
        with self._lock:
            if id(md) not in self._index_cache:
                self._index_cache.clear()
                self._index_cache[id(md)] = {
                    (fqn, tuple(c.offsets)): i
                    for fqn, tmd in md.state_dict_metadata.items()
                    for i, c in enumerate(getattr(tmd, "chunks", ()))}
            return self._index_cache[id(md)]

    def create_local_plan(self) -> LoadPlan:
        index = self._chunk_index()
        sims = {k: v for k, v in self.state_dict.items() if isinstance(v, SimShard)}
        rest = {k: v for k, v in self.state_dict.items() if k not in sims}
        items: list[ReadItem] = []
        for fqn, shard in sims.items():
            if 0 in shard.sizes:  # an empty shard reads nothing
                continue
            k = index[(fqn, tuple(shard.offsets))]
            zeros = torch.Size((0,) * len(shard.sizes))
            items.append(ReadItem(
                type=LoadItemType.TENSOR,
                dest_index=MetadataIndex(fqn, shard.offsets, 0), dest_offsets=zeros,
                storage_index=MetadataIndex(fqn, shard.offsets, k), storage_offsets=zeros,
                lengths=shard.sizes))
        plan = create_default_local_load_plan(rest, self.metadata, False)
        return LoadPlan(items + plan.items, plan.storage_data, plan.planner_data)

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        plan = super().finish_plan(central_plan)
        if self.full_plans is not None:
            from cloudckpt_testkit.threadranks import current_rank

            self.full_plans[current_rank() or 0] = list(plan.items)
        return LoadPlan([_as_placeholder(i) if isinstance(self._obj(i), SimShard) else i
                         for i in plan.items], plan.storage_data, plan.planner_data)

    def _obj(self, item: ReadItem) -> Any:
        return self.state_dict.get(item.dest_index.fqn)


class ReshardPlanner(ShardLoadPlanner):
    """A load onto another sharding: DCP's own local plan (each local chunk against the
    saved chunks it overlaps, which an indexed load's ``Metadata`` holds only of the
    saved ranks whose records it read), read into placeholders."""

    def create_local_plan(self) -> LoadPlan:
        return DefaultLoadPlanner.create_local_plan(self)


def _as_placeholder(item: ReadItem) -> ReadItem:
    one = torch.Size((1,) * len(item.lengths))
    zeros = torch.Size((0,) * len(item.lengths))
    return ReadItem(item.type, item.dest_index, zeros, item.storage_index, zeros, one)


# ---------------------------------------------------- the ranks that do not run


class ModelMismatch(AssertionError):
    """The model of the absent ranks computed, for a rank that ran, something else
    than what that rank contributed: the simulation's figures would be wrong."""


class _Bytes(bytearray):
    """A stream :func:`~cloudckpt.dcp.units.serialize` can write to, kept in memory."""

    def write(self, data: Any, crc32c: int | None = None) -> int:
        view = memoryview(data).cast("B")
        self.extend(view)
        return view.nbytes


class AbsentRanks(RankModel):
    """What the ranks a sampled simulation does not run contribute, at full size.

    Each contribution is computed as that rank would compute it: its save plan and its
    load plan by DCP's planners over its own :func:`rank_state`; its write results from
    its share of the coordinator's global plan, split into files as the writer splits
    them (``split_by_size``, files named as the writer names them), each item's bytes
    made by ``serialize`` once per tensor (every shard of a tensor stands on the same
    placeholder, so its bytes are the same on every rank); its state file and its
    figures as the nearest running rank's, renamed. Its objects are phantoms of the
    store: listed with their sizes, deleted by retention, a data file's bytes made if
    it is read (the coordinator reads replicated items from whichever rank wrote them).

    The model is checked on every run: for each running rank but the coordinator, the
    plans and write results it computes must be the ones that rank made, or the
    simulation stops (:class:`ModelMismatch`).
    """

    def __init__(self, world: int, layout: str, running: tuple[int, ...]) -> None:
        self.world, self.layout, self.running = world, layout, running
        #: The checkpoint being saved (its DCP part is ``model/``), set before each save.
        self.checkpoint: Store | None = None
        #: The .metadata of the checkpoint being resumed, as bytes, set before the resume:
        #: unpickled when first needed (after the coordinator has read its own), so that
        #: a second copy's objects do not slow the unpickling measured on the coordinator.
        self.metadata_bytes: bytes | None = None
        self._metadata: Metadata | None = None
        #: Every absent rank's final load plan (the coordinator's scatter), by rank.
        self.load_plans: dict[int, list[ReadItem]] = {}
        self._final: list[Any] = []  # the last scatter: every rank's plan
        self._bytes: dict[str, bytes] = {}  # an item's serialised bytes, by FQN
        self._resolver: DefaultSavePlanner | None = None
        # The indexed save's plan, each class of rank's files, items' CRC32Cs, owners.
        self._plan: ranksave.Plan | None = None
        self._templates: dict[tuple[frozenset[str], tuple[int, ...]],
                              list[list[tuple[WriteItem, bytes]]]] = {}
        self._lengths: list[int] | None = None
        self._local: dict[tuple[int, ...], tuple[int, list[WriteItem]]] = {}
        self._crcs: dict[str, str] = {}
        self._file_crcs: dict[int, str] = {}  # by id() of a template's file
        self._owners: dict[int, set[str]] | None = None
        # Per class of rank, its first rank and that rank's records (head, body, order
        # of its files in the head), for the others of the class (see _outcome).
        self._records_of: dict[Any, tuple[int, tuple[bytes, bytes, list[int]]]] = {}
        self._encoded: dict[int, tuple[bytes, bytes, list[int]]] = {}
        self._derived_checked = 0

    def seen(self, call: Collective) -> None:
        if call.kind == "scatter_object_list":
            self._final = list(call.sampled[0])
            if self._final and isinstance(self._final[0], LoadPlan):
                self.load_plans.update({r: list(p.items) for r, p in enumerate(self._final)
                                        if r not in call.sampled})
            return
        if not _write_results(call.sampled.get(0)):
            # Every rank's plan is needed until the write results are in; held longer,
            # its objects would slow the collections measured on the coordinator.
            self._final = []
        first = call.sampled.get(0)
        checked = isinstance(first, (SavePlan, LoadPlan, list)) or (
            isinstance(first, tuple) and len(first) == 2
            and isinstance(first[1], ranksave.RankOutcome))
        if call.kind == "all_reduce" and isinstance(first, torch.Tensor):
            for r, value in call.sampled.items():
                if r == 0:
                    continue
                ours = self._contribution(call, r, stand_in=False)
                if not torch.equal(ours, value):
                    raise ModelMismatch(f"all_reduce #{call.index}: rank {r} put in "
                                        f"{value.tolist()}, the model {ours.tolist()}")
            return
        if call.kind not in ("gather_object", "all_gather_object") or not checked:
            return
        for r, value in call.sampled.items():
            if r == 0:
                continue
            ours = self._contribution(call, r, stand_in=False)
            if ours != value:
                raise ModelMismatch(
                    f"{call.kind} #{call.index}: the model of rank {r}'s contribution "
                    f"({type(value).__name__}) differs from what rank {r} put in: "
                    f"{_first_difference(ours, value)}")

    def contribution(self, call: Collective, rank: int) -> Any:
        return self._contribution(call, rank, stand_in=True)

    def _contribution(self, call: Collective, rank: int, *, stand_in: bool) -> Any:
        ours = call.sampled[0]  # the coordinator's
        if isinstance(ours, SavePlan):
            planner = DefaultSavePlanner()
            planner.set_up_planner(rank_state(rank, self.world, self.layout),
                                   is_coordinator=False)
            return planner.create_local_plan()
        if isinstance(ours, LoadPlan):
            loader = ShardLoadPlanner()
            loader.set_up_planner(rank_state(rank, self.world, self.layout), self._md(),
                                  is_coordinator=False)
            return loader.create_local_plan()
        if _write_results(ours):
            return self._write_results(rank, stand_in)
        if call.kind == "all_reduce" and isinstance(ours, torch.Tensor) and \
                ours.dtype == torch.int64 and ours.numel() == 4:
            # ranksave.prepare's check: [-digest, digest, irregular, failed]
            digest = self._indexed().digest
            return torch.tensor([-digest, digest, 0, 0], dtype=torch.int64)
        if isinstance(ours, tuple) and len(ours) == 2 and ours[0] == "ok" and \
                isinstance(ours[1], ranksave.RankOutcome):
            return ("ok", self._outcome(rank, stand_in))
        if isinstance(ours, tuple) and len(ours) == 2 and ours[0] == "ok":
            near = self._nearest(rank)
            theirs = call.sampled[near][1]
            if isinstance(theirs, RankFigures):
                return ("ok", theirs)
            if isinstance(theirs, Written):
                path = theirs.path.replace(f"rank-{near:05d}", f"rank-{rank:05d}")
                if path == theirs.path:
                    raise ModelMismatch(f"rank {near}'s state file {path} is not named after it")
                if stand_in:
                    phantom(self._checkpoint(), path, theirs.entry.size)
                return ("ok", Written(path, theirs.entry))
        return super().contribution(call, rank)

    def _md(self) -> Metadata:
        if self._metadata is None:
            if self.metadata_bytes is None:
                raise RuntimeError("AbsentRanks.metadata_bytes is set before the resume")
            self._metadata = load_metadata(self.metadata_bytes)
        return self._metadata

    def _checkpoint(self) -> Store:
        if self.checkpoint is None:
            raise RuntimeError("AbsentRanks.checkpoint is set before each save")
        return self.checkpoint

    def _nearest(self, rank: int) -> int:
        others = [r for r in self.running if r != 0] or [0]
        return min(others, key=lambda r: abs(r - rank))

    def _write_results(self, rank: int, stand_in: bool) -> list[WriteResult]:
        plan = self._final[rank]
        files = plan.storage_data
        if files.area is not None:
            raise NotImplementedError("absent ranks writing under a writer area")
        dcp = self._checkpoint().child("model")
        results: list[WriteResult] = []
        buckets = split_by_size(plan.items, DEFAULT_FILE_SIZE, DEFAULT_MAX_FILES)
        for i, items in enumerate(b for b in buckets if b):
            name = _file_name(files.prefix, files.key_spread, i)
            blobs = [self._item_bytes(item) for item in items]
            crc, offset, placed = Crc32c(), 0, []
            for item, data in zip(items, blobs, strict=True):
                item_crc = Crc32c()
                item_crc.update(data)
                placed.append((item, offset, len(data), item_crc.hexdigest()))
                crc.append(int(item_crc.hexdigest(), 16), len(data))
                offset += len(data)
            results += [WriteResult(index=item.index, size_in_bytes=n, storage_data=ItemInfo(
                name, start, n, None, item_crc, offset, crc.hexdigest()))
                for item, start, n, item_crc in placed]
            if stand_in:
                phantom(dcp, name, offset, lambda blobs=blobs: b"".join(blobs))
        return results

    def _indexed(self) -> ranksave.Plan:
        """The indexed save's plan, as every rank derives it from its own structure
        (the same on every rank, or the save goes classic: the all-reduce checks that
        against the ranks that ran)."""
        if self._plan is None:
            planner = DefaultSavePlanner()
            planner.set_up_planner(rank_state(0, self.world, self.layout), is_coordinator=True)
            local = planner.create_local_plan()
            spread = auto_spread(self.world)
            shape = ranksave._structure(local, 0, self.world, spread)
            if isinstance(shape, str):
                raise ModelMismatch(f"the indexed format cannot describe rank 0's state: {shape}")
            self._plan = ranksave._plan(*shape, self.world, spread, local)
        return self._plan

    def kind(self, rank: int) -> tuple[frozenset[str], tuple[int, ...]]:
        """``rank``'s class: ranks of one class write the same files but for their names
        (the whole items they own, the rows they hold of each tensor)."""
        return self._owned(rank), self._rows(rank)

    def _template(self, rank: int) -> list[list[tuple[WriteItem, bytes]]]:
        """The files (each its items and their bytes) of ``rank``, made once per class
        of rank: those writing the same whole items and holding as many rows of each
        tensor (the files are split by the chunks' sizes) write files alike but for
        their names, as every shard of a tensor stands on the same placeholder."""
        _, rows = key = self.kind(rank)
        if key not in self._templates:
            plan = self._indexed()
            if rows not in self._local:  # a rank's items, as DCP plans them (once per rows)
                planner = DefaultSavePlanner()
                planner.set_up_planner(rank_state(rank, self.world, self.layout),
                                       is_coordinator=False)
                self._local[rows] = (rank, planner.create_local_plan().items)
            # What the rank writes: every non-empty chunk, the whole items it owns.
            items = [i for i in self._local[rows][1] if ranksave._writes(i, plan, rank)]
            buckets = split_by_size(items, DEFAULT_FILE_SIZE, DEFAULT_MAX_FILES)
            self._templates[key] = [[(i, self._item_bytes(i)) for i in b] for b in buckets
                                    if b]
            for bucket in self._templates[key]:  # a file's CRC32C, the same on every rank
                crc = Crc32c()
                for item, data in bucket:
                    if item.index.fqn not in self._crcs:
                        c = Crc32c()
                        c.update(data)
                        self._crcs[item.index.fqn] = c.hexdigest()
                    crc.update(data)  # the bytes are small: hashing beats combining CRCs
                self._file_crcs[id(bucket)] = crc.hexdigest()
        return self._templates[key]

    def _rows(self, rank: int) -> tuple[int, ...]:
        """The rows ``rank`` holds of a tensor of each length of dim 0 (torch.chunk's)."""
        if self._lengths is None:
            self._lengths = sorted({s[0] for s in param_shapes(self.layout, self.world)
                                    .values()})
        out = []
        for n in self._lengths:
            step = -(-n // self.world)
            out.append(max(0, min(step, n - rank * step)))
        return tuple(out)

    def _owned(self, rank: int) -> frozenset[str]:
        """The whole items (tensors held whole, other values) ``rank`` writes."""
        if self._owners is None:
            plan = self._indexed()
            whole = [t.fqn for t in plan.tensors if t.rule.kind == WHOLE] + plan.byte_fqns
            self._owners = defaultdict(set)
            for fqn in whole:
                self._owners[owner(fqn, self.world)].add(fqn)
        return frozenset(self._owners.get(rank, ()))

    def _outcome(self, rank: int, stand_in: bool) -> ranksave.RankOutcome:
        """Absent ``rank``'s RankOutcome: its files named after it, its records.

        Made in full for the first rank of each class (:meth:`kind`); for the others of
        a class that holds no whole items, its records' bytes are the first one's but
        for the head (the rank, the files' names), and are made so: O(files) a rank,
        where building and encoding the records is O(tensors), seconds a save at
        16,384 ranks. The first :data:`DERIVED_CHECKED` ranks so made are also made in
        full and compared (:class:`ModelMismatch`)."""
        plan = self._indexed()
        key = self.kind(rank)
        known = self._records_of.get(key)
        if known is None or plan.small:
            out = self._full_outcome(rank, stand_in)
            if not out.located and not plan.small:
                self._records_of[key] = (rank, self._encoded[rank])
            del self._encoded[rank]
            return out
        dcp = self._checkpoint().child("model")
        files: dict[str, tuple[int, str, str | None, bool]] = {}
        names = []
        for i, bucket in enumerate(self._template(rank)):
            name = _file_name(f"__{rank}_", plan.key_spread, i)
            names.append(name)
            size = sum(len(data) for _, data in bucket)
            files[name] = (size, self._file_crcs[id(bucket)], None, True)
            if stand_in:
                phantom(dcp, name, size,
                        lambda bucket=bucket: b"".join(data for _, data in bucket))
        src, (src_head, body, order) = known
        encoded = _records_head(rank, plan.digest, [names[i] for i in order],
                                len(body) // _RECORD_SIZE) + body
        if self._derived_checked < DERIVED_CHECKED:
            self._derived_checked += 1
            if encoded != self._records_bytes(rank):
                raise ModelMismatch(f"rank {rank}'s records, made from rank {src}'s, are "
                                    "not the ones it would write")
        rec_crc = Crc32c()
        rec_crc.update(encoded)
        rec_name = records_name(rank, plan.key_spread)
        files[rec_name] = (len(encoded), rec_crc.hexdigest(), None, True)
        if stand_in:
            phantom(dcp, rec_name, len(encoded), lambda rank=rank: self._records_bytes(rank))
        return ranksave.RankOutcome(files, [], None)

    def _full_outcome(self, rank: int, stand_in: bool) -> ranksave.RankOutcome:
        """:meth:`_outcome` made in full; its records' head, body and file order kept
        in :attr:`_encoded`, for the ranks of its class."""
        plan = self._indexed()
        dcp = self._checkpoint().child("model")
        files: dict[str, tuple[int, str, str | None, bool]] = {}
        located: list[tuple[str, Location]] = []
        records: list[Record] = []
        for i, bucket in enumerate(self._template(rank)):
            name = _file_name(f"__{rank}_", plan.key_spread, i)
            offset = 0
            for item, data in bucket:
                item_crc = self._crcs[item.index.fqn]
                loc = Location(name, offset, len(data), item_crc)
                pos = plan.position.get(item.index.fqn)
                if pos is not None and plan.tensors[pos].rule.kind != WHOLE:
                    records.append(Record(pos, loc))
                else:
                    located.append((item.index.fqn, loc))
                offset += len(data)
            files[name] = (offset, self._file_crcs[id(bucket)], None, True)
            if stand_in:
                phantom(dcp, name, offset,
                        lambda bucket=bucket: b"".join(data for _, data in bucket))
        mine = RankRecords(rank, plan.digest, records)
        encoded = mine.encode()
        order = list(dict.fromkeys(_file_number(r.location.file, rank)
                                   for r in sorted(records, key=lambda r: r.tensor)))
        head = _records_head(rank, plan.digest,
                             [_file_name(f"__{rank}_", plan.key_spread, i) for i in order],
                             len(records))
        if not encoded.startswith(head) or len(encoded) - len(head) != \
                len(records) * _RECORD_SIZE:
            raise ModelMismatch(f"rank {rank}'s records are not laid out as the model "
                                "makes them for the other ranks of its class")
        self._encoded[rank] = (head, encoded[len(head):], order)
        rec_crc = Crc32c()
        rec_crc.update(encoded)
        rec_name = records_name(rank, plan.key_spread)
        files[rec_name] = (len(encoded), rec_crc.hexdigest(), None, True)
        if stand_in:  # made again if read: 16,384 ranks' records held would be GBs
            phantom(dcp, rec_name, len(encoded),
                    lambda rank=rank: self._records_bytes(rank))
        return ranksave.RankOutcome(files, located, mine if plan.small else None)

    def _records_bytes(self, rank: int) -> bytes:
        """Absent ``rank``'s records object, made again (for a read of its phantom)."""
        plan = self._indexed()
        records = []
        for i, bucket in enumerate(self._template(rank)):
            name = _file_name(f"__{rank}_", plan.key_spread, i)
            offset = 0
            for item, data in bucket:
                pos = plan.position.get(item.index.fqn)
                if pos is not None and plan.tensors[pos].rule.kind != WHOLE:
                    records.append(Record(pos, Location(name, offset, len(data),
                                                        self._crcs[item.index.fqn])))
                offset += len(data)
        return RankRecords(rank, plan.digest, records).encode()

    def _item_bytes(self, item: WriteItem) -> bytes:
        fqn = item.index.fqn
        if fqn not in self._bytes:
            if self._resolver is None:  # rank 0 holds a shard of every tensor
                self._resolver = DefaultSavePlanner()
                self._resolver.set_up_planner(rank_state(0, self.world, self.layout),
                                              is_coordinator=True)
            out = _Bytes()
            serialize([item], self._resolver, out)
            self._bytes[fqn] = bytes(out)
        return self._bytes[fqn]


#: The bytes of one record in a rank's records object, after its head.
_RECORD_SIZE = records_format._RECORD.size


def _records_head(rank: int, digest: int, files: list[str], n_records: int) -> bytes:
    """The head of a rank's records object (``RankRecords.encode``'s: the rank, the
    counts, the files' names in the order its records, sorted by tensor, first name
    them); what follows it is the records themselves, alike for every rank of a class."""
    out = [records_format._HEADER.pack(records_format._RECORDS_MAGIC,
                                       records_format._RECORDS_VERSION, 0, rank, digest,
                                       len(files), n_records)]
    for name in files:
        raw = name.encode()
        out += [records_format._NAME_LEN.pack(len(raw)), raw]
    return b"".join(out)


def _write_results(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and \
        all(isinstance(v, WriteResult) for v in value)


def _file_name(prefix: str, key_spread: int, i: int) -> str:
    """The name the writer gives a rank's ``i``-th file (under its sub-prefix)."""
    name = f"{prefix}{i}{SUFFIX}"
    if not key_spread:
        return name
    width = max(2, len(f"{key_spread - 1:x}"))
    return f"{zlib.crc32(name.encode()) % key_spread:0{width}x}/{name}"


def _first_difference(ours: Any, theirs: Any) -> str:
    """Where two contributions first differ, briefly."""
    a = getattr(ours, "items", ours)
    b = getattr(theirs, "items", theirs)
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return f"{len(a)} entries modelled, {len(b)} made"
        for x, y in zip(a, b, strict=True):
            if x != y:
                return f"modelled {x!r}, made {y!r}"
    return f"modelled {ours!r:.300}, made {theirs!r:.300}"


# ------------------------------------------------------------- request model


def s3_writes(size: int, part: int) -> list[tuple[str, float]]:
    """The requests one object of ``size`` bytes takes through the S3 store, each
    with the share of the object sent before it: one PUT up to a part, else a
    multipart upload (POST create, a PUT per ``part`` bytes, POST complete)."""
    if size <= part:
        return [("PUT", 0.0)]
    n = -(-size // part)
    return [("POST", 0.0)] + [("PUT", i / n) for i in range(n)] + [("POST", 1.0)]


def reader_gets(items: list[tuple[str, int, bool]], part: int) -> list[tuple[str, int]]:
    """The GETs the DCP reader sends for ``items`` (file, full size, is a tensor), in
    file order: a tensor of at least STREAM_MIN in one GET up to two parts, else a
    head read and a GET per part; smaller items coalesced into GETs of up to a part."""
    gets: list[tuple[str, int]] = []
    small: dict[str, int] = defaultdict(int)
    for path, size, tensor in items:
        if tensor and size >= STREAM_MIN:
            if size <= 2 * part:
                gets.append((path, size))
            else:
                gets.append((path, HEAD_BYTES))
                gets += [(path, min(part, size - s)) for s in range(0, size, part)]
        else:
            small[path] += size
    for path, total in small.items():
        gets += [(path, min(part, total - s)) for s in range(0, total, part)]
    return gets


def prefix_of(key: str) -> str:
    """What S3 partitions on: the key up to its last ``/``."""
    return key.rsplit("/", 1)[0] + "/" if "/" in key else "/"


def peak_per_prefix(sends: list[tuple[str, str, float]], kinds: tuple[str, ...]
                    ) -> tuple[int, str]:
    """The most requests of ``kinds`` sent to one prefix within one second."""
    buckets: Counter[tuple[str, int]] = Counter(
        (prefix_of(key), int(t)) for kind, key, t in sends if kind in kinds)
    if not buckets:
        return 0, ""
    (prefix, _), n = buckets.most_common(1)[0]
    return n, prefix


def upload_sends(objects: dict[int, list[tuple[str, int]]], bandwidth: float,
                 part: int) -> list[tuple[str, str, float]]:
    """When each request of each rank's uploads is sent: a rank sends its objects in
    parallel, each at an equal share of ``bandwidth``, all ranks from time 0."""
    sends = []
    for objs in objects.values():
        share = bandwidth / max(1, len(objs))
        for key, size in objs:
            sends += [(kind, key, frac * size / share) for kind, frac in s3_writes(size, part)]
    return sends


def download_sends(gets: dict[int, list[tuple[str, int]]], bandwidth: float
                   ) -> list[tuple[str, str, float]]:
    """When each GET is sent: a rank's GETs back to back at ``bandwidth``."""
    sends = []
    for reqs in gets.values():
        t = 0.0
        for key, size in reqs:
            sends.append(("GET", key, t))
            t += size / bandwidth
    return sends


# ------------------------------------------------------------------- running


@dataclass
class Phase:
    """The requests one phase sent, and the full-size data requests it stands for."""

    name: str
    requests: list[Request]
    data_keys: set[str] = field(default_factory=set)
    data: dict[int, list[tuple[str, int]]] = field(default_factory=dict)
    seconds: float = 0.0
    #: Per rank, the bytes of the records it needs (resharding: the header and file
    #: names of each saved rank whose chunks it needs, and their records: what the
    #: metadata bound is measured against; :func:`metadata_read_ratio`).
    records_needed: dict[int, int] = field(default_factory=dict)

    def by_rank(self) -> dict[int | None, Counter[str]]:
        """Per rank, its requests by kind, besides its data objects'."""
        out: dict[int | None, Counter[str]] = defaultdict(Counter)
        for r in self.requests:
            if r.key not in self.data_keys:
                out[r.rank][r.kind] += 1
        return out


#: What the coordinator's CPU is measured in on a save: DCP's global plan and
#: cloudckpt's, or the indexed save's own planning (plan), and writing .metadata or
#: the index and the manifest (commit).
SAVE_TIMED = ((DefaultSavePlanner, "create_global_plan", "plan"),
              (CloudStorageWriter, "prepare_global_plan", "plan"),
              (ranksave, "prepare", "plan"),
              (CloudStorageWriter, "finish", "commit"),
              (ranksave, "_commit", "commit"))
#: ... and on a resume: reading and unpickling .metadata (or reading the index), the
#: global load plan (or the indexed load's, each rank alone: the coordinator's).
RESUME_TIMED = ((CloudStorageReader, "read_metadata", "resume metadata"),
                (CloudStorageReader, "_open_for_load", "resume metadata"),
                (DefaultLoadPlanner, "create_global_plan", "resume plan"),
                (CloudStorageReader, "prepare_global_plan", "resume plan"),
                (rankload, "prepare", "resume plan"))


class PerRankPlans(dict):  # type: ignore[type-arg]
    """The indexed save's cache of plans, one per rank as in a real job (ranks are
    processes there), where the threads of this process would share one: the
    coordinator's first save builds its own plan, as it would."""

    def __init__(self) -> None:
        super().__init__()
        self._of: dict[int, dict[int, Any]] = defaultdict(dict)

    def _mine(self) -> dict[int, Any]:
        from cloudckpt_testkit.threadranks import current_rank

        rank = current_rank()
        return self._of[-1 if rank is None else rank]  # -1: the model of absent ranks

    def get(self, key: Any, default: Any = None) -> Any:
        return self._mine().get(key, default)

    def pop(self, key: Any, *default: Any) -> Any:
        return self._mine().pop(key, *default)

    def __setitem__(self, key: Any, value: Any) -> None:
        self._mine()[key] = value

    def __len__(self) -> int:
        return len(self._mine())

    def __iter__(self) -> Iterator[Any]:
        return iter(self._mine())


@contextlib.contextmanager
def per_rank_plans() -> Iterator[None]:
    saved = ranksave._plans
    ranksave._plans = PerRankPlans()
    try:
        yield
    finally:
        ranksave._plans = saved


@contextlib.contextmanager
def coordinator_cpu(into: dict[str, float],
                    targets: tuple[tuple[type, str, str], ...] = SAVE_TIMED) -> Iterator[None]:
    """Thread CPU seconds rank 0 spends in ``targets`` (class, method, label), summed
    by label into ``into``."""
    from cloudckpt_testkit.threadranks import current_rank

    saved = []
    for cls, name, label in targets:
        fn = getattr(cls, name)
        saved.append((cls, name, fn))

        def timed(self: Any, *a: Any, _fn: Callable[..., Any] = fn, _label: str = label,
                  **k: Any) -> Any:
            start = time.thread_time()
            try:
                return _fn(self, *a, **k)
            finally:
                if current_rank() == 0:
                    into[_label] = into.get(_label, 0.0) + time.thread_time() - start

        setattr(cls, name, timed)
    try:
        yield
    finally:
        for cls, name, fn in saved:
            setattr(cls, name, fn)


def _run(world: ThreadWorld, name: str, fn: Callable[[int], Any]) -> Phase:
    rec = recorder(BUCKET)
    rec.take()
    start = time.monotonic()
    world.run(fn)
    return Phase(name, rec.take(), seconds=time.monotonic() - start)


def _quietly_read(store: Store, key: str) -> bytes:
    data = store.get(key)
    recorder(BUCKET).take()  # the simulation's own reads are not the job's
    return data


def written_files(store: Store, md: Metadata) -> dict[int, list[tuple[str, int]]]:
    """Per rank, the data files of the DCP checkpoint at ``store`` (``md`` its
    .metadata) with the size each would have at full scale: the bytes of the chunks
    its items hold."""
    full: dict[str, int] = defaultdict(int)
    for index, info in md.storage_data.items():
        tmd = md.state_dict_metadata[index.fqn]
        chunks = getattr(tmd, "chunks", None)
        if chunks is None:  # bytes: as written
            full[info.relative_path] += info.length
            continue
        chunk = chunks[index.index] if index.index is not None else next(
            c for c in chunks if c.offsets == index.offset)
        full[info.relative_path] += math.prod(chunk.sizes) * 4
    per_rank: dict[int, list[tuple[str, int]]] = defaultdict(list)
    prefix = key_of(store, "")
    for path, size in full.items():
        rank = int(path.rsplit("/", 1)[-1].split("_")[2])
        per_rank[rank].append((prefix + path, size))
    return per_rank


def classic_reads(store: Store, md: Metadata, full_plans: dict[int, list[ReadItem]],
                  part: int) -> dict[int, list[tuple[str, int]]]:
    """Per rank, the GETs of its resume at full size, from its load plan: small items
    several ranks read are read once, by the coordinator (the reader's
    prepare_global_plan); each rank reads the rest of what it holds."""
    readers = Counter(i.storage_index for items in full_plans.values() for i in items)
    shared = {i for i, n in readers.items()
              if n > 1 and md.storage_data[i].length <= SHARED_ITEM_MAX}

    def read(i: ReadItem) -> tuple[str, int, bool]:
        info = md.storage_data[i.storage_index]
        tensor = i.type == LoadItemType.TENSOR and i.storage_index not in shared
        return (key_of(store, info.relative_path),
                math.prod(i.lengths) * 4 if tensor else info.length, tensor)

    return {r: reader_gets([read(i) for i in items if i.storage_index not in shared]
                           + ([read(i) for i in full_plans[0] if i.storage_index in shared]
                              if r == 0 else []), part)
            for r, items in full_plans.items()}


#: Absent ranks whose records the analysis reads and decodes as well as derives, to
#: check the derivation (:func:`indexed_data`).
DERIVED_CHECKED = 4


def indexed_data(store: Store, ckpt: Any, world: int, full_plans: dict[int, list[ReadItem]],
                 part: int, kind: Callable[[int], Any] | None = None
                 ) -> tuple[dict[int, list[tuple[str, int]]],
                            dict[int, list[tuple[str, int]]], int]:
    """An indexed checkpoint's data at full size, from its index and every rank's
    records: per rank, the files it wrote and the GETs of its resume on the same layout
    (its own chunks; the whole items, but the small ones the coordinator reads once for
    the job: :meth:`CloudStorageReader.read_whole_items`); and the number of items.
    Each running rank's load plan (``full_plans``) is checked against it.

    With ``kind`` (a sampled run: :meth:`AbsentRanks.kind`), the records of one rank of
    each class are read and decoded; every other rank's are derived from them by
    renaming its files (ranks of a class hold chunks of the same sizes in files alike
    but for their names), which is exact and O(files) a rank, where decoding is
    O(tensors). The ranks that ran are read all the same, and :data:`DERIVED_CHECKED`
    absent ranks both ways, compared (:class:`ModelMismatch`)."""
    index = read_index(ckpt)
    prefix = key_of(store, "")
    full: dict[str, int] = defaultdict(int)
    whole = whole_items(index)
    entries = {t.fqn: t for t in index.tensors}
    shared, total = set(), 0
    for idx, loc in sorted(whole.items(), key=lambda kv: kv[1].length):
        if loc.length > SHARED_ITEM_MAX or total + loc.length > SHARED_BYTES_MAX:
            break
        shared.add(idx)
        total += loc.length

    def whole_size(idx: MetadataIndex, loc: Location) -> tuple[int, bool]:
        t = entries.get(idx.fqn)
        if t is None:
            return loc.length, False
        return math.prod(t.size) * _itemsize(t.properties.dtype), True

    everyone = []  # the whole items every rank reads itself
    for idx, loc in whole.items():
        n, tensor = whole_size(idx, loc)
        full[loc.file] += n
        if idx not in shared:
            everyone.append((prefix + loc.file, n, tensor))
    shared_reads = [(prefix + whole[i].file, whole[i].length, False) for i in shared]

    @dataclass
    class Part:
        """A rank's chunks: the bytes of each of its files, its GETs, its chunk count."""

        files: dict[str, int]
        gets: list[tuple[str, int]]
        chunks: int

    def decoded(r: int) -> Part:
        raw = store.get(records_name(r, index.key_spread))
        mine = RankRecords.decode(raw, source=records_name(r, index.key_spread), rank=r,
                                  index=index)
        reads, boxes = [], set()
        files: dict[str, int] = defaultdict(int)
        for rec in mine.records:
            t = index.tensors[rec.tensor]
            box = t.rule.chunk(t.size, r)
            assert box is not None
            n = math.prod(box[1]) * _itemsize(t.properties.dtype)
            files[rec.location.file] += n
            if n:
                reads.append((prefix + rec.location.file, n, True))
                boxes.add((t.fqn, box[0]))
        if r in full_plans:
            planned = {(i.storage_index.fqn, tuple(i.storage_index.offset or ()))
                       for i in full_plans[r] if i.type == LoadItemType.TENSOR}
            chunked = {b for b in planned if entries[b[0]].rule.kind != WHOLE}
            if chunked != boxes:
                raise ModelMismatch(f"rank {r}'s resume read {len(chunked)} chunks, the model "
                                    f"{len(boxes)}: {sorted(chunked ^ boxes)[:3]}")
        gets = reader_gets(reads + everyone + (shared_reads if r == 0 else []), part)
        return Part(dict(files), gets, len(mine.records))

    def renamed(p: Part, src: int, r: int) -> Part:
        """``src``'s part as rank ``r`` of its class has it: its files named after ``r``."""
        names = {f: _file_name(f"__{r}_", index.key_spread, _file_number(f, src))
                 for f in p.files}
        paths = {prefix + a: prefix + b for a, b in names.items()}
        return Part({names[f]: n for f, n in p.files.items()},
                    [(paths.get(k, k), n) for k, n in p.gets], p.chunks)

    reps: dict[Any, tuple[int, Part]] = {}  # a class's first rank, and its part
    checked = derived = next_check = 0
    gets: dict[int, list[tuple[str, int]]] = {}
    items = len(whole)
    for r in range(world):
        if kind is None or r in full_plans:
            mine = decoded(r)
        else:
            k = kind(r)
            if k not in reps:
                mine = decoded(r)
                reps[k] = (r, mine)
            else:
                mine = renamed(reps[k][1], reps[k][0], r)
                derived += 1
                if checked < DERIVED_CHECKED and r >= next_check:  # spread over the world
                    checked += 1
                    next_check = r + world // (DERIVED_CHECKED + 1)
                    if decoded(r) != mine:
                        raise ModelMismatch(f"rank {r}'s records, derived from rank "
                                            f"{reps[k][0]}'s, are not the ones it wrote")
        for f, n in mine.files.items():
            full[f] += n
        items += mine.chunks
        gets[r] = mine.gets
    if derived and not checked:
        raise ModelMismatch(f"none of the {derived} derived ranks' records was checked")
    recorder(BUCKET).take()  # the simulation's own reads
    per_rank: dict[int, list[tuple[str, int]]] = defaultdict(list)
    for path, size in full.items():
        rank = int(path.rsplit("/", 1)[-1].split("_")[2])
        per_rank[rank].append((prefix + path, size))
    return per_rank, gets, items


def _file_number(name: str, rank: int) -> int:
    """``i`` of ``__<rank>_<i>.distcp``, rank ``rank``'s ``i``-th data file."""
    base = name.rsplit("/", 1)[-1]
    head = f"__{rank}_"
    if not base.startswith(head) or not base.endswith(SUFFIX):
        raise ModelMismatch(f"{name} is not a data file of rank {rank}")
    return int(base[len(head):-len(SUFFIX)])


_ITEMSIZE: dict[torch.dtype, int] = {}


def _itemsize(dtype: torch.dtype) -> int:
    if dtype not in _ITEMSIZE:
        _ITEMSIZE[dtype] = torch.empty((), dtype=dtype).element_size()
    return _ITEMSIZE[dtype]


@dataclass
class Result:
    """What one simulated job asked of the bucket."""

    ranks: int
    phases: dict[str, Phase]
    sizes: dict[str, int]
    objects: dict[str, int]
    cpu: dict[str, float]
    peaks: dict[str, tuple[int, str]]
    key_spread: int
    items: int
    prefixes: dict[str, str]
    layout: str = "flat"
    #: The ranks that ran (all of them, unless sampled); requests are theirs.
    running: tuple[int, ...] = ()
    #: Whether the DCP part is in the indexed format (an index and each rank's records).
    indexed: bool = False
    #: The size of each rank's records object, by its name (``__<rank>_records``).
    records: dict[str, int] = field(default_factory=dict)

    def others(self) -> list[int]:
        """The ranks that ran, but the coordinator."""
        return [r for r in (self.running or range(self.ranks)) if r != 0]


def simulate(ranks: int, *, bandwidth: float = 1e9, layout: str = "flat",
             sample: int | None = None, name: str | None = None,
             reshard: int | None = None) -> Result:
    """A job of ``ranks`` ranks: two manager saves (the second's retention deletes the
    first) and a resume; returns what each phase asked of the bucket.

    With ``sample``, only that many ranks run (:func:`sample_ranks`: the coordinator,
    the last and some between); the others' contributions to every collective are
    modelled (:class:`AbsentRanks`), their objects stand in the store unwritten, and
    requests are those of the ranks that ran. ``name`` is the store prefix (by
    default ``n<ranks>``). With ``reshard``, a fourth phase: a fresh world of that many
    ranks (sampled alike) loads the DCP part onto its own sharding."""
    store = open_store(f"count://{BUCKET}/{name or f'n{ranks}'}")
    store.delete([o.key for o in store.list()])
    recorder(BUCKET).take()
    absent: AbsentRanks | None = None
    if sample is not None and sample < ranks:
        running = sample_ranks(ranks, sample)
        absent = AbsentRanks(ranks, layout, running)
        world: ThreadWorld = SampledWorld(ranks, running, absent)
    else:
        world = ThreadWorld(ranks)
    states: dict[int, dict[str, Any]] = {}
    phases: dict[str, Phase] = {}
    cpu: dict[str, float] = {}
    opts = ManagerOptions(keep_last=1)

    def save(step: int) -> Callable[[int], None]:
        if absent is not None:
            absent.checkpoint = store.child(f"run/step-{step}")

        def run(r: int) -> None:
            state = states.setdefault(r, rank_state(r, ranks, layout))
            with CheckpointManager(store.child("run"), opts) as mgr:
                mgr.save(StepInfo(global_step=step, steps_per_epoch=1000), state,
                         per_rank={"data": {"rank": r, "position": step}}, force=True)
        return run

    full_plans: dict[int, list[ReadItem]] = {}

    def resume(r: int) -> None:
        mgr = CheckpointManager(store.child("run"), opts)
        info = mgr.restore(states.pop(r), per_rank={"data": {}},
                           planner=ShardLoadPlanner(full_plans))
        assert info is not None and info.global_step == 200, info

    later: dict[str, float] = {}
    with world.patched(), memoised_placeholder_saves(), per_rank_plans():
        with coordinator_cpu(cpu, SAVE_TIMED):
            phases["save"] = _run(world, "save", save(100))
            progress(ranks, "save")
        with coordinator_cpu(later, SAVE_TIMED):
            phases["save + retention"] = _run(world, "save + retention", save(200))
            progress(ranks, "save + retention")
        cpu.update({f"{k}, later": v for k, v in later.items()})
        if absent is not None and METADATA_NAME in open_checkpoint(
                store.child("run/step-200/model")).files:
            absent.metadata_bytes = _quietly_read(store.child("run/step-200/model"),
                                                  METADATA_NAME)
        with coordinator_cpu(cpu, RESUME_TIMED):
            phases["resume"] = _run(world, "resume", resume)
            progress(ranks, "resume")
    if reshard is not None:
        phases["reshard"] = _reshard(store.child("run/step-200/model"), reshard, layout,
                                     sample, cpu)
        progress(ranks, "reshard")
    if absent is not None:
        full_plans.update(absent.load_plans)

    # The data objects at full scale, from the checkpoints' own .metadata or index and
    # records (step 100's files had the same names and sizes; it is deleted by now).
    model = store.child("run/step-200/model")
    ckpt = open_checkpoint(model)
    recorder(BUCKET).take()
    md_raw = _quietly_read(model, METADATA_NAME) if METADATA_NAME in ckpt.files else b""
    if is_indexed(ckpt):
        files, resume_gets, n_items = indexed_data(
            model, ckpt, ranks, full_plans, store.part_size,
            absent.kind if absent is not None else None)
    else:
        md = load_metadata(md_raw)
        files, n_items = written_files(model, md), len(md.storage_data)
        resume_gets = classic_reads(model, md, full_plans, store.part_size)
    phases["save + retention"].data = files
    phases["save"].data = {r: [(k.replace("step-200", "step-100"), n) for k, n in f]
                           for r, f in files.items()}
    phases["resume"].data = resume_gets
    for ph in phases.values():
        if ph.name != "reshard":  # its data keys are those it read
            ph.data_keys = {k for objs in ph.data.values() for k, _ in objs}
    progress(ranks, "the data at full size")
    part = store.part_size
    peaks = {
        "write": peak_per_prefix(upload_sends(phases["save"].data, bandwidth, part),
                                 WRITE_KINDS),
        "read": peak_per_prefix(download_sends(phases["resume"].data, bandwidth), READ_KINDS),
    }
    # The same save with every file in the checkpoint's own prefix, for comparison.
    peaks["write, unspread"] = peak_per_prefix(upload_sends(
        {r: [(key_of(model, k.rsplit("/", 1)[-1]), n) for k, n in f]
         for r, f in files.items()}, bandwidth, part), WRITE_KINDS)
    progress(ranks, "the rates per prefix")
    raw = {"DCP manifest": _quietly_read(model, MANIFEST_NAME),
           "root manifest": _quietly_read(store.child("run/step-200"), MANIFEST_NAME),
           ".metadata": md_raw}
    sizes = {k: len(v) for k, v in raw.items()}
    manifest, root = json.loads(raw["DCP manifest"]), json.loads(raw["root manifest"])
    indexed = manifest["metadata"]["dcp"].get("format") == INDEXED_FORMAT
    sizes["index"] = manifest["files"].get(INDEX_NAME, {}).get("size", 0)
    objects = {"dcp": len(manifest["files"]) + 1, "checkpoint": len(root["files"]) + 1}
    prefixes = {"dcp": key_of(model, ""), "root": key_of(store.child("run"), "")}
    return Result(ranks, phases, sizes, objects, cpu, peaks,
                  int(manifest["metadata"]["dcp"].get("key_spread", 0)), n_items,
                  prefixes, layout, world.ranks, indexed,
                  {n.rsplit("/", 1)[-1]: f["size"] for n, f in manifest["files"].items()
                   if n.rsplit("/", 1)[-1].endswith("_records")})


_STARTED = time.monotonic()


def progress(ranks: int, done: str) -> None:
    """Say on stderr what a simulation has done, when, and the process's peak memory so
    far (a run at 16,384 ranks takes many minutes: where they go)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    print(f"[N={ranks}] {done}: {time.monotonic() - _STARTED:.0f} s, peak RSS {peak:.1f} GiB, "
          f"load {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)


def _reshard(model: Store, ranks: int, layout: str, sample: int | None,
             cpu: dict[str, float]) -> Phase:
    """``ranks`` fresh ranks load the DCP checkpoint at ``model`` onto their sharding
    (``cloudckpt.dcp.load``: no collective carries per-rank payloads, so the absent
    ranks of a sampled world contribute nothing but None)."""
    import cloudckpt.dcp as cdcp

    if sample is not None and sample < ranks:
        world: ThreadWorld = SampledWorld(ranks, sample_ranks(ranks, sample), RankModel())
    else:
        world = ThreadWorld(ranks)
    targets = tuple((c, m, label.replace("resume", "reshard")) for c, m, label in RESUME_TIMED)

    def load(r: int) -> None:
        state = rank_state(r, ranks, layout)
        cdcp.load(state, model, planner=ReshardPlanner())

    with world.patched(), memoised_placeholder_saves(), coordinator_cpu(cpu, targets):
        phase = _run(world, "reshard", load)
    phase.data_keys = {q.key for q in phase.requests if q.key.endswith(".distcp")}
    phase.records_needed = {r: records_needed(model, r, ranks, layout)
                            for r in {q.rank for q in phase.requests if q.rank is not None}}
    recorder(BUCKET).take()  # the simulation's own reads
    return phase


def records_needed(model: Store, rank: int, ranks: int, layout: str) -> int:
    """The bytes of records rank ``rank`` of ``ranks`` needs to load the DCP checkpoint
    at ``model`` onto its sharding: for each saved rank holding a chunk its state
    overlaps, that rank's header and file names and the records of the tensors
    overlapped (a reader cannot know less; on the layout saved with, its own records)."""
    ckpt = open_checkpoint(model)
    index = read_index(ckpt)
    needs = holders(index, rankload.local_needs(rank_state(rank, ranks, layout)))
    total = 0
    for saved, tensors in needs.items():
        size = ckpt.entry(records_name(saved, index.key_spread)).size
        total += size - RECORD_SIZE * (len(index.held(saved)) - len(tensors))
    return total


def key_of(store: Store, key: str) -> str:
    """``key`` of ``store`` as the bucket sees it (what the recorder logs)."""
    return store.root.strip("/").split("/", 1)[1] + "/" + key




# -------------------------------------------------------------------- bounds


def check_bounds(res: Result) -> list[str]:
    """The bounds of docs/scale.md that ``res`` breaks (none, when all hold)."""
    bad: list[str] = []
    save, again, resume = res.phases["save"], res.phases["save + retention"], res.phases["resume"]
    dcp, root = res.prefixes["dcp"], res.prefixes["root"]
    # Saving: besides its data objects, a rank writes its own state file, nothing else;
    # the coordinator's extra requests do not grow with the world size.
    # In the indexed format a rank also writes its records (and, resuming, reads them).
    def own(kind: str, r: int) -> list[tuple[str, str]]:
        return sorted([(kind, f"rank-{r:05d}.bin")] +
                      ([(kind, f"__{r}_records")] if res.indexed else []))

    for ph in (save, again):
        for r in res.others():
            extra = [q for q in ph.requests if q.rank == r and q.key not in ph.data_keys]
            if sorted((q.kind, q.key.rsplit("/", 1)[-1]) for q in extra) != own("PUT", r):
                bad.append(f"{ph.name}: rank {r} sent {_fmt(Counter(q.kind for q in extra))} "
                           "besides its data objects, its state file"
                           + (" and its records" if res.indexed else ""))
                break
    coordinator = save.by_rank().get(0, Counter())
    if sum(coordinator.values()) > COORDINATOR_SAVE_MAX:
        bad.append(f"save: the coordinator sent {_fmt(coordinator)} besides its data objects, "
                   f"over {COORDINATOR_SAVE_MAX}")
    commits = [q for q in save.requests if q.conditional and q.key.endswith(MANIFEST_NAME)]
    if len(commits) != 2 or any(q.rank != 0 for q in commits):
        bad.append(f"save: {len(commits)} create-only manifest writes, expected 2 (DCP part "
                   "and root) by the coordinator")
    # Resuming: only the coordinator lists and reads manifests, .metadata and shared
    # state, each once per job; every other rank reads its own state file and data.
    for r in res.others():
        extra = [q for q in resume.requests if q.rank == r and q.key not in resume.data_keys]
        # A rank holding no rows of any tensor (past the last chunk of each: the last of
        # 16,384 ranks) needs no saved rank's records, its own included.
        expected = own("GET", r) if holds_rows(r, res.ranks, res.layout) else \
            [("GET", f"rank-{r:05d}.bin")]
        if sorted((q.kind, q.key.rsplit("/", 1)[-1]) for q in extra) != expected:
            bad.append(f"resume: rank {r} sent {[(q.kind, q.key) for q in extra][:6]} besides "
                       "its data and its own state file"
                       + (" and records" if res.indexed else ""))
            break
    # Records: each read by the rank that wrote it only (on the layout saved with).
    for q in resume.requests:
        name = q.key.rsplit("/", 1)[-1]
        if name.endswith("_records") and name != f"__{q.rank}_records":
            bad.append(f"resume: rank {q.rank} read {name}, another rank's records")
            break
    for r in res.others():
        theirs = [q.key for q in resume.requests if q.rank == r and q.key.endswith(".distcp")
                  and not q.key.rsplit("/", 1)[-1].startswith(f"__{r}_")]
        if theirs:
            bad.append(f"resume: rank {r} read {len(theirs)} data objects of other ranks "
                       f"(e.g. {theirs[0]}); it needs only its own")
            break
    metadata = {dcp + INDEX_NAME: res.sizes["index"]} if res.indexed else {
        dcp + METADATA_NAME: res.sizes[".metadata"]}
    once = {dcp + MANIFEST_NAME: res.sizes["DCP manifest"], **metadata,
            root + "step-200/" + MANIFEST_NAME: res.sizes["root manifest"],
            root + "step-200/state/shared.bin": None}
    if res.indexed:
        stock = [q for q in resume.requests if q.key == dcp + METADATA_NAME]
        if stock:
            bad.append(f"resume: {dcp + METADATA_NAME} read {len(stock)} times by ranks "
                       f"{sorted({q.rank for q in stock})}; an indexed load reads the index")
    for key, size in once.items():
        gets = [q for q in resume.requests if q.kind == "GET" and q.key == key]
        got = sum(q.size for q in gets)
        if not gets or any(q.rank != 0 for q in gets) or (size is not None and got != size):
            bad.append(f"resume: {key} read by ranks {sorted({q.rank for q in gets})}, "
                       f"{got} bytes in {len(gets)} GETs; expected once, by the coordinator")
    # The coordinator lists the root once, and the checkpoint (its objects' sizes, checked
    # before anything loads) in pages of 1,000 objects.
    lists = [q for q in resume.requests if q.kind == "LIST"]
    step = root + "step-200/"
    pages = -(-res.objects["checkpoint"] // 1000)  # its data, state files and manifests
    if (any(q.rank != 0 for q in lists) or [q.key for q in lists if q.key == root] != [root]
            or len([q for q in lists if q.key == step]) > pages
            or any(q.key not in (root, step) for q in lists)):
        bad.append(f"resume: {len(lists)} LISTs by ranks {sorted({q.rank for q in lists})} "
                   f"of {sorted({q.key for q in lists})}; expected one of the root and up "
                   f"to {pages} of the checkpoint, by the coordinator")
    # Request rates per prefix, and a manifest that can be read back.
    if res.peaks["write"][0] > S3_WRITE_LIMIT:
        bad.append(f"save: {res.peaks['write'][0]} PUT/POST a second on {res.peaks['write'][1]}, "
                   f"over S3's {S3_WRITE_LIMIT}")
    if res.peaks["read"][0] > S3_READ_LIMIT:
        bad.append(f"resume: {res.peaks['read'][0]} GET a second on {res.peaks['read'][1]}, "
                   f"over S3's {S3_READ_LIMIT}")
    if res.indexed:
        first, later = save_cpu(res)
        if first > FIRST_SAVE_CPU_MAX or later > LATER_SAVE_CPU_MAX:
            bad.append(f"save: the coordinator's plan + commit took {first:.1f} s of CPU the "
                       f"first time and {later:.1f} s the next; bounds {FIRST_SAVE_CPU_MAX:g} "
                       f"and {LATER_SAVE_CPU_MAX:g} s")
        for ph in (resume, *([res.phases["reshard"]] if "reshard" in res.phases else [])):
            n, key = largest_read(ph)
            if n > RESUME_OBJECT_MAX:
                bad.append(f"{ph.name}: a rank read {n} bytes of {key}, over "
                           f"{RESUME_OBJECT_MAX}")
            ratio = metadata_read_ratio(res, ph)
            if ratio > RECORDS_READ_MAX:
                bad.append(f"{ph.name}: a rank read {ratio:.2f}x its own records' bytes of "
                           f"metadata, over {RECORDS_READ_MAX:g}x")
    if res.sizes["DCP manifest"] > MAX_MANIFEST_BYTES:
        bad.append(f"the DCP manifest is {res.sizes['DCP manifest']} bytes, over the "
                   f"{MAX_MANIFEST_BYTES} a reader accepts")
    return bad


def holds_rows(rank: int, world: int, layout: str) -> bool:
    """Whether ``rank`` holds a row of any tensor (torch.chunk's: ceil rows a rank)."""
    for shape in param_shapes(layout, world).values():
        step = -(-shape[0] // world)
        if rank * step < shape[0]:
            return True
    return False


#: The most requests the coordinator of a save sends besides data objects, at any N.
COORDINATOR_SAVE_MAX = 40
#: The coordinator's non-data CPU per save (plan + commit), the first save and later
#: ones; the largest object a rank reads resuming; what a rank reads of metadata
#: resuming on the same layout, against its own records (issue 50's acceptance).
FIRST_SAVE_CPU_MAX, LATER_SAVE_CPU_MAX = 60.0, 5.0
RESUME_OBJECT_MAX = 64 * 2**20
RECORDS_READ_MAX = 2.0


def save_cpu(res: Result) -> tuple[float, float]:
    """The coordinator's CPU for planning and committing the first save and the next."""
    cpu = res.cpu
    return (cpu.get("plan", 0.0) + cpu.get("commit", 0.0),
            cpu.get("plan, later", 0.0) + cpu.get("commit, later", 0.0))


def largest_read(ph: Phase) -> tuple[int, str]:
    """The largest object (besides data objects) one rank read in ``ph``, in bytes."""
    got: Counter[tuple[int | None, str]] = Counter()
    for q in ph.requests:
        if q.kind == "GET" and q.key not in ph.data_keys:
            got[(q.rank, q.key)] += q.size
    if not got:
        return 0, ""
    (_, key), n = got.most_common(1)[0]
    return n, key


def metadata_read_ratio(res: Result, ph: Phase) -> float:
    """The most metadata (records, index, manifests) a rank but the coordinator read in
    ``ph`` (its state file not counted), over the records of the saved chunks it needs:
    resuming on the layout saved with, its own records file; resharding, the header
    and file names of each saved rank whose chunks it needs and the records of those
    chunks (:func:`records_needed`), so a rank reading whole the records of a saved rank
    it needs one chunk of counts the rest against the bound."""
    worst = 0.0
    reshard = ph.name == "reshard"
    ranks = sorted({q.rank for q in ph.requests if q.rank}) if reshard else res.others()
    for r in ranks:
        mine = ph.records_needed.get(r, 0) if reshard else \
            res.records.get(f"__{r}_records", 0)
        read = sum(q.size for q in ph.requests if q.rank == r and q.kind == "GET"
                   and q.key not in ph.data_keys and not q.key.endswith(f"rank-{r:05d}.bin"))
        if mine:
            worst = max(worst, read / mine)
    return worst


def reshard_records_gets(ph: Phase) -> dict[int, dict[str, int]]:
    """Per resharding rank, its GETs of records (ranged or whole, one a range) and their
    bytes, and the saved ranks whose records it read."""
    out: dict[int, dict[str, int]] = {}
    for q in ph.requests:
        if q.kind == "GET" and q.rank is not None and q.key.endswith("_records"):
            mine = out.setdefault(q.rank, {"gets": 0, "bytes": 0})
            mine["gets"] += 1
            mine["bytes"] += q.size
    for r, mine in out.items():
        mine["files"] = len({q.key for q in ph.requests
                             if q.rank == r and q.key.endswith("_records")})
    return dict(sorted(out.items()))


# -------------------------------------------------------------------- report


def _fmt(c: Counter[str]) -> str:
    return " ".join(f"{k} {v}" for k, v in sorted(c.items())) or "-"


#: What one request costs before its first byte, in the modelled restore time.
REQUEST_LATENCY = 0.03


def restore_model(res: Result, bandwidth: float, latency: float = REQUEST_LATENCY
                  ) -> dict[str, float]:
    """The time the simulated job's resume would take at ``bandwidth`` bytes/s a rank:
    the coordinator's serial part first (its requests for the listings, manifests,
    ``.metadata`` and shared state one after another, each ``latency`` plus its bytes
    at ``bandwidth``; its CPU reading ``.metadata`` and planning the load, measured),
    then every rank's data at once (the slowest rank's bytes at ``bandwidth``)."""
    resume = res.phases["resume"]
    serial = [q for q in resume.requests if q.rank == 0 and q.key not in resume.data_keys]
    metadata = sum(latency + q.size / bandwidth for q in serial)
    cpu = res.cpu.get("resume metadata", 0.0) + res.cpu.get("resume plan", 0.0)
    data = max((sum(n for _, n in gets) for gets in resume.data.values()), default=0)
    out = {"metadata_s": metadata, "coordinator_cpu_s": cpu, "data_s": data / bandwidth}
    out["total_s"] = sum(out.values())
    return {k: round(v, 3) for k, v in out.items()}


def summary(res: Result, bandwidth: float = 1e9) -> dict[str, Any]:
    """The figures of one job, as plain data."""
    part = DEFAULT_PART_SIZE

    def per_rank_max(ph: Phase, rank_from: int) -> dict[str, int]:
        ranks = res.others() if rank_from else [0]
        counts = ph.by_rank()
        return dict(max((counts.get(r, Counter()) for r in ranks),
                        key=lambda c: sum(c.values()), default=Counter()))

    save_data = [sum(len(s3_writes(n, part)) for _, n in f)
                 for f in res.phases["save"].data.values()]
    read_data = [len(g) for g in res.phases["resume"].data.values()]
    return {
        "ranks": res.ranks, "layout": res.layout,
        "sampled": len(res.running) if 0 < len(res.running) < res.ranks else None,
        "items": res.items, "objects": res.objects,
        "key_spread": res.key_spread, "sizes": res.sizes,
        "coordinator_cpu_s": {k: round(v, 2) for k, v in res.cpu.items()},
        "peaks": {k: {"per_s": n, "prefix": p} for k, (n, p) in res.peaks.items()},
        "save_data_requests_per_rank": max(save_data, default=0),
        "resume_data_gets_per_rank": max(read_data, default=0),
        "phases": {name: {
            "seconds": round(ph.seconds, 1),
            "coordinator": per_rank_max(ph, 0),
            "other_rank_max": per_rank_max(ph, 1),
        } for name, ph in res.phases.items()},
        "restore_model": restore_model(res, bandwidth),
        "indexed": res.indexed,
        "save_cpu_s": dict(zip(("first", "later"), (round(v, 2) for v in save_cpu(res)),
                               strict=True)),
        "resume_largest_read": dict(zip(("bytes", "key"), largest_read(res.phases["resume"]),
                                        strict=True)),
        "metadata_read_x_own_records": round(metadata_read_ratio(res, res.phases["resume"]), 2),
        **({"reshard": {
            "metadata_read_x_records": round(metadata_read_ratio(res, res.phases["reshard"]), 2),
            "largest_read": dict(zip(("bytes", "key"), largest_read(res.phases["reshard"]),
                                     strict=True)),
            "ranks": sorted({q.rank for q in res.phases["reshard"].requests
                             if q.rank is not None}),
            "records_gets": reshard_records_gets(res.phases["reshard"])}}
           if "reshard" in res.phases else {}),
        "records_bytes_max": max(res.records.values(), default=0),
        "violations": check_bounds(res),
    }


def _one(ranks: int, bandwidth: float, layout: str, sample: int | None,
         reshard: bool = False) -> dict[str, Any]:
    start = time.monotonic()
    out = summary(simulate(ranks, bandwidth=bandwidth, layout=layout, sample=sample,
                           reshard=ranks // 2 if reshard else None), bandwidth)
    out["wall_s"] = round(time.monotonic() - start, 1)
    return out


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def table(rows: list[dict[str, Any]], bandwidth: float) -> str:
    """The figures of every N, as a Markdown table."""
    head = ["ranks", "items", "objects (DCP / all)", "sub-prefixes", ".metadata MiB",
            "DCP manifest MiB", "root manifest KiB",
            "save req/rank: data + other", "save req by coordinator (other)",
            "save + retention, coordinator", "resume req/rank: data + other",
            "resume req by coordinator (other)",
            f"peak PUT/POST/s per prefix @{bandwidth / 1e9:g} GB/s (unspread)",
            "peak GET/s per prefix", "coordinator CPU s: plan / commit",
            f"modelled restore s @{bandwidth / 1e9:g} GB/s: metadata + coordinator + data",
            "index + .metadata MiB", "coordinator CPU s per save: first / later",
            "resume: largest object read MiB",
            "resume: metadata read / own records (reshard: / records of the chunks needed)",
            "simulated in s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in rows:
        ph = s["phases"]
        rm = s["restore_model"]
        cells = [
            f"{s['ranks']}" + (f" ({s['sampled']} run)" if s.get("sampled") else ""),
            s["items"], f"{s['objects']['dcp']} / {s['objects']['checkpoint']}",
            s["key_spread"] or "-", _mib(s["sizes"][".metadata"]),
            _mib(s["sizes"]["DCP manifest"]), f"{s['sizes']['root manifest'] / 1024:.0f}",
            f"{s['save_data_requests_per_rank']} + {sum(ph['save']['other_rank_max'].values())}",
            _fmt(Counter(ph["save"]["coordinator"])),
            _fmt(Counter(ph["save + retention"]["coordinator"])),
            f"{s['resume_data_gets_per_rank']} + "
            f"{sum(ph['resume']['other_rank_max'].values())}",
            _fmt(Counter(ph["resume"]["coordinator"])),
            f"{s['peaks']['write']['per_s']} ({s['peaks']['write, unspread']['per_s']})",
            s["peaks"]["read"]["per_s"],
            f"{s['coordinator_cpu_s'].get('plan', 0):.1f} / "
            f"{s['coordinator_cpu_s'].get('commit', 0):.1f}",
            f"{rm['total_s']:.1f}: {rm['metadata_s']:.1f} + {rm['coordinator_cpu_s']:.1f} + "
            f"{rm['data_s']:.1f}",
            f"{_mib(s['sizes'].get('index', 0))} + {_mib(s['sizes']['.metadata'])}",
            f"{s['save_cpu_s']['first']:.1f} / {s['save_cpu_s']['later']:.1f}",
            _mib(s["resume_largest_read"]["bytes"]),
            f"{s['metadata_read_x_own_records']:.2f}x"
            + (f" (reshard: {s['reshard']['metadata_read_x_records']:.2f}x)"
               if "reshard" in s else ""),
            s["wall_s"]]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 256, 1024])
    ap.add_argument("--bandwidth", type=float, default=1e9, help="bytes/s per rank")
    ap.add_argument("--layout", choices=LAYOUTS, default="flat",
                    help="FSDP1 flat parameters (default) or FSDP2 per-parameter shards")
    ap.add_argument("--sample", type=int, metavar="K",
                    help="run only K ranks of each world (the coordinator, the last, K - 2 "
                    "between) and model the others' collectives and objects at full size")
    ap.add_argument("--reshard", action="store_true",
                    help="then load each checkpoint onto half as many ranks (a fresh world)")
    ap.add_argument("--jobs", type=int, default=2,
                    help="world sizes simulated at once (one process each)")
    ap.add_argument("--json", action="store_true", help="end with a JSON summary line")
    args = ap.parse_args(argv)
    start = time.monotonic()
    # One process per world size, two at a time (largest first): a simulation is one
    # process's threads, so the second core runs the other sizes meanwhile.
    with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {n: pool.submit(_one, n, args.bandwidth, args.layout, args.sample,
                                  args.reshard)
                   for n in sorted(set(args.ranks), reverse=True)}
        rows = [futures[n].result() for n in sorted(futures)]
    print(table(rows, args.bandwidth))
    failed = [f"N={s['ranks']}: {v}" for s in rows for v in s["violations"]]
    print(f"\n{len(rows)} world sizes simulated in {time.monotonic() - start:.0f} s; "
          f"bounds: {'all hold' if not failed else f'{len(failed)} broken'}")
    for line in failed:
        print("  BROKEN", line)
    if args.json:
        print(json.dumps({"bandwidth": args.bandwidth, "results": rows}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
