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


def _same_error(name: str, message: str) -> BaseException:
    """The cloudckpt error of class ``name`` (StorageError if it is not one of ours)."""
    from . import errors

    cls = getattr(errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, errors.CloudCkptError)):
        cls = errors.StorageError
    return cls(message)


def _summary(exc: BaseException) -> tuple[str, str]:
    from .errors import CloudCkptError
    from .storage.retry import describe

    return type(exc).__name__, str(exc) if isinstance(exc, CloudCkptError) else describe(exc)


def agree(error: BaseException | None, group: Any = None) -> None:
    """Every rank says whether its part of a step failed; if any did, every rank
    raises: a failed rank its own error, the others the same class with its message
    (the first failed rank's), so no rank goes on to a collective the others skip."""
    if not initialized():
        if error is not None:
            raise error
        return
    gathered = all_gather_object(None if error is None else _summary(error), group)
    failed = [(r, g) for r, g in enumerate(gathered) if g is not None]
    if not failed:
        return
    if error is not None:
        raise error
    r, (name, message) = failed[0]
    raise _same_error(name, f"rank {r}: {message}")


def on_coordinator(fn: Any, group: Any = None, *, share: bool = True) -> Any:
    """Run ``fn()`` on rank 0 and give every rank its result (rank 0 only, with
    ``share=False``: others get None), or raise its error on every rank (rank 0 its
    own, the others the same class with its message)."""
    result: Any = None
    outcome: tuple[str, Any, Any] | None = None
    error: BaseException | None = None
    if rank(group) == 0:
        try:
            result = fn()
            outcome = ("ok", result if share else None, None)
        except Exception as exc:  # noqa: BLE001 - every rank raises it below
            error = exc
            outcome = ("error", *_summary(exc))
    outcome = broadcast_object(outcome, group)
    if outcome[0] == "ok":
        return result if rank(group) == 0 else outcome[1]
    if error is not None:
        raise error
    raise _same_error(outcome[1], f"rank 0: {outcome[2]}")
