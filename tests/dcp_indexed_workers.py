"""Functions run on real gloo ranks by the indexed DCP save's tests (module level, for
spawn)."""

from __future__ import annotations

import json

import torch
import torch.distributed.checkpoint as dcp
from dcp_workers import _equal, build, full_state, train_steps
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import cloudckpt.dcp as cloud_dcp
from cloudckpt.dcp import ranksave
from cloudckpt.dcp.writer import CloudStorageWriter


def _count_global_plans() -> list[int]:
    """Counts calls of the default planner's global planning in this process."""
    calls = [0]
    real = DefaultSavePlanner.create_global_plan

    def counting(self, plans):  # type: ignore[no-untyped-def]
        calls[0] += 1
        return real(self, plans)

    DefaultSavePlanner.create_global_plan = counting  # type: ignore[method-assign]
    return calls


def _stats() -> dict[str, int]:
    s = ranksave.STATS
    return {"built": s.plans_built, "reused": s.plans_reused, "classic": s.classic}


def save_twice_then_change(rank: int, world: int, uri: str, options: str, ref_path: str
                           ) -> dict[str, object]:
    """Indexed saves of an FSDP2 state: two of one structure, a third with a key more.
    Returns the plan counts after each save and the global plans torch made."""
    opts = json.loads(options)
    calls = _count_global_plans()
    model, optim = build(world)
    train_steps(model, optim)
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd, "step": 7}
    after = []
    cloud_dcp.save(state, f"{uri}/a", storage_options=opts, indexed=True)
    after.append(_stats())
    cloud_dcp.save(state, f"{uri}/b", storage_options=opts, indexed=True)
    after.append(_stats())
    cloud_dcp.save({**state, "extra": torch.arange(5.0)}, f"{uri}/c", storage_options=opts,
                   indexed=True)
    after.append(_stats())
    full = full_state(model, optim)  # a collective: on every rank
    if rank == 0:
        torch.save(full, ref_path)
    return {"after": after, "global_plans": calls[0],
            "kinds": sorted({type(v).__name__ for v in msd.values()})}


def load_stock_and_compare(rank: int, world: int, path: str, ref_path: str) -> bool:
    """Stock ``dcp.load`` with torch's ``FileSystemReader`` from a local directory."""
    model, optim = build(world)
    train_steps(model, optim, steps=1)
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd, "step": 0}
    dcp.load(state, storage_reader=FileSystemReader(path))
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return state["step"] == 7 and _equal(full_state(model, optim),
                                         torch.load(ref_path, weights_only=True))


def irregular_save_and_load(rank: int, world: int, uri: str, options: str) -> dict[str, object]:
    """Ranks with different keys: the save takes the classic path and round-trips."""
    opts = json.loads(options)
    state = {"shared": torch.arange(6.0), f"only_on_{rank}": torch.full((3,), float(rank))}
    cloud_dcp.save(state, uri, storage_options=opts, indexed=True)
    target = {"shared": torch.zeros(6), f"only_on_{rank}": torch.zeros(3)}
    cloud_dcp.load(target, uri, storage_options=opts)
    return {"stats": _stats(), "equal": all(torch.equal(target[k], v) for k, v in state.items())}


def save_with_failing_rank(rank: int, world: int, uri: str, options: str) -> str:
    """Rank 1 fails while writing its files; every rank must raise."""
    real = CloudStorageWriter._write_file

    def failing(self, name, items, **kw):  # type: ignore[no-untyped-def]
        if rank == 1:
            raise RuntimeError("disk on fire on rank 1")
        return real(self, name, items, **kw)

    CloudStorageWriter._write_file = failing  # type: ignore[method-assign]
    model, optim = build(world)
    msd, osd = get_state_dict(model, optim)
    try:
        cloud_dcp.save({"model": msd, "optim": osd}, uri, storage_options=json.loads(options),
                       indexed=True)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return f"raised {type(exc).__name__}: {exc}"
    return "saved"


def save_large_job(rank: int, world: int, uri: str, options: str, ref_path: str) -> bool:
    """An indexed save treated as a large job: no ``.metadata`` from the save itself."""
    ranksave.SMALL_JOB_CHUNKS = 0
    model, optim = build(world)
    train_steps(model, optim)
    msd, osd = get_state_dict(model, optim)
    cloud_dcp.save({"model": msd, "optim": osd, "step": 7}, uri,
                   storage_options=json.loads(options), indexed=True)
    full = full_state(model, optim)  # a collective: on every rank
    if rank == 0:
        torch.save(full, ref_path)
    return ranksave.STATS.classic == 0
