"""Functions run on real gloo ranks by the indexed-load tests (module level, for spawn)."""

from __future__ import annotations

import json

import torch
import torch.distributed.checkpoint as dcp
from dcp_workers import _equal, build, full_state, train_steps
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import cloudckpt.dcp as cdcp
from cloudckpt.dcp import ranksave


def save_indexed(rank: int, world: int, uri: str, options: str, ref_path: str,
                 stock: bool = True) -> dict:
    """An FSDP2 model and AdamW state saved in the indexed format (with a stock
    ``.metadata`` only when ``stock``); the full state goes to ``ref_path``."""
    if not stock:
        ranksave.SMALL_JOB_CHUNKS = 0
    model, optim = build(world)
    train_steps(model, optim)
    msd, osd = get_state_dict(model, optim)
    committed = cdcp.save({"model": msd, "optim": osd}, uri, storage_options=json.loads(options),
                          step=2, indexed=True)
    full = full_state(model, optim)
    if rank == 0:
        torch.save(full, ref_path)
        assert committed is not None
        return dict(committed.metadata["dcp"])
    return {}


def load_counted(rank: int, world: int, uri: str, options: str, ref_path: str,
                 how: str = "cloudckpt") -> tuple[bool, list[str]]:
    """Load into a model sharded over ``world`` ranks through a proxy of this rank's
    own: whether the state is the saved one bit for bit, and the keys this rank GETs.
    ``how``: ``cloudckpt`` (cloudckpt.dcp.load) or ``dropin`` (torch's dcp.load with a
    CloudStorageReader sharing the metadata)."""
    from cloudckpt_testkit.faultproxy import FaultProxy

    opts = json.loads(options)
    with FaultProxy(opts["endpoint_url"]) as proxy:
        opts["endpoint_url"] = proxy.endpoint
        model, optim = build(world)
        train_steps(model, optim, steps=1)  # other values, and optimizer state exists
        msd, osd = get_state_dict(model, optim)
        state = {"model": msd, "optim": osd}
        if how == "cloudckpt":
            cdcp.load(state, uri, storage_options=opts)
        else:
            dcp.load(state, storage_reader=cdcp.CloudStorageReader(
                uri, storage_options=opts, share_metadata=True))
        gets = [r.target.split("?")[0] for r in proxy.request_log if r.method == "GET"]
        lists = [r.target for r in proxy.request_log if "list-type" in r.target]
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    same = _equal(full_state(model, optim), torch.load(ref_path, weights_only=True))
    return same, gets + [f"LIST {t}" for t in lists]


def load_single_cloudckpt(uri: str, options: str, ref_path: str) -> bool:
    """cloudckpt.dcp.load into one plain process (no process group, no FSDP)."""
    model, optim = build(None)
    train_steps(model, optim, steps=1)
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd}
    cdcp.load(state, uri, storage_options=json.loads(options))
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return _equal(full_state(model, optim), torch.load(ref_path, weights_only=True))


def load_expecting_error(rank: int, world: int, uri: str, options: str, change: str
                         ) -> tuple[str, int]:
    """Load into a state that ``change`` makes differ from the checkpoint on rank 1 only
    (``shape``: one tensor wider; ``extra``: one key more; ``none``: as saved): the error
    raised, and how many GETs of data files this rank sent."""
    from cloudckpt_testkit.faultproxy import FaultProxy

    model, optim = build(world)
    msd, osd = get_state_dict(model, optim)
    state: dict = {"model": dict(msd), "optim": osd}
    if rank == 1 and change == "shape":
        state["model"]["0.bias"] = torch.zeros(65)
    elif rank == 1 and change == "extra":
        state["model"]["extra.weight"] = torch.zeros(3)
    opts = json.loads(options)
    with FaultProxy(opts["endpoint_url"]) as proxy:
        opts["endpoint_url"] = proxy.endpoint
        try:
            cdcp.load(state, uri, storage_options=opts)
            outcome = "loaded"
        except Exception as exc:  # noqa: BLE001 - reported to the test
            outcome = f"{type(exc).__name__}: {exc}"
        data = [r for r in proxy.request_log
                if r.method == "GET" and r.target.split("?")[0].endswith(".distcp")]
    return outcome, len(data)


#: A state whose chunks do not line up between 4 and 3 ranks: ``mid`` (37 rows: 10 a
#: part at 4 ranks, 13 at 3) and ``tail`` (2 rows: empty parts at 3 and 4 ranks) among
#: many 4-row tensors (1 row a part at 4, 2 at 3), named so that ``mid`` sits in the
#: middle of each records file and ``tail`` at its end.
UNEVEN_SMALL = 800


def uneven_shapes(n_small: int = UNEVEN_SMALL) -> dict[str, tuple[int, int]]:
    shapes = {f"s{i:04d}": (4, 2) for i in range(n_small)}
    shapes[f"s{n_small // 2:04d}_mid"] = (37, 3)
    shapes["t_tail"] = (2, 5)
    return shapes


def uneven_value(name: str, shape: tuple[int, int]) -> torch.Tensor:
    """The saved value of tensor ``name``: distinct in every element and tensor."""
    seed = sum(ord(c) * 31**i for i, c in enumerate(name)) % 10_000
    return torch.arange(shape[0] * shape[1], dtype=torch.float32).reshape(shape) + seed * 1e3


def _uneven_state(world: int, fill: bool) -> dict:
    """Each tensor of :func:`uneven_shapes` as a DTensor ``Shard(0)`` over ``world``
    ranks (torch.chunk's rows), holding its saved value (``fill``) or zeros."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    rank = dist.get_rank()
    out = {}
    for name, shape in uneven_shapes().items():
        parts = uneven_value(name, shape).chunk(world)
        local = parts[rank] if rank < len(parts) else torch.empty((0, shape[1]))
        local = local.clone() if fill else torch.zeros_like(local)
        out[name] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                       shape=torch.Size(shape), stride=(shape[1], 1))
    return out


def save_uneven(rank: int, world: int, uri: str, options: str) -> dict:
    """The uneven state saved indexed (no stock ``.metadata``) by ``world`` ranks."""
    ranksave.SMALL_JOB_CHUNKS = 0
    committed = cdcp.save(_uneven_state(world, True), uri, storage_options=json.loads(options),
                          step=1, indexed=True)
    return dict(committed.metadata["dcp"]) if committed is not None else {}


def load_uneven(rank: int, world: int, uri: str, options: str
                ) -> tuple[str, list[tuple[str, str | None]]]:
    """Load the uneven state onto ``world`` ranks through a proxy of this rank's own:
    ``"same"`` when every local shard is the saved value's, else what differs or the
    error raised; and this rank's GETs (path, Range header)."""
    from cloudckpt_testkit.faultproxy import FaultProxy

    opts = json.loads(options)
    with FaultProxy(opts["endpoint_url"]) as proxy:
        opts["endpoint_url"] = proxy.endpoint
        state = _uneven_state(world, False)
        try:
            cdcp.load(state, uri, storage_options=opts)
            outcome = "same"
        except Exception as exc:  # noqa: BLE001 - reported to the test
            outcome = f"{type(exc).__name__}: {exc}"
        gets = [(r.target.split("?")[0], r.headers.get("range")) for r in proxy.request_log
                if r.method == "GET"]
    if outcome == "same":
        for name, shape in uneven_shapes().items():
            parts = uneven_value(name, shape).chunk(world)
            want = parts[rank] if rank < len(parts) else torch.empty((0, shape[1]))
            if not torch.equal(state[name].to_local(), want):
                outcome = f"{name} differs"
                break
    return outcome, gets
