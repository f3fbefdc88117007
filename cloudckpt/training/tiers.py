"""A node-local tier in front of the bucket: frequent cheap saves, some drained.

A local save is each rank's own: DCP with this rank alone (:data:`~cloudckpt.
runtime.coordination.SOLO`), so every rank holds whole copies of the tensors it
replicates and reads back nothing of another node's. It is committed like any
checkpoint (claim, CRC32C per object, manifest last), at
``<path>/rank-<r>/<name>``. Its files are named as rank ``r``'s of a job-wide save
(``model/__r_0.distcp``, ``state/rank-r.bin``), so a **drain** copies them into the
bucket under the same names: every rank sends its own, rank 0 merges the ranks'
DCP metadata (one copy of each replicated tensor; only the files that copy lives
in are sent) and commits a standard training checkpoint, which any world size
can load.

With ``replicas=k``, every local step is also copied to ``k`` partner ranks on
other nodes (:mod:`cloudckpt.training.replicas`). Resuming takes the newest step
that is committed in the bucket, or that *every* rank can get locally: from its own
tier, or from a partner's copy sent back over the group (:func:`common_steps`). A
rank that can get it from neither (a replaced node without copies) sends the whole
job to an older step or the bucket, never to a mix of steps.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)

from cloudckpt.core.blobs import BlobArea
from cloudckpt.core.checkpoint import Checkpoint, CheckpointWriter, open_checkpoint
from cloudckpt.core.deletion import delete_checkpoint
from cloudckpt.core.manifest import FileEntry, Written
from cloudckpt.core.retention import Managed, apply_retention
from cloudckpt.dcp.metadata import DCP_KIND, METADATA_NAME, load_metadata
from cloudckpt.errors import (
    CheckpointNotFoundError,
    CloudCkptError,
    ConfigError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
)
from cloudckpt.names import MANIFEST_NAME, MODEL_PART, TIERS_RECORD
from cloudckpt.runtime import coordination as coord
from cloudckpt.runtime.pending import run_in_background
from cloudckpt.storage import ObjectInfo, Store, as_store
from cloudckpt.training import multipart, replicas
from cloudckpt.training import snapshot as training
from cloudckpt.training.replicas import Held, Replicas

log = logging.getLogger(__name__)

#: The manifest metadata key of a local-tier checkpoint: the job it belongs to.
TIER_KEY = "local_tier"
#: How long past ``LocalTier.drain_timeout`` a drain at close is waited for: its commit
#: was refused at the timeout on every rank; only a hung one runs on.
LATE = 30.0


@dataclass(frozen=True)
class LocalTier:
    """A node-local directory in front of the bucket (local NVMe, or ``/dev/shm``).

    A local save every ``every_steps`` steps; every ``drain_every``-th of them is
    then copied to the bucket in the background (None: none is); each rank keeps its
    newest ``keep_last`` local checkpoints, and one still draining. ``fsync`` makes
    each local file durable against a power loss, not only a killed process.

    ``drain_at_close``: the manager's ``close()`` drains the newest local step unless
    the bucket holds it (or a newer step this process saved) already, and raises if
    that drain fails or has not committed within ``drain_timeout`` seconds; off,
    ``close()`` only warns that the steps stay on the nodes' disks.

    ``replicas``: each local step is also copied, in the background, to that many
    partner ranks on other nodes (the same local index on the next nodes), so that a
    lost node's ranks resume from their partners' copies instead of the bucket. It
    needs more nodes than ``replicas`` and as many ranks on each.
    """

    path: str
    every_steps: int
    drain_every: int | None = None
    keep_last: int = 2
    fsync: bool = False
    drain_at_close: bool = True
    drain_timeout: float = 600.0
    replicas: int = 0

    def __post_init__(self) -> None:
        if not self.path or "://" in self.path:
            raise ConfigError(f"LocalTier.path must be a local directory, got {self.path!r}")
        if not isinstance(self.replicas, int) or self.replicas < 0:
            raise ConfigError(f"LocalTier.replicas must be a whole number >= 0, "
                              f"got {self.replicas!r}")
        for name in ("every_steps", "keep_last", "drain_every", "drain_timeout"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"LocalTier.{name} must be positive, got {value}")


class LocalCopies:
    """This rank's local tier: where its checkpoints go, which are committed, and its
    retention (only checkpoints of the manager's kind and naming, ``managed``)."""

    def __init__(self, tier: LocalTier, managed: Managed, group: Any = None, *,
                 incremental: bool = False) -> None:
        self.tier = tier
        self.managed = managed
        self.incremental = incremental  # drained incrementally: one file per large tensor
        self.rank, self.world = coord.rank(group), coord.world_size(group)
        self.host = socket.gethostname()
        self.store = as_store(os.path.join(os.path.abspath(tier.path), f"rank-{self.rank:05d}"),
                              {"fsync": tier.fsync})
        self.replicas = Replicas(tier.path, managed, self.world, fsync=tier.fsync,
                                 keep_last=tier.keep_last) if tier.replicas else None
        self._plan: list[list[int]] | None = None

    def save(self, name: str, state: Mapping[str, Any], captured: training.Captured,
             step: int) -> Checkpoint:
        """Commit this rank's local checkpoint ``name`` (no collective)."""
        job = {"world_size": self.world, "rank": self.rank, "host": self.host}
        ckpt = training.write(
            self.store.child(name), state, captured,
            training.WriteOptions(step=step, metadata={TIER_KEY: job}, as_rank=self.rank,
                                  file_per_tensor=self.incremental),
            group=coord.SOLO)
        assert ckpt is not None
        return ckpt

    def steps(self) -> dict[int, str]:
        """This rank's committed local checkpoints of this job's shape: step -> name."""
        return replicas.job_steps(self.store, self.managed, TIER_KEY, self.rank, self.world)

    def held(self) -> Held:
        """This rank's committed local steps, and the copies it keeps of other ranks'."""
        return Held(self.steps(), self.replicas.held(TIER_KEY) if self.replicas else {})

    def plan(self, group: Any) -> list[list[int]]:
        """Each rank's partners (:func:`~cloudckpt.training.replicas.partners`), from
        every rank's host; a collective the first time, on every rank."""
        if self._plan is None:
            hosts = coord.each_rank(lambda: self.host, group)
            self._plan = coord.checked(lambda: replicas.partners(hosts, self.tier.replicas),
                                       group)
            if self.rank == 0:
                log.info("local tier: each step is copied to %d partner(s): %s",
                         self.tier.replicas, ", ".join(
                             f"{r}->{'+'.join(map(str, ps))}" for r, ps in enumerate(self._plan)))
        return self._plan

    def replicate(self, ckpt: Checkpoint, name: str, plan: list[list[int]], group: Any
                  ) -> None:
        """Copy ``ckpt`` (this rank's local step ``name``) to its partners and keep the
        copies other ranks send this one; every rank of ``group``."""
        assert self.replicas is not None
        replicas.replicate(ckpt, name, self.rank, plan, self.replicas, group)

    def open(self, name: str) -> Checkpoint:
        return open_checkpoint(self.store.child(name))

    def restore(self, name: str, state: Mapping[str, Any], options: training.ReadOptions,
                **objects: Any) -> training.Restored:
        """Load this rank's local checkpoint ``name`` in place (no collective but the
        agreement of ``options.checks_group``, when given, on the checks made first);
        ``objects``: the ``shared`` and ``per_rank`` stateful objects."""
        return training.read(self.store.child(name), state,
                             replace(options, as_rank=self.rank), group=coord.SOLO, **objects)

    def prunes_copies(self, group: Any) -> bool:
        """Whether this rank prunes the copies kept in its node's replicas directory:
        the ranks of a node share it, and the first of them (by host and directory) does;
        a collective, on every rank."""
        if self.replicas is None:
            return False
        where = (self.host, os.path.realpath(self.replicas.root))
        return coord.each_rank(lambda: where, group).index(where) == self.rank

    def prune_after(self, step: int | None, copies: bool = False) -> list[str]:
        """Delete this rank's local checkpoints newer than ``step`` (every one, for
        None), once the job resumed from ``step``: they belong to an abandoned run
        of steps, and their names are the ones the coming saves need. ``copies``: the
        node's copies of other ranks' steps too (:meth:`prunes_copies`)."""
        pruned = []
        for n, name in sorted(self.steps().items()):
            if step is None or n > step:
                delete_checkpoint(self.store.child(name))
                log.info("local tier: deleted %s (step %d, newer than the resumed step %s)",
                         self.store.child(name).uri, n, step)
                pruned.append(name)
        if self.replicas is not None and copies:
            for copy in self.replicas.prune_after(step, TIER_KEY):
                log.info("local tier: deleted the copy %s (newer than the resumed step %s)",
                         copy, step)
        return pruned

    def retain(self, keep: set[str]) -> list[str]:
        """Apply ``keep_last`` to this rank's local checkpoints, never deleting
        ``keep`` (the newest, and one still draining: not yet durable elsewhere)."""
        return apply_retention(self.store, self.tier.keep_last, number=self.managed, keep=keep)


def common_steps(held: list[Held]) -> list[int]:
    """The steps every rank can resume from locally (its own copy, or a partner's),
    newest first; ``held``: every rank's."""
    can = replicas.available(held)
    common = set(can[0]).intersection(*can[1:])
    newest = max((s for steps in can for s in steps), default=None)
    if newest is not None and newest not in common:
        lacking = [r for r, steps in enumerate(can) if newest not in steps]
        log.warning("local step %d is missing from the local tier of rank(s) %s, and no "
                    "partner holds a copy (a replaced node, or a save that died): the job "
                    "resumes from an older step every rank holds, or from the bucket",
                    newest, lacking)
    return sorted(common, reverse=True)


def restore_newest(local: LocalCopies, state: Mapping[str, Any], newest: int | None,
                   group: Any, options: training.ReadOptions, **objects: Any
                   ) -> training.Restored | None:
    """Resume from the local tier when every rank can get a step at least as new as
    the bucket's ``newest`` (its own copy, or a partner's, fetched first) and can
    read it; None (on every rank) to go on to the bucket. A step some rank cannot
    fetch or read sends every rank to an older one; one that some rank refuses (its
    checks) is loaded by none."""
    held = coord.each_rank(local.held, group)
    for step in common_steps(held):
        if newest is not None and step < newest:
            break
        restored, err = None, None
        try:
            if any(step not in h.own for h in held):
                _fetch(local, step, held, group)
            restored = local.restore(local.steps()[step], state,
                                     replace(options, step=step, checks_group=group), **objects)
        except CloudCkptError as exc:
            err = exc
        try:
            coord.agree(err, group)
        except CloudCkptError as exc:
            log.warning("local step %s cannot be resumed from (%s); trying an older one, "
                        "then the bucket", step, exc)
            continue
        assert restored is not None
        log.info("resumed from the local tier: %s (step %s)", restored.checkpoint.uri, step)
        return restored
    return None


def _fetch(local: LocalCopies, step: int, held: list[Held], group: Any) -> None:
    """The ranks lacking ``step`` get it from a partner's copy (agreed on every rank)."""
    if local.replicas is None:  # no copies held: every rank has its own
        return
    got = replicas.fetch_missing(step, held, local.rank, local.store, local.replicas, group)
    if got:
        log.info("local tier: rank %d fetched its step %d from a partner's copy", local.rank,
                 step)


def write_record(root: Store, held: list[tuple[str, list[int]]]) -> None:
    """Rank 0: record in the run root which host holds which local steps, per rank
    (``held``), and the steps every rank holds; a failure is a WARNING."""
    common = set(held[0][1]).intersection(*(steps for _, steps in held[1:]))
    record = {"world_size": len(held), "updated": time.time(), "complete": sorted(common),
              "ranks": [{"rank": r, "host": host, "steps": steps}
                        for r, (host, steps) in enumerate(held)]}
    try:
        root.put(TIERS_RECORD, json.dumps(record, indent=1).encode())
    except CloudCkptError as exc:
        log.warning("could not update %s (%s); the local saves are not affected",
                    root.key_uri(TIERS_RECORD), exc)


# ------------------------------------------------------------------- draining


def merge_metadata(ranks: list[Metadata]) -> tuple[Metadata, set[str]]:
    """One job-wide DCP metadata from every rank's own: each tensor chunk (by offset)
    and each non-tensor item taken from the first rank that has it. Returns it with
    the files it refers to."""
    state: dict[str, Any] = {}
    storage: dict[MetadataIndex, Any] = {}
    planner: dict[str, Any] = {}
    for md in ranks:
        planner.update(md.planner_data or {})
        sd = md.storage_data or {}
        for fqn, item in md.state_dict_metadata.items():
            if not isinstance(item, TensorStorageMetadata):
                if fqn not in state:
                    state[fqn] = item
                    storage[MetadataIndex(fqn)] = sd[MetadataIndex(fqn)]
                continue
            merged = state.setdefault(fqn, TensorStorageMetadata(item.properties, item.size, []))
            if not isinstance(merged, TensorStorageMetadata) or merged.size != item.size:
                raise CorruptCheckpointError(f"the ranks' local checkpoints disagree about "
                                             f"{fqn!r}; it cannot be drained", {fqn: "differs"})
            for chunk in item.chunks:
                index = MetadataIndex(fqn, chunk.offsets)
                if index not in storage:
                    merged.chunks.append(chunk)
                    storage[index] = sd[index]
    out = Metadata(state_dict_metadata=state, planner_data=planner, storage_data=storage)
    if ranks and getattr(ranks[0], "version", None) is not None:
        out.version = ranks[0].version
    return out, {info.relative_path for info in storage.values()}


@dataclass
class _RankLocal:
    """What a rank's local checkpoint holds, as the drain needs it."""

    metadata: Metadata
    item_crcs: dict[str, str]


@dataclass
class Drained:
    """A :class:`~cloudckpt.training.multipart.Part`: each rank's committed local
    checkpoint ``local``, sent into the bucket checkpoint under the same names."""

    local: Checkpoint
    step: int | None = None
    #: A drain of an incremental save: each file a blob of this area.
    blobs: BlobArea | None = None

    def write(self, store: Store, group: Any) -> Any:
        model = self.local.store.child(MODEL_PART)
        dcp = open_checkpoint(model)
        mine = _RankLocal(load_metadata(dcp.read(METADATA_NAME), source=model.key_uri(
            METADATA_NAME)), dict((dcp.metadata.get("dcp") or {}).get("item_crcs") or {}))
        ranks = coord.each_rank(lambda: mine, group)
        merged, used = merge_metadata([r.metadata for r in ranks])
        # The DCP part is claimed before any rank writes into it, as a DCP save does.
        part = coord.on_coordinator(lambda: self._claim(store), group, share=False)
        keys = [k for k in self.local.manifest.files if _sent_by_rank(k, used)]
        try:
            sent = coord.each_rank(lambda: self._send(store, keys), group)
        except BaseException:
            if part is not None:
                part.abandon()
            raise
        crcs = {path: packed for r in ranks for path, packed in r.item_crcs.items()
                if path in used}
        return part, merged, crcs, [e for entries in sent for e in entries]

    def _claim(self, store: Store) -> CheckpointWriter:
        part = CheckpointWriter(store.child(MODEL_PART), step=self.step, kind=DCP_KIND,
                                blobs=self.blobs)
        part.claim()
        return part

    def _send(self, store: Store, keys: list[str]) -> list[Written]:
        """Send the local checkpoint's files (as blobs of an incremental run), each
        checked against the local manifest."""
        paths = {key: self.local.store.path(key) for key in keys}
        if self.blobs is None:
            sent: Mapping[str, FileEntry] = dict(zip(keys, store.map(
                lambda key: FileEntry(*_size_crc(store.put_file(key, paths[key]))), keys),
                strict=True))
        else:
            sent = self.blobs.put_files(store, paths)
        entries = []
        for key in keys:
            entry, got = self.local.entry(key), sent[key]
            if got.size != entry.size or got.crc32c != entry.crc32c:
                raise CorruptCheckpointError(
                    f"{self.local.store.key_uri(key)} changed after its local commit "
                    f"(crc32c {got.crc32c}, {got.size} bytes; the manifest says "
                    f"{entry.crc32c}, {entry.size}); this drain stops, nothing is committed",
                    {key: "differs"})
            entries.append(multipart.entry(store, key, entry.size, entry.crc32c, got.blob))
        return entries

    def commit(self, writer: CheckpointWriter, written: Any) -> None:
        part, merged, crcs, entries = written
        shared = self.local.read(training.SHARED)
        for w in entries:
            if w.path.startswith(f"{MODEL_PART}/"):
                part.add_existing(w.path[len(MODEL_PART) + 1:], w.entry.size, w.entry.crc32c,
                                  w.entry.blob, w.entry.moved)
        part.metadata = {"dcp": {"item_crcs": crcs, "key_spread": 0}}
        merged.storage_meta = StorageMeta(checkpoint_id=part.uri)
        part.put(METADATA_NAME, pickle.dumps(merged))
        part.commit()
        writer.add_part(MODEL_PART)
        multipart.Stored(w for w in entries if not w.path.startswith(f"{MODEL_PART}/")
                         ).commit(writer, None)
        writer.put(training.SHARED, shared)


def _sent_by_rank(key: str, used: set[str]) -> bool:
    """Whether ``key`` of a rank's local checkpoint goes into the drained one: its DCP
    files that the merged metadata refers to, and its per-rank state."""
    if key.startswith(f"{MODEL_PART}/"):
        return key[len(MODEL_PART) + 1:] in used
    return key.startswith("state/") and key != training.SHARED and \
        not key.endswith(MANIFEST_NAME)


def drain(local: Checkpoint, dest: Store, *, group: Any = None,
          figures: multipart.Part | None = None, incremental: bool = False,
          deadline: float | None = None, index: bool = False) -> Checkpoint | None:
    """Commit each rank's local checkpoint ``local`` as one training checkpoint at
    ``dest``; call on every rank. Returns it on rank 0, None elsewhere; if any rank
    fails, every rank raises and nothing is committed. ``incremental``: each file a
    blob of the area above ``dest``, sent only when its bytes are new; ``deadline``
    (``time.monotonic()``) refuses a commit after it; ``index``: as
    :class:`~cloudckpt.training.snapshot.WriteOptions` says."""
    area = BlobArea.above(dest, 1) if incremental else None
    parts: list[multipart.Part] = [Drained(local, local.step, area),
                                   *([figures] if figures else [])]
    return multipart.save(dest, parts, group=group, step=local.step, kind=training.KIND,
                          blobs=area, deadline=deadline, index=index,
                          metadata={**training.root_metadata(coord.world_size(group),
                                                             local.metadata.get("step_info")),
                                    "drained": True})


def in_bucket(dest: Store, local: Checkpoint) -> bool:
    """Whether ``dest`` holds this rank's local checkpoint ``local`` committed already
    (drained before): the same step, and this rank's files there with the CRC32Cs of
    its local copy. A step of the same number from an abandoned run of steps is not it."""
    try:
        ckpt = open_checkpoint(dest)
    except (CheckpointNotFoundError, IncompleteCheckpointError):
        return False
    if ckpt.manifest.kind != training.KIND or ckpt.step != local.step:
        return False
    own = [p for p in local.manifest.files if p in ckpt.manifest.files
           and (p.endswith(".distcp") or p.startswith("state/rank-"))]
    return bool(own) and all(ckpt.entry(p).crc32c == local.entry(p).crc32c for p in own)


def drain_at_close(local: LocalCopies, name: str, step: int, dest: Store, group: Any,
                   drain: Callable[[Checkpoint, float], Any]) -> None:
    """Send the local checkpoint ``name`` (of ``step``) to ``dest`` with
    ``drain(local checkpoint, deadline)``, unless ``dest`` holds it already; call on
    every rank. It raises on every rank if the drain fails, or has not committed by
    ``LocalTier.drain_timeout`` (a commit past it is refused); a drain still hung
    :data:`LATE` seconds later raises on the ranks that waited for it."""
    mine = coord.checked(lambda: local.open(name), group)
    if coord.on_coordinator(lambda: in_bucket(dest, mine), group):
        return
    bound = local.tier.drain_timeout
    deadline = time.monotonic() + bound
    future = run_in_background(lambda: drain(mine, deadline), f"drain at close of the "
                               f"local checkpoint {mine.uri} to {dest.uri}")
    try:
        future.result(bound + LATE)
    except TimeoutError:
        raise IncompleteCheckpointError(
            f"local tier: the drain at close of step {step} to {dest.uri} was still running "
            f"{bound + LATE:.0f} s later, not committed (a commit past LocalTier."
            "drain_timeout is refused): the step is only on the nodes' local disks. Look "
            "at the storage, or raise LocalTier.drain_timeout") from None
    except Exception as exc:
        log.error("local tier: the drain at close of step %d to %s failed, NOT committed "
                  "(%s); the step is only on the nodes' local disks", step, dest.uri, exc)
        raise
    if coord.rank(group) == 0:
        log.info("local tier: drained step %d to %s at close", step, dest.uri)


def _size_crc(info: ObjectInfo) -> tuple[int, str]:
    assert info.crc32c is not None
    return info.size, info.crc32c
