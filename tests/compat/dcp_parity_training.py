"""The end-to-end scenarios of torch's DCP tests on gloo ranks (CPU): a model trained
plain and trained parallel (DDP, FSDP2, HSDP), saved with its optimizer and extra state,
loaded into fresh copies, trained on; partial loads; keys in another order per rank; a
second save replacing the first. Run by dcp_parity_ranks.run at each place."""

from __future__ import annotations

import io
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from dcp_parity_ranks import Place
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.testing import assert_close

FULL = StateDictOptions(full_state_dict=True)


class Net(torch.nn.Module):
    """Four linear layers, the same weights on every rank (seeded)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(
            [torch.nn.Linear(a, b) for a, b in ((8, 16), (16, 32), (32, 64), (64, 8))])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = F.relu(layer(x))
        return x


def make(kind: str, world: int) -> tuple[Any, torch.optim.Optimizer]:
    """A Net plain, or parallel over the gloo ranks, and its Adam."""
    net = Net()
    if kind == "ddp":
        net = torch.nn.parallel.DistributedDataParallel(net)
    elif kind in ("fsdp", "hsdp"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,)) if kind == "fsdp" else init_device_mesh(
            "cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        for layer in net.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(net, mesh=mesh)
    return net, torch.optim.Adam(net.parameters(), lr=0.1)


class Progress(Stateful):
    """Training progress: tensors, and the losses as a bytes item."""

    def __init__(self) -> None:
        self.step, self.loss, self.losses = 0, -1.0, []

    def state_dict(self) -> dict[str, Any]:
        buf = io.BytesIO()
        torch.save(self.losses, buf)
        return {"step": torch.tensor(self.step), "loss": torch.tensor(self.loss),
                "losses": buf}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.loss = int(state["step"]), float(state["loss"])
        state["losses"].seek(0)
        self.losses = torch.load(state["losses"], weights_only=True)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Progress) and (self.step, self.loss, self.losses) == (
            other.step, other.loss, other.losses)


class Extra(Stateful):
    """Arbitrary state: one tensor."""

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data

    def state_dict(self) -> dict[str, Any]:
        return {"data": self.data}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.data = state["data"]


class ModelState(Stateful):
    def __init__(self, model: Any) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state)


class OptimState(Stateful):
    def __init__(self, model: Any, optim: torch.optim.Optimizer) -> None:
        self.model, self.optim = model, optim

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optim)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optim, state)


def train(model: Any, optim: torch.optim.Optimizer, steps: int) -> tuple[Any, Progress]:
    torch.manual_seed(0)  # the same batches on every rank and in every model
    progress, loss = Progress(), None
    for _ in range(steps):
        loss = model(torch.rand(8, 8)).sum()
        loss.backward()
        optim.step()
        optim.zero_grad()
        progress.step += 1
        progress.loss = torch.rand(1).item()
        progress.losses.append(progress.loss)
    return loss, progress


def _save(place: Place, state: dict[str, Any], how: str) -> None:
    """Saved at once, or by ``dcp.async_save`` (thread or process executor; staged by
    torch's default stager or by the writer itself)."""
    if how == "sync":
        place.save(state)
        return
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict_saver import (
        AsyncCheckpointerType,
        AsyncSaveResponse,
    )

    process = how == "process"
    stager = None if how == "writer-stages" else DefaultStager(
        StagingOptions(False, process, False, False))
    response = dcp.async_save(
        state, storage_writer=place.writer(), async_stager=stager,
        async_checkpointer_type=AsyncCheckpointerType.PROCESS if process
        else AsyncCheckpointerType.THREAD)
    future = response.upload_completion if isinstance(response, AsyncSaveResponse) \
        else response
    future.result(timeout=120)
    if stager is not None:
        stager.close()


def e2e(rank: int, world: int, place: Place, arg: str) -> None:
    """Train plain and parallel alike, save the parallel one, load it into a fresh copy:
    the extra state comes back equal, and one more step keeps both models together."""
    kind, _, how = arg.partition("-")
    model, optim = make("none", world)
    train(model, optim, 2)
    dmodel, doptim = make(kind, world)
    _, progress = train(dmodel, doptim, 2)
    torch.manual_seed(7)
    extra = Extra(torch.rand(10, 10))
    _save(place, {"model": ModelState(dmodel), "optimizer": OptimState(dmodel, doptim),
                  "s": extra, "train_state": progress}, how or "sync")
    dmodel, doptim = make(kind, world)
    loaded_extra, loaded_progress = Extra(torch.zeros(10, 10)), Progress()
    place.load({"model": ModelState(dmodel), "optimizer": OptimState(dmodel, doptim),
                "s": loaded_extra, "train_state": loaded_progress})
    assert torch.equal(loaded_extra.data, extra.data) and loaded_progress == progress
    loss, _ = train(model, optim, 1)
    dloss, _ = train(dmodel, doptim, 1)
    assert_close(dloss, loss)
    assert_close(get_model_state_dict(dmodel, options=FULL), get_model_state_dict(model))
    loaded, plain = (get_optimizer_state_dict(dmodel, doptim, options=FULL),
                     get_optimizer_state_dict(model, optim))
    assert_close(loaded["state"], plain["state"])
    assert [g["lr"] for g in loaded["param_groups"]] == [g["lr"] for g in plain["param_groups"]]


def partial_load(rank: int, world: int, place: Place) -> None:
    """Only the model of a model-and-optimizer checkpoint; then keys read on their own."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    model, optim = make("none", world)
    train(model, optim, 2)
    dmodel, doptim = make("fsdp", world)
    train(dmodel, doptim, 2)
    place.save({"model": ModelState(dmodel), "optimizer": OptimState(dmodel, doptim)})
    fresh, _ = make("fsdp", world)
    place.load({"model": ModelState(fresh)})
    assert_close(get_model_state_dict(fresh, options=FULL), get_model_state_dict(model))
    alone = _load_state_dict_from_keys("model", storage_reader=place.reader())["model"]
    assert_close(alone, get_model_state_dict(model))
    state = _load_state_dict_from_keys("optimizer.state",
                                       storage_reader=place.reader())["optimizer"]["state"]
    assert "param_groups" not in state
    full = get_optimizer_state_dict(dmodel, doptim, options=FULL)["state"]
    assert_close({k: {n: v[n] for n in ("exp_avg", "exp_avg_sq", "step")}
                  for k, v in full.items()}, state)


class _Gathers:
    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = torch.arange(2) + 1 + 2 * dist.get_rank()
        dist.all_gather([torch.ones(2, dtype=mine.dtype)
                         for _ in range(dist.get_world_size())], mine)


class _Reduces:
    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        dist.all_reduce(torch.arange(2) + 1 + 2 * dist.get_rank())


def key_order(rank: int, world: int, place: Place) -> None:
    """Each rank's state lists its keys in another order, and loading them runs
    collectives: the load must not deadlock (the pg timeout would fail it)."""
    state = {"A": _Gathers(), "B": _Reduces()} if rank == 0 else {"B": _Reduces(),
                                                                  "A": _Gathers()}
    place.save(state)
    place.load(state)


def overwrite(rank: int, world: int, place: Place) -> None:
    first, second = torch.randn(10), torch.randn(10)
    dist.broadcast(first, src=0)
    dist.broadcast(second, src=0)
    place.save({"random": first})
    place.save({"random": second}, overwrite=True)
    into = {"random": torch.zeros(10)}
    place.load(into)
    assert torch.equal(into["random"], second)
    try:
        place.save({"random": first}, overwrite=False)
    except CheckpointException as exc:
        assert "Checkpoint already exists" in str(exc), exc
    else:
        raise AssertionError("a save with overwrite=False replaced a checkpoint")
    place.load(into)
    assert torch.equal(into["random"], second)
