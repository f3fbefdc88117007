"""Async saves within a host staging budget (issue 14, item 3), over moto S3."""

from __future__ import annotations

import os

import pytest
import torch

import cloudckpt.dcp as cdcp
from cloudckpt import CheckpointManager, ManagerOptions, StepInfo, open_checkpoint
from cloudckpt.dcp import BudgetStager, default_budget
from cloudckpt.errors import CommitConflictError, ConfigError
from cloudckpt.storage import open_store

MiB = 1024 * 1024


def state(n: int = 8, seed: int = 0) -> dict[str, torch.Tensor]:
    """``n`` float32 tensors of 1 MiB each, plus a nested dict and a non-tensor value."""
    g = torch.Generator().manual_seed(seed)
    sd = {f"t{i}": torch.randn(MiB // 4, generator=g) for i in range(n)}
    return {**sd, "nested": {"b": torch.randn(7, generator=g)}, "count": 3}


def loaded(uri: str, options: dict, like: dict) -> dict:
    out = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v
           for k, v in like.items() if k != "nested"}
    out["nested"] = {"b": torch.zeros(7)}
    out["count"] = 0
    cdcp.load(out, uri, storage_options=options)
    return out


def test_stager_copies_at_most_the_budget_and_reuses_its_buffers():
    sd = state()
    stager = BudgetStager(3 * MiB + 100)
    first = stager.stage(sd)
    assert first.staged_bytes <= 3 * MiB + 100 and first.staged_bytes >= 3 * MiB
    assert first.live_bytes == 8 * MiB + 7 * 4 - first.staged_bytes
    staged = [k for k in sd if k.startswith("t") and first.is_staged(first.state_dict[k])]
    live = [k for k in sd if k.startswith("t") and not first.is_staged(first.state_dict[k])]
    assert len(staged) == 3 and len(live) == 5
    for k in live:  # not copied: the caller's own tensor
        assert first.state_dict[k] is sd[k]
    for k in staged:  # a copy, equal, in other memory
        assert torch.equal(first.state_dict[k], sd[k])
        assert first.state_dict[k].data_ptr() != sd[k].data_ptr()
    assert first.state_dict["count"] == 3
    second = stager.stage(state(seed=1))
    assert {k: second.state_dict[k].data_ptr() for k in staged} == {
        k: first.state_dict[k].data_ptr() for k in staged}  # the same host buffers
    assert torch.equal(second.state_dict[staged[0]], state(seed=1)[staged[0]])


def test_default_budget_is_a_share_of_host_memory(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    one = default_budget()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert default_budget() == pytest.approx(one / 4, rel=0.01)
    assert 0 < one < os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    with pytest.raises(ConfigError, match="staging budget"):
        BudgetStager(-1)


@pytest.mark.parametrize("budget", [0, 3 * MiB, 64 * MiB])
def test_async_save_over_budget_writes_live_tensors_before_returning(s3, budget):
    sd = state()
    expected = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in sd.items()}
    expected["nested"] = {"b": sd["nested"]["b"].clone()}
    uri = s3.uri(f"budget-{budget}")
    fut = cdcp.async_save(sd, uri, storage_options=s3.options, staging_budget=budget,
                          file_size=MiB)
    # What is in the bucket when the call returns: every tensor that was not staged
    # must be in it already, since training may now change it.
    present = {o.key for o in open_store(uri, s3.options).list() if o.key.endswith(".distcp")}
    for v in sd.values():  # training goes on: the checkpoint must not see this
        if isinstance(v, torch.Tensor):
            v.add_(1.0)
    sd["nested"]["b"].add_(1.0)
    ckpt = fut.result(timeout=120)
    assert ckpt is not None
    ckpt.verify(deep=True)
    got = loaded(uri, s3.options, expected)
    for k, v in expected.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(got[k], v), k
    assert torch.equal(got["nested"]["b"], expected["nested"]["b"]) and got["count"] == 3
    meta = cdcp.CloudStorageReader(uri, storage_options=s3.options).read_metadata()
    files_of = {idx.fqn: info.relative_path for idx, info in meta.storage_data.items()}
    live_fqns = [k for k in expected if k.startswith("t")][budget // MiB:]
    assert {files_of[k] for k in live_fqns} <= present


def test_failed_async_save_over_budget_does_not_hang(s3):
    uri = s3.uri("taken")
    cdcp.save(state(2), uri, storage_options=s3.options)
    fut = cdcp.async_save(state(), uri, storage_options=s3.options, staging_budget=MiB)
    with pytest.raises(CommitConflictError, match="already committed"):
        fut.result(timeout=60)
    with pytest.raises(ConfigError, match="not both"):
        cdcp.async_save(state(), s3.uri("x"), stager=BudgetStager(1), staging_budget=1)


def test_manager_async_save_with_a_budget_is_a_snapshot(s3):
    sd = state(4)
    expected = {k: v.clone() for k, v in sd.items() if isinstance(v, torch.Tensor)}
    opts = ManagerOptions(every_steps=1, async_save=True, staging_budget=MiB)
    with CheckpointManager(s3.root, opts, storage_options=s3.options) as mgr:
        assert mgr.save(StepInfo(steps_per_epoch=10), sd)
        for k in expected:
            sd[k].add_(1.0)  # after the save returned: must not reach the checkpoint
        mgr.wait()
        restored = {k: torch.zeros_like(v) for k, v in expected.items()}
        info = CheckpointManager(s3.root, storage_options=s3.options).restore(restored)
    assert info is not None and info.global_step == 0
    for k, v in expected.items():
        assert torch.equal(restored[k], v), k
    assert open_checkpoint(s3.uri("step-0"), s3.options).step == 0
    with pytest.raises(ConfigError, match="staging_budget"):
        ManagerOptions(staging_budget=-5)


def test_only_the_first_save_of_a_layout_allocates_staging_buffers(s3):
    stager = BudgetStager(64 * MiB)
    for step in range(3):
        fut = cdcp.async_save(state(seed=step), s3.uri(f"alloc-{step}"),
                              storage_options=s3.options, stager=stager)
        fut.result()
        assert stager.allocations == 1, f"save {step} allocated host buffers again"
    assert stager.pinned_bytes == 0  # CPU tensors: plain host memory, nothing pinned
    got = loaded(s3.uri("alloc-2"), s3.options, state(seed=2))
    assert torch.equal(got["t3"], state(seed=2)["t3"])
    stager.stage({"other": torch.ones(5)})  # another layout: made anew, once
    assert stager.allocations == 2
