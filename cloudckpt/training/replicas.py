"""Copies of each rank's local checkpoints on partner ranks of other nodes.

A lost node takes its ranks' local tiers with it; with ``LocalTier(replicas=k)``
each rank's committed local step is also sent to ``k`` partner ranks on other
nodes (:func:`partners`: the rank of the same local index on each of the next
``k`` nodes), over a gloo group of the job (:mod:`cloudckpt.runtime.peerwire`),
in the background. A partner keeps it at ``<path>/replicas/rank-<r>/<name>``,
committed as the sender's is: every object checked against the sender's manifest
(size and CRC32C) before that manifest is written, last. A resume then finds, per
rank, its own copy, else a partner's (:func:`fetch_missing` sends it back over the
group into the rank's own tier), else the bucket.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

from cloudckpt.core.checkpoint import Checkpoint, CheckpointWriter, open_checkpoint
from cloudckpt.core.deletion import delete_checkpoint
from cloudckpt.core.listing import list_checkpoints
from cloudckpt.core.manifest import Manifest
from cloudckpt.core.retention import Managed, apply_retention
from cloudckpt.errors import (
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
)
from cloudckpt.movement.checkpoint_copy import standard_layout
from cloudckpt.runtime import coordination as coord
from cloudckpt.runtime.peerwire import Sink, Stream, exchange
from cloudckpt.storage import Store, as_store

log = logging.getLogger(__name__)

#: The directory below ``LocalTier.path`` holding the copies of other ranks' steps.
REPLICAS_DIR = "replicas"
_READ = 8 << 20


def partners(hosts: list[str], k: int) -> list[list[int]]:
    """For each rank (``hosts[r]``: its node), the ``k`` ranks that keep its copies:
    the rank of the same local index on each of the next ``k`` nodes (nodes ordered
    by their first rank), so that round ``d`` of a replication is a permutation of the
    ranks. Refused unless every node runs as many ranks and there are more than ``k``
    nodes."""
    nodes: dict[str, list[int]] = {}
    for r, host in enumerate(hosts):
        nodes.setdefault(host, []).append(r)
    order = list(nodes.values())
    sizes = sorted({len(ranks) for ranks in order})
    if len(sizes) > 1:
        raise ConfigError(f"LocalTier(replicas={k}) needs as many ranks on every node; this "
                          f"job's nodes run {', '.join(map(str, sizes))} ranks")
    if len(order) <= k:
        raise ConfigError(f"LocalTier(replicas={k}) keeps each copy on another node and needs "
                          f"at least {k + 1} nodes; this job runs on {len(order)} "
                          f"({', '.join(sorted(nodes))}). Lower replicas, or run on more nodes")
    where = {r: (i, j) for i, ranks in enumerate(order) for j, r in enumerate(ranks)}
    return [[order[(where[r][0] + d) % len(order)][where[r][1]] for d in range(1, k + 1)]
            for r in range(len(hosts))]


def job_steps(store: Store, managed: Managed, job_key: str, rank: int, world: int
              ) -> dict[int, str]:
    """The committed local checkpoints directly below ``store`` (a directory) that rank
    ``rank`` of a job of ``world`` ranks saved (its manifest's ``job_key`` entry says):
    step -> name."""
    if not os.path.isdir(store.root):
        return {}
    found = {}
    for c in list_checkpoints(store, index=False):  # each manifest's metadata
        n = managed(c)
        job = (c.manifest.metadata.get(job_key) if c.manifest else None) or {}
        if n is not None and isinstance(job, dict) and job.get("rank") == rank \
                and job.get("world_size") == world:
            found[n] = c.name
    return found


@dataclass
class Held:
    """What one rank holds for a resume: its own committed steps, and the steps of
    other ranks it keeps copies of (``{rank: {step: name}}``)."""

    own: dict[int, str]
    copies: dict[int, dict[int, str]]


class Replicas:
    """The copies of other ranks' local checkpoints below ``<path>/replicas``, a
    directory the ranks of a node share (each receives the copies of other ranks)."""

    def __init__(self, path: str, managed: Managed, world: int, *, fsync: bool,
                 keep_last: int) -> None:
        self.root = os.path.join(os.path.abspath(path), REPLICAS_DIR)
        self.managed, self.world, self.keep_last = managed, world, keep_last
        self.options = {"fsync": fsync}

    def of(self, rank: int) -> Store:
        return as_store(os.path.join(self.root, f"rank-{rank:05d}"), self.options)

    def held(self, job_key: str) -> dict[int, dict[int, str]]:
        """``{rank: {step: name}}`` of the committed copies of this job's shape."""
        found: dict[int, dict[int, str]] = {}
        if not os.path.isdir(self.root):
            return found
        for entry in sorted(os.listdir(self.root)):
            if not entry.startswith("rank-") or not entry[5:].isdigit():
                continue
            rank = int(entry[5:])
            steps = job_steps(self.of(rank), self.managed, job_key, rank, self.world)
            if steps:
                found[rank] = steps
        return found

    def prune_after(self, step: int | None, job_key: str) -> list[str]:
        """Delete the copies newer than ``step`` (all, for None): an abandoned run's."""
        pruned = []
        for rank, steps in self.held(job_key).items():
            for n, name in steps.items():
                if step is None or n > step:
                    delete_checkpoint(self.of(rank).child(name))
                    pruned.append(f"rank-{rank:05d}/{name}")
        return pruned


def stream_of(ckpt: Checkpoint, rank: int, name: str) -> Stream:
    """``ckpt`` (a committed local checkpoint) as a stream: its standard-layout manifest
    in the header, its objects' bytes in the body, each read back and checked against
    that manifest as it goes."""
    manifest, parts = standard_layout(ckpt)
    paths = sorted(manifest.files)
    header = json.dumps({"rank": rank, "name": name, "paths": paths,
                         "manifest": manifest.to_json().decode()}).encode()

    def pieces() -> Iterator[memoryview]:
        for p in paths:
            if p in parts:
                yield memoryview(parts[p])
                continue
            with ckpt.reading(p), open(ckpt.store.path(p), "rb") as f:
                while block := f.read(_READ):
                    yield memoryview(block)

    return Stream(header, sum(manifest.files[p].size for p in paths), pieces)


class CopySink:
    """A received checkpoint written below ``store`` and committed with the sender's
    manifest, which the objects written must match exactly (sizes and CRC32Cs)."""

    def __init__(self, store: Store, header: bytes) -> None:
        doc = json.loads(header)
        self.manifest = Manifest.from_json(doc["manifest"].encode(), source="a partner's copy")
        self.paths: list[str] = list(doc["paths"])
        self.target = store.child(doc["name"])
        _clear(self.target, self.manifest)
        self.writer = CheckpointWriter(self.target, step=self.manifest.step,
                                       metadata=self.manifest.metadata,
                                       kind=self.manifest.kind, own_paths=True)
        self.index = 0
        self.left = self.manifest.files[self.paths[0]].size if self.paths else 0
        self.out: Any = self.writer.open(self.paths[0]) if self.paths else None
        self._skip_empty()

    def _skip_empty(self) -> None:
        while self.out is not None and self.left == 0:
            self.out.close()
            self.index += 1
            if self.index == len(self.paths):
                self.out = None
                return
            self.left = self.manifest.files[self.paths[self.index]].size
            self.out = self.writer.open(self.paths[self.index])

    def write(self, data: memoryview) -> None:
        while len(data):
            if self.out is None:
                raise CorruptCheckpointError(f"a partner sent more bytes than the manifest of "
                                             f"{self.target.uri} lists", {})
            take = min(self.left, len(data))
            self.out.write(data[:take])
            data, self.left = data[take:], self.left - take
            self._skip_empty()

    def close(self) -> None:
        if self.out is not None:
            raise CorruptCheckpointError(f"a partner's copy of {self.target.uri} ended early",
                                         {})
        self.writer.commit(self.manifest)  # refused unless every object matches

    def abandon(self) -> None:
        self.writer.abandon()


def _clear(target: Store, manifest: Manifest) -> None:
    """Make room at ``target`` for the commit ``manifest``: a committed copy of another
    commit under the same name (an abandoned run of steps) is deleted."""
    try:
        there = open_checkpoint(target)
    except (CheckpointNotFoundError, IncompleteCheckpointError, CorruptCheckpointError):
        return  # nothing, or a copy that never committed: the writer's claim takes it over
    if there.manifest.commit_id != manifest.commit_id:
        delete_checkpoint(target)


class _Nothing:
    """The sink of a stream its sender could not make (it sends no bytes)."""

    def write(self, data: memoryview) -> None:
        raise CorruptCheckpointError("a partner sent bytes after an empty header", {})

    def close(self) -> None:
        """Nothing was received, nothing is committed."""


class _Receiving:
    """The sink factory of one round: the stream goes below ``store_for(header)``; its
    sink is kept so that a failed round can abandon it."""

    def __init__(self, store_for: Callable[[dict[str, Any]], Store]) -> None:
        self.store_for = store_for
        self.sink: CopySink | None = None

    def __call__(self, header: bytes) -> Sink:
        if not header:  # the sender failed before it could send: its error is agreed on
            return _Nothing()
        self.sink = CopySink(self.store_for(json.loads(header)), header)
        return self.sink


def _round(send_to: int | None, make_stream: Callable[[], Stream] | None,
           recv_from: int | None, store_for: Callable[[dict[str, Any]], Store],
           group: Any) -> None:
    """One :func:`~cloudckpt.runtime.peerwire.exchange` of copies; any rank's failure
    raises on every rank. A stream that cannot be made goes out empty, so that its
    receiver is never left waiting for it."""
    err: BaseException | None = None
    stream = None
    if make_stream is not None:
        try:
            stream = make_stream()
        except Exception as exc:  # noqa: BLE001 - agreed below
            err = exc
            stream = Stream(b"", 0, lambda: iter(()))
    sink = _Receiving(store_for) if recv_from is not None else None
    try:
        exchange(send_to, stream, recv_from, sink, group)
    except Exception as exc:  # noqa: BLE001 - agreed below
        err = err or exc
        if sink is not None and sink.sink is not None:
            sink.sink.abandon()
    coord.agree(err, group)


def replicate(ckpt: Checkpoint, name: str, rank: int, plan: list[list[int]],
              replicas: Replicas, group: Any) -> None:
    """Send this rank's committed local checkpoint ``ckpt`` (``name``) to each of its
    partners (``plan[rank]``), and receive, commit and retain the copies other ranks
    send this one; call on every rank of ``group``. Round ``d`` sends to the ``d``-th
    partner. Any rank's failure raises on every rank."""
    for d in range(len(plan[rank])):
        sender = next(q for q, ps in enumerate(plan) if ps[d] == rank)
        _round(plan[rank][d], lambda: stream_of(ckpt, rank, name), sender,
               lambda doc: replicas.of(int(doc["rank"])), group)
        apply_retention(replicas.of(sender), replicas.keep_last, number=replicas.managed,
                        keep={name})


def fetch_missing(step: int, held: list[Held], rank: int, own: Store, replicas: Replicas,
                  group: Any) -> bool:
    """Every rank lacking its own copy of ``step`` gets one from a rank holding it
    (the lowest), into ``own`` (its local tier); rounds in which each rank sends and
    receives at most one copy. Call on every rank with the same ``held`` (every
    rank's); returns whether this rank received one. Any failure raises on every rank."""
    pairs = []
    for r, h in enumerate(held):
        if step in h.own:
            continue
        holder = min(q for q, hq in enumerate(held) if step in hq.copies.get(r, {}))
        pairs.append((holder, r))
    got = False
    while pairs:
        this_round, busy_send, busy_recv, rest = [], set(), set(), []
        for holder, r in pairs:
            if holder in busy_send or r in busy_recv:
                rest.append((holder, r))
                continue
            this_round.append((holder, r))
            busy_send.add(holder)
            busy_recv.add(r)
        pairs = rest
        send = next(((r, held[rank].copies[r][step]) for h, r in this_round if h == rank), None)
        recv = next((h for h, r in this_round if r == rank), None)
        make = partial(_copy_stream, replicas, *send) if send is not None else None
        _round(send[0] if send else None, make, recv, lambda _doc: own, group)
        got = got or recv is not None
    return got


def _copy_stream(replicas: Replicas, of: int, name: str) -> Stream:
    """The stream of this rank's copy ``name`` of rank ``of``'s step."""
    return stream_of(open_checkpoint(replicas.of(of).child(name)), of, name)


def available(held: list[Held]) -> list[set[int]]:
    """Per rank, the steps it can resume from locally: its own, or a partner's copy."""
    return [set(h.own) | {s for q in held for s in q.copies.get(r, {})}
            for r, h in enumerate(held)]

