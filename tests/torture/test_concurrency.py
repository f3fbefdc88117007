"""Concurrency torture: writers side by side on one endpoint, and writers racing
for one checkpoint URI or one recover slot. Every race has exactly one winner,
the losers get :class:`CommitConflictError`, and nothing of the winner is lost.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import pytest
import race_worker as rw
import torch
from knobs import scale

from cloudckpt import CheckpointWriter, RecoverSlot, open_checkpoint, open_store
from cloudckpt.core.claim import CLAIM_NAME

RACERS = 4


def _run(forks: Any, target: Any, args_for: dict[str, tuple], timeout: float = 120.0,
         barrier: Any = None) -> dict[str, tuple[str, Any]]:
    """Run one process per racer; return {who: (outcome, detail)}."""
    queue = forks.Queue()
    procs = [forks.Process(target=target, args=(*args, barrier, queue))
             for args in args_for.values()]
    for p in procs:
        p.start()
    results = {}
    for _ in procs:
        who, outcome, detail = queue.get(timeout=timeout)
        results[who] = (outcome, detail)
    for p in procs:
        p.join(30)
    return results


def _backend(request, name: str) -> Any:
    return request.getfixturevalue({"file": "local"}.get(name, name))


def _winner(results: dict[str, tuple[str, Any]], uri: str) -> tuple[str | None, list[str]]:
    """The single winner, and what is wrong with the race's outcomes."""
    problems = [f"{who}: {d}" for who, (o, d) in results.items() if o == "error"]
    won = [who for who, (o, _) in results.items() if o == "won"]
    lost = [d for o, d in results.values() if o == "lost"]
    if len(won) != 1:
        problems.append(f"{len(won)} winners: {won}")
    problems += [f"loss that does not name the URI: {d}" for d in lost if uri not in d]
    return (won[0] if len(won) == 1 else None), problems


Race = tuple[str, Any, dict[str, tuple], Callable[[str, dict], list[str]]]


def _race_many(name: str, request: Any, forks: Any, record: Any, case: str, races: int,
               setup: Callable[[int, Any, dict[str, Any]], Race]) -> None:
    """Run ``races`` races on backend ``name``. ``setup(r, backend, opts)`` returns
    (uri, target, {racer: args}, check); ``check(winner, results)`` lists what is
    wrong with the winner's result."""
    backend = _backend(request, name)
    opts = json.loads(backend.options_json())
    failures: list[str] = []
    for r in range(races):
        uri, target, args_for, check = setup(r, backend, opts)
        results = _run(forks, target, args_for, barrier=forks.Barrier(len(args_for)))
        winner, problems = _winner(results, uri)
        if winner is not None:
            problems += check(winner, results)
        failures += [f"race {r}: {p}" for p in problems]
    record("concurrency", f"{name}: {RACERS} {case}", races, faults=races * RACERS,
           failures=len(failures))
    assert not failures, "\n".join(failures[:10])


@pytest.mark.parametrize("name", ["s3", "gcs", "file", "azure"])
def test_racing_writers_on_one_uri(name, forks, request, record):
    """The same object names, different bytes: the winner's checkpoint is all its own."""

    def setup(r: int, backend: Any, opts: dict[str, Any]) -> Race:
        uri = backend.uri(f"race-{r}")

        def check(winner: str, results: dict) -> list[str]:
            ckpt = open_checkpoint(uri, backend.options)
            ckpt.verify(deep=True)
            problems = []
            if ckpt.metadata.get("who") != winner or \
                    dict(ckpt.iter_objects()) != rw.content(winner):
                problems.append(f"committed checkpoint is not all {winner}'s")
            if open_store(uri, backend.options).exists(CLAIM_NAME):
                problems.append("the winner's claim was left behind")
            return problems

        return uri, rw.write_checkpoint, {f"w{r}-{i}": (uri, opts, f"w{r}-{i}")
                                          for i in range(RACERS)}, check

    _race_many(name, request, forks, record, "writers race for one URI", scale(3, 40), setup)


@pytest.mark.parametrize("name", ["s3", "gcs", "file", "azure"])
def test_racing_commits_of_one_checkpoint(name, forks, request, record):
    """The objects are in place; several processes commit at the same instant."""

    def setup(r: int, backend: Any, opts: dict[str, Any]) -> Race:
        uri = backend.uri(f"commit-{r}")
        infos = open_store(uri, backend.options).put_many(rw.content(f"objs-{r}"))
        files = {k: (i.size, i.crc32c) for k, i in infos.items()}

        def check(winner: str, results: dict) -> list[str]:
            ckpt = open_checkpoint(uri, backend.options)
            ckpt.verify(deep=True)
            return [] if ckpt.metadata.get("who") == winner else [f"manifest is not {winner}'s"]

        return uri, rw.commit_only, {f"c{r}-{i}": (uri, opts, f"c{r}-{i}", files)
                                     for i in range(RACERS)}, check

    _race_many(name, request, forks, record, "commits race on one manifest", scale(3, 40),
               setup)


@pytest.mark.parametrize("name", ["s3", "gcs", "file", "azure"])
def test_racing_slot_swaps(name, forks, request, record):
    """All racers write their generation, then swap against the same pointer version."""

    def setup(r: int, backend: Any, opts: dict[str, Any]) -> Race:
        uri = backend.uri(f"slot-{r}")
        if r % 2:  # half the races replace an existing generation (If-Match), half create
            RecoverSlot(uri, storage_options=backend.options).save(
                {"w": torch.zeros(1024)}, rng=False)
        value = {f"s{r}-{i}": float(i + 1) for i in range(RACERS)}

        def check(winner: str, results: dict) -> list[str]:
            slot = RecoverSlot(uri, storage_options=backend.options)
            state = {"w": torch.zeros(1024)}
            slot.load(state, rng=False).checkpoint.verify(deep=True)
            problems = []
            if not torch.equal(state["w"], torch.full((1024,), value[winner])):
                problems.append(f"slot does not hold {winner}'s state")
            if slot.generations() != [results[winner][1]]:
                problems.append(f"generations left: {slot.generations()}")
            return problems

        return uri, rw.save_slot, {w: (uri, opts, w, v) for w, v in value.items()}, check

    _race_many(name, request, forks, record, "saves race for one slot", scale(2, 30), setup)


@pytest.mark.parametrize("name", ["s3", "gcs", "azure"])
def test_writers_side_by_side(name, forks, request, record):
    """Several jobs share one bucket, each below its own prefix: nothing mixes."""
    backend = _backend(request, name)
    opts = json.loads(backend.options_json())
    writers, per = scale(3, 8), scale(2, 6)
    who = [f"job-{i}" for i in range(writers)]
    results = _run(forks, rw.own_prefix, {w: (backend.root, opts, w, per) for w in who},
                   barrier=forks.Barrier(writers), timeout=600)
    failures = [f"{w}: {d}" for w, (o, d) in results.items() if o != "won"]
    for w in who:
        for step in range(per):
            ckpt = open_checkpoint(backend.uri(w, f"step-{step}"), backend.options)
            ckpt.verify(deep=True)
            if dict(ckpt.iter_objects()) != rw.content(f"{w}-{step}", 3):
                failures.append(f"{w}/step-{step} holds someone else's bytes")
    record("concurrency", f"{name}: {writers} jobs side by side", writers * per,
           faults=writers, failures=len(failures))
    assert not failures, "\n".join(failures[:10])


@pytest.mark.parametrize("mode", ["incremental", "full"])
@pytest.mark.parametrize("name", ["s3", "gcs", "file", "azure"])
def test_a_zombie_writer_cannot_change_a_committed_checkpoint(
        name, mode, forks, request, record):
    """Writer A (a process) claims a save and keeps writing it; writer B takes A's
    claim over and commits; A writes on, then tries to commit. B's checkpoint verifies
    deep and holds B's bytes; A loses its commit. Incremental: every object is a blob
    named by its bytes; full: B writes its objects in its own writer area."""
    from cloudckpt.core.blobs import BlobArea

    backend = _backend(request, name)
    opts = json.loads(backend.options_json())
    failures: list[str] = []
    trials = scale(2, 30)
    for t in range(trials):
        uri = backend.uri("zombie", f"step-{t}")
        rounds, stop = forks.Value("i", 0), forks.Event()
        queue = forks.Queue()
        a = forks.Process(target=rw.zombie, args=(uri, opts, f"a{t}", rounds, stop, None,
                                                  queue, mode == "incremental"))
        a.start()
        while rounds.value < 1 and a.is_alive():
            time.sleep(0.01)
        area = BlobArea(open_store(backend.uri("zombie"), backend.options))
        b = CheckpointWriter(uri, metadata={"who": "b"}, storage_options=backend.options,
                             blobs=area if mode == "incremental" else None, takeover=True)
        b.put_many(rw.content(f"b{t}"))
        b.commit()
        after = rounds.value
        while rounds.value < after + 2 and a.is_alive():  # A writes on after B's commit
            time.sleep(0.01)
        stop.set()
        who, outcome, detail = queue.get(timeout=120)
        a.join(30)
        if outcome != "lost":
            failures.append(f"trial {t}: the zombie's commit {outcome}: {detail}")
        ckpt = open_checkpoint(uri, backend.options)
        try:
            ckpt.verify(deep=True)
        except Exception as exc:  # noqa: BLE001 - the failure being tested for
            failures.append(f"trial {t}: {exc}")
            continue
        if mode == "full" and ckpt.manifest.moved != ckpt.files:
            failures.append(f"trial {t}: B took over but wrote at the objects' own paths")
        if ckpt.metadata.get("who") != "b" or dict(ckpt.iter_objects()) != rw.content(f"b{t}"):
            failures.append(f"trial {t}: the committed checkpoint is not all B's")
    record("concurrency", f"{name}: a zombie writes on after a takeover ({mode})", trials,
           faults=trials, failures=len(failures))
    assert not failures, "\n".join(failures[:10])
