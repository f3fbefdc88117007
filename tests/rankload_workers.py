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
