"""The scenarios of torch's own DCP tests (see test_torch_dcp_parity.py), each a
function of (rank, world, place) that saves and loads through ``place`` and asserts;
the same function runs with torch's FileSystemWriter/Reader on a directory and with
cloudckpt's writer/reader on S3. Module level, for spawned gloo ranks."""

from __future__ import annotations

import dataclasses
import io
import json
import traceback
from collections.abc import Callable
from typing import IO, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.stateful import Stateful

from cloudckpt.dcp import CloudStorageReader, CloudStorageWriter

TORCH, CLOUDCKPT = "torch", "cloudckpt"


@dataclasses.dataclass(frozen=True)
class Place:
    """Where a scenario saves: torch's writer on a directory, or cloudckpt's on S3."""

    kind: str
    where: str
    options: str = "{}"  # cloudckpt's storage options, as JSON

    def at(self, name: str) -> Place:
        return dataclasses.replace(self, where=f"{self.where}/{name}")

    def writer(self, **options: Any) -> Any:
        if self.kind == TORCH:
            return FileSystemWriter(self.where, **options)
        return CloudStorageWriter(self.where, storage_options=json.loads(self.options),
                                  **options)

    def reader(self) -> Any:
        if self.kind == TORCH:
            return FileSystemReader(self.where)
        return CloudStorageReader(self.where, storage_options=json.loads(self.options))

    def save(self, state: dict[str, Any], **options: Any) -> None:
        dcp.save(state, storage_writer=self.writer(**options))

    def load(self, state: dict[str, Any], **kw: Any) -> None:
        dcp.load(state, storage_reader=self.reader(), **kw)


def run(rank: int, world: int, names: list[str], places: list[list[str]]) -> dict[str, str]:
    """Every scenario of ``names`` at every place: ``{"name/kind": "ok" or the failure}``.
    Ranks stay in step: each scenario ends with a barrier, its failure or not."""
    out = {}
    for name in names:
        for kind, where, options in places:
            place = Place(kind, where, options).at(name.replace(":", "-"))
            fn, _, arg = name.partition(":")
            try:
                scenarios()[fn](rank, world, place, *([arg] if arg else []))
                out[f"{name}/{kind}"] = "ok"
            except BaseException:  # noqa: BLE001 - reported to the test, per scenario
                out[f"{name}/{kind}"] = traceback.format_exc()
            if dist.is_initialized():
                dist.barrier()
    return out


# ------------------------------------------------------------------ helpers


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two state dicts hold equal values (tensors, sharded tensors' local
    shards, anything else by ==)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    if a.keys() != b.keys():
        return False
    for key, x in a.items():
        y = b[key]
        if isinstance(x, ShardedTensor):
            if not all(torch.equal(s.tensor, t.tensor)
                       for s, t in zip(x.local_shards(), y.local_shards(), strict=True)):
                return False
        elif isinstance(x, torch.Tensor):
            if not torch.equal(x, y):
                return False
        elif x != y:
            return False
    return True


class Tiny(torch.nn.Module):
    """Two linear layers and an embedding bag: a few tensors of several shapes."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(6, 6)
        self.second = torch.nn.Linear(6, 2)
        self.bag = torch.nn.EmbeddingBag(7, 4)


class Blob:
    """A stateful object holding bytes-like state."""

    def __init__(self, value: Any) -> None:
        self.state = {"blob": value}

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = state

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Blob) and self.state == other.state


# ------------------------------------------------------------------ one process


def round_trip(rank: int, world: int, place: Place, threads: str) -> None:
    saved = Tiny().state_dict()
    place.save(saved, thread_count=int(threads))
    into = Tiny().state_dict()
    assert not _same(into, saved)
    place.load(into)
    assert _same(into, saved)


def dtype_cast(rank: int, world: int, place: Place) -> None:
    wide = {"w": torch.rand(4, 3, dtype=torch.float32)}
    place.at("wide").save(wide)
    narrow = {"w": torch.zeros(4, 3, dtype=torch.bfloat16)}
    place.at("wide").load(narrow)
    assert narrow["w"].dtype == torch.bfloat16 and torch.equal(narrow["w"],
                                                              wide["w"].bfloat16())
    small = {"w": torch.rand(4, 3, dtype=torch.bfloat16)}
    place.at("narrow").save(small)
    widened = {"w": torch.zeros(4, 3, dtype=torch.float32)}
    place.at("narrow").load(widened)
    assert torch.equal(widened["w"], small["w"].float())


class _Noting(dict):
    """A state dict that notes whether DCP assigned to it."""

    assigned = False

    def __setitem__(self, key: Any, value: Any) -> None:
        self.assigned = True
        super().__setitem__(key, value)


class _Marks(Stateful):
    loaded = False

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded = True


def stateful_in_place(rank: int, world: int, place: Place) -> None:
    """A stateful value is loaded through its load_state_dict and stays in the dict; a
    plain one is replaced. Both saves go to one place: the second replaces the first."""
    marks = _Marks()
    sd = _Noting()
    dict.__setitem__(sd, "foo", marks)
    place.save(sd)
    place.load(sd)
    assert marks.loaded and not sd.assigned and sd["foo"] is marks
    sd = _Noting()
    dict.__setitem__(sd, "foo", {"replicated": torch.rand(10, 10), "bytes": [1, 2, 3, 4]})
    place.save(sd)
    place.load(sd)
    assert sd.assigned


def empty_state(rank: int, world: int, place: Place) -> None:
    place.save({})
    place.load({})


def init_state_dict(rank: int, world: int, place: Place) -> None:
    """Loading is in place: the dicts given are the dicts filled; the optimizer's
    hyper-parameters come back too."""
    from dcp_parity_training import Net
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_state_dict,
    )

    model = Net()
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    place.save({"model": get_model_state_dict(model),
                "optimizer": get_optimizer_state_dict(model, optim)})
    other = Net()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    other_optim = torch.optim.Adam(other.parameters(), lr=0.2)
    msd, osd = get_model_state_dict(other), get_optimizer_state_dict(other, other_optim)
    into = {"model": msd, "optimizer": osd}
    place.load(into)
    assert into["model"] is msd and into["optimizer"] is osd
    set_state_dict(other, other_optim, model_state_dict=msd, optim_state_dict=osd)
    assert _same(get_model_state_dict(other), get_model_state_dict(model))
    assert other_optim.param_groups[0]["lr"] == 0.1


class XorBytes:
    """A stream transform of our own (every byte XORed with 0x5A), as torch's
    transform extensions are: compression, encryption."""

    @staticmethod
    def _make() -> Any:
        from torch.distributed.checkpoint._extension import StreamTransformExtension

        class Xor(StreamTransformExtension):
            @staticmethod
            def registry_name() -> str:
                return "stream.cloudckpt-test-xor"

            @staticmethod
            def from_descriptor(version: str) -> Xor:
                return Xor()

            def get_descriptor(self) -> str:
                return f"{self.registry_name()}/1"

            def transform_to(self, output: IO[bytes]) -> IO[bytes]:
                return _XorWriter(output)

            def transform_from(self, input: IO[bytes]) -> IO[bytes]:
                return io.BytesIO(bytes(b ^ 0x5A for b in input.read()))

        return Xor


class _XorWriter(io.RawIOBase):
    def __init__(self, out: IO[bytes]) -> None:
        self.out = out

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.out.write(bytes(b ^ 0x5A for b in view))
        return view.nbytes


def stream_transform(rank: int, world: int, place: Place) -> None:
    """Saved through a stream transform and loaded back: torch's writer does it; cloudckpt's
    refuses the transform (ConfigError, before anything is written)."""
    from torch.distributed.checkpoint._extension import ExtensionRegistry

    xor = XorBytes._make()
    saved = Tiny().state_dict()
    saved["blob"] = Blob(b"SomeBytes")
    place.save(saved, _extensions=[xor()])
    registry = ExtensionRegistry()
    registry.register(xor)
    into = Tiny().state_dict()
    into["blob"] = Blob(b"")
    dcp.load(into, storage_reader=FileSystemReader(place.where, _extension_registry=registry))
    assert _same(into, saved)


# ------------------------------------------------------------------ sharded tensors


def _chunks(*ranks: int) -> Any:
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    return ChunkShardingSpec(dim=0, placements=[f"rank:{r}" for r in ranks])


def _layout(dim_sizes: list[tuple[int, int, int]], cols: int | None) -> Any:
    """Shards of rows (start, count, rank), each ``cols`` wide (None: 1-D)."""
    from torch.distributed._shard.sharding_spec import EnumerableShardingSpec, ShardMetadata

    return EnumerableShardingSpec(shards=[
        ShardMetadata(shard_offsets=[s] + ([0] if cols else []),
                      shard_sizes=[n] + ([cols] if cols else []), placement=f"rank:{r}")
        for s, n, r in dim_sizes])


def _whole(t: Any) -> torch.Tensor | None:
    """A sharded tensor gathered on rank 0."""
    out = torch.zeros(t.shape) if dist.get_rank() == 0 else None
    t.gather(out=out)
    return out


class Holder(torch.nn.Module):
    """A module whose state is one sharded tensor (saved through the state-dict hook)."""

    def __init__(self, spec: Any, *size: int) -> None:
        from torch.distributed._shard import sharded_tensor
        from torch.distributed._shard.sharded_tensor import state_dict_hook

        super().__init__()
        self.sharded = sharded_tensor.rand(spec, *size, init_rrefs=False)
        self._register_state_dict_hook(state_dict_hook)


def sharded_round_trip(rank: int, world: int, place: Place, threads: str) -> None:
    saved_model = Holder(_chunks(0, 1), 10, 20)
    saved = saved_model.state_dict()
    place.save(saved, thread_count=int(threads))
    into = Holder(_chunks(0, 1), 10, 20).state_dict()
    assert not _same(into, saved)
    place.load(into)
    assert _same(into, saved)


SPECS_2D = [lambda: _chunks(0, 1), lambda: _chunks(0, 1, 1, 0),
            lambda: _layout([(0, 2, 0), (2, 1, 1), (3, 3, 0), (6, 3, 1), (9, 1, 0)], 20),
            lambda: _layout([(0, 8, 1), (8, 2, 0)], 20)]


def reshard(rank: int, world: int, place: Place) -> None:
    """Saved in one sharding, loaded into another, every pair, all at one place."""
    for i, save_spec in enumerate(SPECS_2D):
        for j, load_spec in enumerate(SPECS_2D):
            if i == j:
                continue
            saved = Holder(save_spec(), 10, 20)
            place.save(saved.state_dict())
            loaded = Holder(load_spec(), 10, 20)
            place.load(loaded.state_dict())
            a, b = _whole(saved.sharded), _whole(loaded.sharded)
            assert rank != 0 or torch.equal(a, b), f"spec {i} loaded as spec {j}"


def rows_to_columns(rank: int, world: int, place: Place) -> None:
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    saved = Holder(_chunks(0, 1), 10, 20)
    place.save(saved.state_dict())
    loaded = Holder(ChunkShardingSpec(dim=1, placements=["rank:0", "rank:1"]), 10, 20)
    place.load(loaded.state_dict())
    a, b = _whole(saved.sharded), _whole(loaded.sharded)
    assert rank != 0 or torch.equal(a, b)


def plain_values(rank: int, world: int, place: Place) -> None:
    place.save({"bytes0": [1], "bytes1": "string"})
    into = {"bytes0": [2], "bytes1": "other"}
    place.load(into)
    assert into == {"bytes0": [1], "bytes1": "string"}


SPECS_1D = [lambda: _chunks(0, 1), lambda: _chunks(0, 1, 1, 0),
            lambda: _layout([(0, 8, 1), (8, 24, 0)], None),
            lambda: _layout([(0, 10, 0), (10, 22, 1)], None)]


def sharded_and_plain_swap(rank: int, world: int, place: Place) -> None:
    """A sharded tensor loaded into a plain one and a plain one into a sharded one, for
    every pair of shardings, all at one place."""
    from torch.distributed._shard import sharded_tensor

    for i, save_spec in enumerate(SPECS_1D):
        for j, load_spec in enumerate(SPECS_1D):
            saved = {"sharded": sharded_tensor.rand(save_spec(), 32),
                     "replicated": torch.rand(32)}
            dist.broadcast(saved["replicated"], src=0)
            place.save(saved)
            into = {"sharded": torch.zeros(32),
                    "replicated": sharded_tensor.zeros(load_spec(), 32)}
            place.load(into)
            whole_saved, whole_loaded = _whole(saved["sharded"]), _whole(into["replicated"])
            assert rank != 0 or (torch.equal(whole_saved, into["sharded"]) and torch.equal(
                saved["replicated"], whole_loaded)), f"spec {i} and spec {j}"


def scenarios() -> dict[str, Callable[..., None]]:
    """Every scenario by name (``name:arg`` in :func:`run`'s names passes ``arg``)."""
    import dcp_parity_training as training

    return {f.__name__: f for f in (
        round_trip, dtype_cast, stateful_in_place, empty_state, init_state_dict,
        stream_transform, sharded_round_trip, reshard, rows_to_columns, plain_values,
        sharded_and_plain_swap, training.e2e, training.partial_load, training.key_order,
        training.overwrite)}
