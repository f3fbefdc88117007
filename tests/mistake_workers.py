"""Rank functions for tests/test_user_mistakes.py (module level, for spawned ranks)."""

from __future__ import annotations


def refuse_on_one_rank(rank: int, world: int, root: str) -> tuple[str, str]:
    """Rank 1 passes state that cannot be restored; every rank must raise, none hang."""
    import torch

    from cloudckpt import CheckpointManager, ConfigError, ManagerOptions, StepInfo

    mgr = CheckpointManager(root, ManagerOptions(every_steps=1))
    per_rank = {"fn": (lambda x: x)} if rank == 1 else {"pos": rank}
    try:
        mgr.save(StepInfo(), {"w": torch.ones(4)}, per_rank=per_rank, rng=False)
    except ConfigError as exc:
        return type(exc).__name__, str(exc)
    return "saved", ""
