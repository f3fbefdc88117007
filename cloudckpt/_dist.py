"""The few collectives cloudckpt needs, each a no-op in a single process."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank(group: Any = None) -> int:
    return dist.get_rank(group) if initialized() else 0


def world_size(group: Any = None) -> int:
    return dist.get_world_size(group) if initialized() else 1


def all_gather_object(obj: Any, group: Any = None) -> list[Any]:
    if not initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj: Any, group: Any = None, src_rank: int = 0) -> Any:
    """``obj`` from group rank ``src_rank`` to every rank."""
    if not initialized():
        return obj
    box = [obj]
    src = dist.get_global_rank(group, src_rank) if group is not None else src_rank
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def all_reduce_max(value: float, group: Any = None) -> float:
    if not initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def new_cpu_group() -> Any:
    """A gloo group for checkpoint collectives, separate from training's, so a
    background save never interleaves its collectives with the training loop's."""
    if not initialized():
        return None
    return dist.new_group(backend="gloo")
