"""Workloads the crash torture SIGKILLs at random instants, and the fresh-process
checks that run after each kill.

Every workload loops until it is killed, appending what it starts and what
returned to an event log (``start 7``, ``commit 7``, ``start-delete 4``,
``delete 4``); a line is written only after the operation returned, so the
log says exactly which saves were acknowledged. Contents are a function of the
step, so a check can tell that what it loads is the state of that step.

The functions run in processes forked from a server that imported torch and
cloudckpt once (multiprocessing's forkserver), so a trial costs milliseconds
of start-up, not seconds; :func:`on_node` runs one as a relaunch on another node
would (a new pid namespace, its own hostname).
"""

from __future__ import annotations

import json
import os
import random
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
from cloudckpt_testkit.nodes import enter_node

import cloudckpt.dcp as cdcp
from cloudckpt import (
    CheckpointManager,
    CheckpointWriter,
    ManagerOptions,
    RecoverSlot,
    StepInfo,
    delete_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    open_checkpoint,
    open_store,
)
from cloudckpt.core import blobs
from cloudckpt.core.gc import collect, find_garbage
from cloudckpt.errors import CheckpointNotFoundError, IncompleteCheckpointError
from cloudckpt.names import BLOB_AREA

KEEP = 3  # retention of the store workloads: delete step s-KEEP after committing s
TENSOR_ROWS = 64
#: The incremental workload's gc grace period, and how long its sweeps may run: short,
#: as processes are killed mid-sweep all the time (a stale sweep record holds saves up).
GRACE, SWEEP_LEASE = 5.0, 3.0


class Events:
    """Append-only event log shared by the workload and the test."""

    def __init__(self, path: str, errors_only: bool = False) -> None:
        self._f = open(path, "a", buffering=1)  # noqa: SIM115 - lives until the kill
        self._errors_only = errors_only

    def say(self, kind: str, step: int | str = "") -> None:
        if not self._errors_only or kind == "error":
            self._f.write(f"{kind} {step}".rstrip() + "\n")


def read_events(path: str) -> list[tuple[str, str]]:
    """The events logged so far, as (kind, value) pairs."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [tuple((line.split(" ", 1) + [""])[:2]) for line in f.read().splitlines()]


def payload(step: int) -> dict[str, bytes]:
    """The objects of step ``step``: a few small ones and one large enough to go multipart."""
    rng = random.Random(step)
    objs = {f"shard-{i}.bin": rng.randbytes(rng.randrange(1, 40_000)) for i in range(4)}
    objs["big.bin"] = rng.randbytes(300_000 + rng.randrange(400_000))
    return objs


def tensor_for(step: int) -> torch.Tensor:
    """The model state of step ``step``."""
    g = torch.Generator().manual_seed(step)
    return torch.randn(TENSOR_ROWS, 1024, generator=g)


def base_tensor() -> torch.Tensor:
    """The frozen part of the incremental workload's state (a file of its own)."""
    return torch.randn(512, 1024, generator=torch.Generator().manual_seed(12345))


def _guard(events: Events, fn: Callable[[], None]) -> None:
    try:
        fn()
    except BaseException:
        events.say("error", json.dumps(traceback.format_exc()))
        raise


def _latest_step(root: str, opts: dict[str, Any]) -> int:
    latest = latest_checkpoint(root, opts)
    return latest.step if latest is not None and latest.step is not None else 0


def _retire(root: str, opts: dict[str, Any], events: Events, step: int) -> None:
    if step < 1:
        return
    events.say("start-delete", step)
    try:
        delete_checkpoint(f"{root}/step-{step}", opts)
    except (CheckpointNotFoundError, IncompleteCheckpointError):
        pass  # never committed (a kill before its commit), or gone already
    events.say("delete", step)


# --------------------------------------------------------------- workloads


def on_node(host: str | None, env: dict[str, str], workload: str, *args: Any) -> None:
    """Run ``workload`` (a function of this module) with ``env`` (its run, attempt and
    lease) as pid 1 of a new pid namespace called ``host`` (None: here): where a
    relaunched job comes back, no pid of an earlier attempt means anything."""
    if host is None:
        os.environ.update(env)
    else:
        enter_node(host, env)
    globals()[workload](*args)



def store_ops(root: str, opts: dict[str, Any], log: str, seed: int, with_gc: bool) -> None:
    """Commit immutable checkpoints step after step, retire old ones; with ``with_gc``
    also leave a torn prefix, save a recover slot, and collect garbage each round."""
    events = Events(log)

    def run() -> None:
        step = _latest_step(root, opts) + 1
        slot = RecoverSlot(f"{root}/slot", storage_options=opts)
        events.say("ready")
        while True:
            events.say("start", step)
            objs = payload(step)
            big = objs.pop("big.bin")
            with CheckpointWriter(f"{root}/step-{step}", step=step, storage_options=opts) as w:
                w.put_many(objs)
                with w.open("big.bin") as f:
                    for i in range(0, len(big), 100_000):
                        f.write(big[i:i + 100_000])
            events.say("commit", step)
            _retire(root, opts, events, step - KEEP)
            if with_gc:
                torn = open_store(f"{root}/torn-{step}", opts)
                torn.put_many({f"part-{i}": b"x" * 10_000 for i in range(3)})
                events.say("start-slot", step)
                slot.save({"w": tensor_for(step)}, step=step, rng=False)
                events.say("slot", step)
                events.say("start-gc", step)
                collect(find_garbage(root, opts, grace_seconds=0.0), opts)
                events.say("gc", step)
            step += 1

    _guard(events, run)


def slot_ops(root: str, opts: dict[str, Any], log: str, seed: int) -> None:
    """Overwrite one recover slot again and again."""
    events = Events(log)

    def run() -> None:
        slot = RecoverSlot(f"{root}/slot", storage_options=opts)
        step = int((slot.info() or {}).get("step") or 0) + 1
        events.say("ready")
        while True:
            events.say("start", step)
            slot.save({"w": tensor_for(step)}, step=step, rng=False)
            events.say("commit", step)
            step += 1

    _guard(events, run)


def async_ops(root: str, opts: dict[str, Any], log: str, seed: int) -> None:
    """A CheckpointManager saving every step in the background while 'training'."""
    events = Events(log)
    rng = random.Random(seed)

    def run() -> None:
        mgr = CheckpointManager(root, ManagerOptions(every_steps=1, async_save=True),
                                storage_options=opts)
        state = {"w": torch.zeros(TENSOR_ROWS, 1024)}
        step = 1
        events.say("ready")
        while True:
            state["w"].copy_(tensor_for(step))
            events.say("start", step)
            mgr.save(StepInfo(global_step=step), state, rng=False)
            if step > 1:  # save() waited for the previous save's commit
                events.say("commit", step - 1)
            time.sleep(rng.uniform(0.0, 0.2))  # a training step
            step += 1

    _guard(events, run)


def incremental_ops(root: str, opts: dict[str, Any], log: str, seed: int) -> None:
    """Incremental DCP saves of a frozen base and a changing tensor, with retention:
    each deletion sweeps the blobs it released."""
    blobs.DEFAULT_LEASE_SECONDS = SWEEP_LEASE
    events = Events(log)

    def run() -> None:
        step = _latest_step(root, opts) + 1
        base = base_tensor()
        events.say("ready")
        while True:
            events.say("start", step)
            full = tensor_for(step)
            cdcp.save({"base": base, "w": full, "bias": full[0].clone()}, f"{root}/step-{step}",
                      storage_options=opts, step=step, incremental=True)
            events.say("commit", step)
            _retire(root, opts, events, step - KEEP)
            step += 1

    _guard(events, run)


def gc_ops(root: str, opts: dict[str, Any], log: str, seed: int) -> None:
    """``gc`` of the same root, again and again, while the saves run."""
    blobs.DEFAULT_LEASE_SECONDS = SWEEP_LEASE
    events = Events(log, errors_only=True)
    rng = random.Random(seed)

    def run() -> None:
        while True:
            collect(find_garbage(root, opts, grace_seconds=GRACE), opts)
            time.sleep(rng.uniform(0.0, 0.1))

    _guard(events, run)


def dcp_rank(rank: int, world: int, port: int, root: str, opts: dict[str, Any], log: str,
             seed: int) -> None:
    """One rank of a job that saves a row-sharded DTensor with DCP every step."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    events = Events(log, errors_only=rank != 0)

    def run() -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world)
        mesh = init_device_mesh("cpu", (world,))
        step = _latest_step(root, opts) if rank == 0 else 0
        box = [step]
        dist.broadcast_object_list(box, src=0)
        step = box[0] + 1
        events.say("ready")
        while True:
            events.say("start", step)
            full = tensor_for(step)
            state = {"w": distribute_tensor(full, mesh, [Shard(0)]), "bias": full[0].clone()}
            cdcp.save(state, f"{root}/step-{step}", storage_options=opts, step=step)
            if rank == 0:
                events.say("commit", step)
                _retire(root, opts, events, step - KEEP)
            step += 1

    _guard(events, run)


# ----------------------------------------------------------------- judging


def steps(events: list[tuple[str, str]], kind: str) -> set[int]:
    return {int(v) for k, v in events if k == kind}


def judge(scenario: str, events: list[tuple[str, str]], report: dict[str, Any]) -> list[str]:
    """Compare what a reader sees with what the workload acknowledged."""
    problems = list(report["problems"])
    if scenario in ("commits", "gc", "dcp", "async", "incremental"):
        acked, started = steps(events, "commit"), steps(events, "start")
        delete_started, deleted = steps(events, "start-delete"), steps(events, "delete")
        visible = {int(s) for s in report["visible"]}
        must = acked - delete_started
        may = started - deleted
        if not must <= visible:
            problems.append(f"acknowledged saves lost: {sorted(must - visible)}")
        if not visible <= may:
            problems.append(f"visible checkpoints never saved or deleted: {sorted(visible - may)}")
        if visible and report["latest"] != max(visible):
            problems.append(f"resume loads step {report['latest']}, newest is {max(visible)}")
    if scenario in ("slot", "gc"):
        kind = ("commit", "start") if scenario == "slot" else ("slot", "start-slot")
        acked, started = steps(events, kind[0]), steps(events, kind[1])
        last = max(acked, default=None)
        allowed = {last} | {s for s in started if last is None or s > last}
        if report["slot"] not in allowed:
            problems.append(f"slot holds step {report['slot']}, expected one of {allowed}")
    return problems


# ------------------------------------------------------------------ checks


def _loaded_step_matches(kind: str, uri: str, opts: dict[str, Any], step: int) -> str | None:
    """Load checkpoint ``uri`` and compare it with the state of ``step``."""
    if kind in ("dcp", "incremental"):
        state = {"w": torch.zeros(TENSOR_ROWS, 1024), "bias": torch.zeros(1024)}
        if kind == "incremental":
            state["base"] = torch.zeros(512, 1024)
        cdcp.load(state, uri, storage_options=opts)
        full = tensor_for(step)
        ok = torch.equal(state["w"], full) and torch.equal(state["bias"], full[0])
        ok = ok and ("base" not in state or torch.equal(state["base"], base_tensor()))
        return None if ok else f"{uri}: loaded tensors are not those of step {step}"
    ckpt = open_checkpoint(uri, opts)
    if dict(ckpt.iter_objects()) != payload(step):
        return f"{uri}: objects are not those of step {step}"
    return None


def check(scenario: str, root: str, opts: dict[str, Any], out: str) -> None:
    """Everything a reader sees after the kill, as JSON at ``out``."""
    report: dict[str, Any] = {"visible": [], "problems": [], "latest": None, "slot": None}
    try:
        if scenario in ("commits", "gc", "dcp", "incremental"):
            _check_steps(scenario, root, opts, report)
        if scenario == "incremental":
            _check_blobs(root, opts, report)
        if scenario in ("slot", "gc"):
            _check_slot(f"{root}/slot", opts, report)
        if scenario == "async":
            _check_async(root, opts, report)
    except Exception:
        report["problems"].append(traceback.format_exc())
    with open(out, "w") as f:
        json.dump(report, f)


def _check_steps(scenario: str, root: str, opts: dict[str, Any], report: dict[str, Any]) -> None:
    for info in list_checkpoints(root, opts):
        if not info.name.startswith("step-"):
            continue
        try:
            if scenario in ("dcp", "incremental"):  # a load reads items, not whole files
                open_checkpoint(info.uri, opts).verify(deep=True)
            # reads check every object's size and CRC32C against the manifest
            problem = _loaded_step_matches(scenario, info.uri, opts, int(info.step or -1))
        except Exception as exc:  # a visible checkpoint that does not load is the failure
            problem = f"{info.uri}: {type(exc).__name__}: {exc}"
        if problem:
            report["problems"].append(problem)
        report["visible"].append(info.step)
    latest = latest_checkpoint(root, opts)
    report["latest"] = latest.step if latest is not None else None


def _check_blobs(root: str, opts: dict[str, Any], report: dict[str, Any]) -> None:
    """After a gc of its own (once a sweep the kill cut short is stale): no blob older
    than the grace period that no checkpoint references and no live hold names."""
    blobs.DEFAULT_LEASE_SECONDS = SWEEP_LEASE
    store = open_store(root, opts)
    area = blobs.BlobArea(store)
    record, _ = area.record()
    if record.get("running"):
        time.sleep(max(0.0, record.get("since", 0) + record.get("lease", 0) - time.time()))
    collect(find_garbage(root, opts, grace_seconds=GRACE), opts)
    now = time.time()
    listed = store.child(BLOB_AREA).list()
    keep = blobs.referenced(store)
    for hold in (o for o in listed if o.key.startswith(blobs.HOLDS + "/")):
        if now - (hold.mtime or now) <= GRACE:
            keep |= set(json.loads(store.child(BLOB_AREA).get(hold.key))["blobs"])
        else:
            report["problems"].append(f"a hold {now - (hold.mtime or now):.0f} s old is left")
    for o in listed:
        if blobs.DIGEST_RE.match(o.key) and o.key not in keep and now - (o.mtime or now) > GRACE:
            report["problems"].append(f"blob {o.key} is unreferenced and "
                                      f"{now - (o.mtime or now):.0f} s old after gc")


def _check_slot(uri: str, opts: dict[str, Any], report: dict[str, Any]) -> None:
    slot = RecoverSlot(uri, storage_options=opts)
    if slot.info() is None:
        return
    state = {"w": torch.zeros(TENSOR_ROWS, 1024)}
    restored = slot.load(state, rng=False)
    step = restored.checkpoint.step
    restored.checkpoint.verify(deep=True)
    if not torch.equal(state["w"], tensor_for(int(step or -1))):
        report["problems"].append(f"slot {uri}: loaded tensor is not that of step {step}")
    report["slot"] = step


def _check_async(root: str, opts: dict[str, Any], report: dict[str, Any]) -> None:
    for info in list_checkpoints(root, opts):
        open_checkpoint(info.uri, opts).verify(deep=True)
        report["visible"].append(info.step)
    state = {"w": torch.zeros(TENSOR_ROWS, 1024)}
    step_info = CheckpointManager(root, storage_options=opts).restore(state, rng=False)
    if step_info is None:
        report["latest"] = None
        return
    report["latest"] = step_info.global_step
    if not torch.equal(state["w"], tensor_for(step_info.global_step)):
        report["problems"].append(f"restored tensor is not that of step {step_info.global_step}")
