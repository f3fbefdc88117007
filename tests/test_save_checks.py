"""What is saved can be restored: a DCP state holding what a load could not restore
(a numpy array, a custom object, a DataLoader) is refused at save time, naming the
key, before any byte is written, on every rank (moto over HTTP; real gloo ranks)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from dist_run import run_ranks

import cloudckpt.dcp as cdcp
from cloudckpt import CheckpointManager, ConfigError, ManagerOptions, StepInfo, open_store


class Opaque:
    """A user object with no state_dict(): DCP would pickle it whole."""

    def __init__(self) -> None:
        self.value = 3


BAD = {
    "numpy": lambda: np.arange(4),
    "object": Opaque,
    "dataloader": lambda: torch.utils.data.DataLoader(list(range(8)), batch_size=2),
}


def _nothing_under(uri: str, options: dict) -> bool:
    return not list(open_store(uri, options).list(internal=True))


@pytest.mark.parametrize("kind", sorted(BAD))
def test_dcp_save_refuses_an_unrestorable_value_naming_its_key(s3, kind):
    state = {"model": {"w": torch.ones(4)}, "extra": {"thing": BAD[kind]()}}
    with pytest.raises(ConfigError, match=r"state_dict\['extra\.thing'\].*Nothing was saved"):
        cdcp.save(state, s3.uri("dcp"), storage_options=s3.options)
    assert _nothing_under(s3.root, s3.options)


def test_async_save_refuses_before_it_returns(s3):
    with pytest.raises(ConfigError, match=r"'arr'"):
        cdcp.async_save({"w": torch.ones(4), "arr": np.zeros(2)}, s3.uri("dcp"),
                        storage_options=s3.options)
    assert _nothing_under(s3.root, s3.options)


def test_nested_stateful_objects_are_refused_with_where_to_put_them(s3):
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="only on the top-level values"):
        cdcp.save({"parts": {"model": model}}, s3.uri("dcp"), storage_options=s3.options)
    cdcp.save({"model": model}, s3.uri("dcp"), storage_options=s3.options)  # top level: fine
    restored = torch.nn.Linear(2, 2)
    cdcp.load({"model": restored}, s3.uri("dcp"), storage_options=s3.options)
    assert torch.equal(restored.weight, model.weight)


def test_manager_refuses_at_save_and_a_later_good_save_restores(s3):
    mgr = CheckpointManager(s3.root, ManagerOptions(async_save=True), storage_options=s3.options)
    with pytest.raises(ConfigError, match=r"'optim\.obj'"):
        mgr.save(StepInfo(), {"w": torch.ones(4), "optim": {"obj": Opaque()}}, force=True)
    assert _nothing_under(s3.root, s3.options)
    mgr.save(StepInfo(global_step=1), {"w": torch.full((4,), 2.0), "optim": {"lr": 0.1}},
             force=True)
    mgr.close()
    state = {"w": torch.zeros(4), "optim": {"lr": 0.0}}
    info = CheckpointManager(s3.root, storage_options=s3.options).restore(state)
    assert info is not None and info.global_step == 1
    assert torch.equal(state["w"], torch.full((4,), 2.0)) and state["optim"]["lr"] == 0.1


def test_a_bad_value_on_one_rank_stops_every_rank(s3):
    results = run_ranks("save_check_workers.save_with_bad_value_on_one_rank", 2, s3.root,
                        s3.options_json(), timeout=120)
    assert all("'extra.arr'" in r for r in results.values()), results
    assert results[0].startswith("rank 1:"), results
    assert _nothing_under(s3.root, s3.options)
