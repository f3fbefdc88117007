"""Functions run on real gloo ranks by the DCP tests (module level, for spawn)."""

from __future__ import annotations

import json
import os
import signal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from helpers import shard_linears
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from cloudckpt.dcp import CloudStorageReader, CloudStorageWriter


def build(world: int | None):
    """The same tiny model everywhere; sharded with FSDP2 over ``world`` ranks when given."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 12), torch.nn.ReLU(), torch.nn.Linear(12, 8))
    if world:
        shard_linears(model, world)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optim


def train_steps(model, optim, steps: int = 2) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(8, 16, generator=g)
        loss = model(x).pow(2).mean()
        optim.zero_grad()
        loss.backward()
        optim.step()


def full_state(model, optim) -> dict:
    opts = StateDictOptions(full_state_dict=True, cpu_offload=False)  # full on every rank
    msd, osd = get_state_dict(model, optim, options=opts)
    return {"model": msd, "optim": osd}


def save_sharded(rank: int, world: int, uri: str, options: str, ref_path: str) -> list[str]:
    model, optim = build(world)
    train_steps(model, optim)
    msd, osd = get_state_dict(model, optim)
    kinds = sorted({type(v).__name__ for v in msd.values()})
    writer = CloudStorageWriter(uri, storage_options=json.loads(options), step=2)
    dcp.save({"model": msd, "optim": osd}, storage_writer=writer)
    full = full_state(model, optim)
    if rank == 0:
        torch.save(full, ref_path)
    return kinds


def load_and_compare(rank: int, world: int, uri: str, options: str, ref_path: str) -> bool:
    model, optim = build(world)
    train_steps(model, optim, steps=1)  # different state, and optimizer state exists
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd}
    dcp.load(state, storage_reader=CloudStorageReader(uri, storage_options=json.loads(options)))
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    full = full_state(model, optim)
    ref = torch.load(ref_path, weights_only=True)
    return _equal(full, ref)


def load_single_process(uri: str, options: str, ref_path: str) -> bool:
    """Resharding to one plain process: no process group, no FSDP."""
    model, optim = build(None)
    train_steps(model, optim, steps=1)
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd}
    dcp.load(state, storage_reader=CloudStorageReader(uri, storage_options=json.loads(options)),
             no_dist=True)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return _equal(full_state(model, optim), torch.load(ref_path, weights_only=True))


def _equal(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return a == b


class _FailingWriter(CloudStorageWriter):
    """Rank 1 fails while writing its shards: by exception, or by SIGKILL."""

    def __init__(self, *a, mode: str, **kw):
        super().__init__(*a, **kw)
        self.mode = mode

    def _write_file(self, name, items, **kw):
        if self.rank == 1:
            if self.mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError("disk on fire on rank 1")
        return super()._write_file(name, items, **kw)


def save_with_failing_rank(rank: int, world: int, uri: str, options: str, mode: str) -> str:
    model, optim = build(world)
    msd, osd = get_state_dict(model, optim)
    writer = _FailingWriter(uri, storage_options=json.loads(options), mode=mode)
    try:
        dcp.save({"model": msd, "optim": osd}, storage_writer=writer)
    except BaseException as exc:  # noqa: BLE001 - CheckpointException is a BaseException
        return f"raised {type(exc).__name__}: {exc}"
    return "saved"


def barrier_ok(rank: int, world: int) -> bool:
    dist.barrier()
    return True


def load_shared_and_compare(rank: int, world: int, uri: str, options: str, ref_path: str,
                            how: str) -> bool:
    """As load_and_compare, with the manifest and .metadata read once for the job:
    through cloudckpt.dcp.load, or torch's dcp.load with share_metadata=True."""
    import cloudckpt.dcp as cloud_dcp

    model, optim = build(world)
    train_steps(model, optim, steps=1)
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd}
    if how == "cloudckpt":
        cloud_dcp.load(state, uri, storage_options=json.loads(options))
    else:
        dcp.load(state, storage_reader=CloudStorageReader(
            uri, storage_options=json.loads(options), share_metadata=True))
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return _equal(full_state(model, optim), torch.load(ref_path, weights_only=True))
