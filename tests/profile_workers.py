"""Rank functions for the save profiles' two-rank test (run by dist_run.run_ranks): a
partial resume refused on every rank, then allowed."""

from __future__ import annotations

import copy
from typing import Any

import torch

from cloudckpt import CheckpointManager, ManagerOptions, PartialCheckpointError, StepInfo


def _trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The same model and Adam state on every rank (replicated), after one step."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(2, 8)).square().sum().backward()
    opt.step()
    return model, opt


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def refused_everywhere(rank: int, world: int, root: str, options: dict) -> dict[str, Any]:
    mgr = CheckpointManager(root, ManagerOptions(), storage_options=options)
    model, opt = _trained(0)
    info = StepInfo(epoch_step=1, global_step=1, steps_per_epoch=10)
    mgr.save(info, {"model": model, "optim": opt}, force=True)
    with torch.no_grad():
        model.weight.add_(1.0)
    mgr.save(info.next(), {"model": model, "optim": opt}, force=True, profile="weights")
    saved = copy.deepcopy(model.state_dict())
    mgr.close()

    other, other_opt = _trained(rank + 5)  # each rank's own values: nothing may change
    before = copy.deepcopy(other.state_dict()), copy.deepcopy(other_opt.state_dict())
    resumer = CheckpointManager(root, ManagerOptions(), storage_options=options)
    refused = None
    try:
        resumer.restore({"model": other, "optim": other_opt}, uri="weights-step-2")
    except PartialCheckpointError:
        refused = "PartialCheckpointError"
    untouched = _equal(other.state_dict(), before[0]) and _equal(other_opt.state_dict(),
                                                                 before[1])
    resumer.restore({"model": other, "optim": other_opt}, uri="weights-step-2",
                    allow_partial=True)
    allowed_model = _equal(other.state_dict(), saved)
    allowed_optim_kept = _equal(other_opt.state_dict(), before[1])
    latest = resumer.restore({"model": other, "optim": other_opt})
    resumer.close()
    return {"refused": refused, "untouched": untouched, "allowed_model": allowed_model,
            "allowed_optim_kept": allowed_optim_kept,
            "latest_step": latest.global_step if latest else None}
