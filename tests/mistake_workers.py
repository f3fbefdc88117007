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


def refuse_a_sparse_tensor_on_one_rank(rank: int, world: int, root: str,
                                       options: str) -> list[tuple[str, str]]:
    """Rank 1's DCP state holds a sparse tensor: a DCP save and a manager's save must
    each raise ConfigError on every rank, before anything reaches the bucket."""
    import json

    import torch

    import cloudckpt.dcp as cdcp
    from cloudckpt import CheckpointManager, ConfigError, ManagerOptions, StepInfo

    opts = json.loads(options)
    weight = torch.eye(4)
    state = {"model": {"w": weight.to_sparse() if rank == 1 else weight}}
    mgr = CheckpointManager(f"{root}/run", ManagerOptions(every_steps=1), storage_options=opts)
    saves = [lambda: cdcp.save(state, f"{root}/dcp/step-1", storage_options=opts, step=1),
             lambda: mgr.save(StepInfo(), state, rng=False)]
    out = []
    try:
        for save in saves:
            try:
                save()
            except ConfigError as exc:
                out.append((type(exc).__name__, str(exc)))
            else:
                out.append(("saved", ""))
    finally:
        mgr.close()
    return out
