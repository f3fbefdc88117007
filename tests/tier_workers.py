"""Rank functions for the local tier's two-rank tests (run by dist_run.run_ranks):
what ``close()`` does with the newest local step, and a local step one rank refuses."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import torch

from cloudckpt import CheckpointManager, LocalTier, ManagerOptions, StepInfo
from cloudckpt.errors import CloudCkptError


class Position:
    """A rank's own state (its dataloader position)."""

    def __init__(self, n: int = 0) -> None:
        self.n = n

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, state: dict) -> None:
        self.n = state["n"]


class Logged(logging.Handler):
    """The ``cloudckpt`` logger's records, as text."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        logger = logging.getLogger("cloudckpt")
        logger.setLevel(logging.INFO)
        logger.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.getMessage()}")


def _train(mgr: CheckpointManager, steps: int, rank: int) -> tuple[torch.Tensor, int]:
    """``steps`` steps of a model replicated on every rank, each saved when due; the
    weight and this rank's position after the last."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    position = Position()
    for step in range(steps):
        with torch.no_grad():
            model.weight.mul_(1.5).add_(0.25)
        position.n = 100 * rank + step
        mgr.save(StepInfo(epoch_step=step, global_step=step, steps_per_epoch=100),
                 {"model": model.state_dict()}, per_rank={"data": position})
    return model.weight.detach().clone(), position.n


def close_drain(rank: int, world: int, root: str, options: dict, local_dir: str, mode: str
                ) -> dict[str, Any]:
    """Four local saves (steps 0-3), then ``close()``. ``mode``: ``drain`` (the default
    tier), ``keep`` (``drain_at_close=False``), ``held`` (every 2nd local save drained,
    the newest among them), ``lost`` (rank 1's newest local copy gone before close),
    ``late`` (a ``drain_timeout`` no drain meets). Then a fresh manager without a local
    tier restores what the bucket holds on every rank."""
    logged = Logged()
    drains: list[int] = []
    tier = LocalTier(local_dir, every_steps=1, drain_every=2 if mode == "held" else None,
                     drain_at_close=mode != "keep",
                     drain_timeout=1e-3 if mode == "late" else 600.0)
    mgr = CheckpointManager(root, ManagerOptions(local=tier, on_report=lambda r: drains.append(
        r.step) if r.op == "drain" else None), storage_options=options)
    weight, position = _train(mgr, 4, rank)
    if mode == "lost" and rank == 1:
        shutil.rmtree(Path(local_dir) / f"rank-{rank:05d}" / "step-3")
    out: dict[str, Any] = {"weight": weight.tolist(), "position": position, "drains": drains}
    try:
        mgr.close()
    except CloudCkptError as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["logged"] = logged.lines
    fresh = {"model": torch.nn.Linear(8, 8).state_dict()}
    back = Position(-1)
    info = CheckpointManager(root, storage_options=options).restore(
        fresh, per_rank={"data": back})
    out["restored"] = None if info is None else {
        "step": info.global_step, "weight": fresh["model"]["weight"].tolist(),
        "same": torch.equal(fresh["model"]["weight"], weight), "position": back.n}
    return out


def refused_local_step(rank: int, world: int, root: str, options: dict, local_dir: str
                       ) -> dict[str, Any]:
    """A local save of step 0 on both ranks (not drained), then rank 1's per-rank state
    damaged on its disk, then a fresh manager's restore: every rank refuses step 0
    before loading anything, so rank 0's model stays as it was (and nothing resumes)."""
    tier = LocalTier(local_dir, every_steps=1, drain_at_close=False)
    mgr = CheckpointManager(root, ManagerOptions(local=tier), storage_options=options)
    _train(mgr, 1, rank)
    mgr.close()
    import torch.distributed as dist

    if rank == 1:
        state = Path(local_dir) / "rank-00001" / "step-0" / "state" / "rank-00001.bin"
        data = bytearray(state.read_bytes())
        data[-1] ^= 0xFF
        state.write_bytes(bytes(data))
    dist.barrier()
    logged = Logged()
    untouched = torch.full((8, 8), -7.0)
    fresh = {"model": {"weight": untouched.clone(), "bias": torch.zeros(8)}}
    info = CheckpointManager(root, ManagerOptions(local=tier), storage_options=options
                             ).restore(fresh, per_rank={"data": Position(-1)})
    return {"info": None if info is None else info.global_step,
            "untouched": torch.equal(fresh["model"]["weight"], untouched),
            "logged": logged.lines}
