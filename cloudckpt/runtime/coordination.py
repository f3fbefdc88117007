"""How ranks agree: the one module where cloudckpt's coordinated steps meet.

Every step that more than one rank takes part in goes through these helpers,
so a failure on any rank is raised on every rank, promptly, as the same
cloudckpt error class, and no rank is left waiting in a collective the others
skipped (invariant 8 of docs/architecture.md):

- :func:`on_coordinator`: rank 0 does the work (storage I/O: claim, commit,
  pointer swap, listing); every rank gets its result or its error;
- :func:`each_rank`: every rank does its own part (its shard of training
  state); every rank gets all the results, or every rank raises the first
  failure;
- :func:`agree`: every rank has checked something of its own; if any refused,
  every rank raises;
- :func:`collect`: every rank does its part, the coordinator alone gathers the
  results and finishes the step (a commit from each rank's file list);
- :func:`all_reduce_max_ints`: a few integers every rank contributes, reduced in one
  fixed-size collective (whether every rank's save has the same structure).

In a single process (no process group), or with :data:`SOLO` as the group
(this rank alone, inside a job: its own local-tier save), each is a plain
call. A failing rank raises its own exception; the others raise the same class
with its message, prefixed by the failing rank.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, Literal, TypeVar, cast, overload

T = TypeVar("T")
R = TypeVar("R")


def initialized() -> bool:
    """Whether a process group is up. Without torch imported none can be, so
    commands that never touch tensors (``cloudckpt ls``) do not import it."""
    module = sys.modules.get("torch.distributed")
    return module is not None and module.is_available() and module.is_initialized()


class _Solo:
    def __repr__(self) -> str:
        return "SOLO"


#: The group of this process alone: every helper acts as in a single process, even
#: inside a job (a rank saving to or restoring from its own node-local tier).
SOLO: Any = _Solo()


def alone(group: Any = None) -> bool:
    """Whether ``group`` is this process alone: no process group is up, or :data:`SOLO`."""
    return group is SOLO or not initialized()


def _dist() -> Any:
    import torch.distributed

    return torch.distributed


def rank(group: Any = None) -> int:
    return 0 if alone(group) else _dist().get_rank(group)


def world_size(group: Any = None) -> int:
    return 1 if alone(group) else _dist().get_world_size(group)


def new_cpu_group() -> Any:
    """A gloo group for checkpoint collectives, separate from training's, so a
    background save never interleaves its collectives with the training loop's."""
    if not initialized():
        return None
    return _dist().new_group(backend="gloo")


def all_reduce_max(value: float, group: Any = None) -> float:
    """The largest ``value`` over the ranks (so every rank decides alike)."""
    if alone(group):
        return value
    import torch

    dist = _dist()
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def all_reduce_max_ints(values: list[int], group: Any = None) -> list[int]:
    """Each of ``values`` (64-bit signed integers) maximised over the ranks, in one
    fixed-size collective (a minimum is the maximum of the negated value): an O(1)
    check every rank makes alike, however many ranks there are."""
    if alone(group):
        return list(values)
    import torch

    dist = _dist()
    t = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [int(v) for v in t.tolist()]


def _gather(obj: Any, group: Any) -> list[Any]:
    if alone(group):
        return [obj]
    dist = _dist()
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _broadcast(obj: Any, group: Any) -> Any:
    if alone(group):
        return obj
    box = [obj]
    dist = _dist()
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def _summary(exc: BaseException) -> tuple[str, str]:
    """What other ranks need to raise the same error: its class name and message."""
    from cloudckpt.errors import CloudCkptError
    from cloudckpt.storage.retry import describe

    return type(exc).__name__, str(exc) if isinstance(exc, CloudCkptError) else describe(exc)


def _same_error(name: str, message: str) -> BaseException:
    """The cloudckpt error of class ``name`` (StorageError if it is not one of ours)."""
    from cloudckpt import errors

    cls = getattr(errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, errors.CloudCkptError)):
        cls = errors.StorageError
    return cls(message)


def _raise_first(mine: BaseException | None, summaries: list[Any]) -> None:
    """Raise if any rank failed: this rank's own error, else the first failed rank's."""
    failed = [(r, s) for r, s in enumerate(summaries) if s is not None]
    if not failed:
        return
    if mine is not None:
        raise mine
    r, (name, message) = failed[0]
    raise _same_error(name, f"rank {r}: {message}")


def agree(error: BaseException | None, group: Any = None) -> None:
    """Every rank says whether its check failed (``error``); if any did, every rank
    raises (a failed rank its own error, the others the same class)."""
    if alone(group):
        if error is not None:
            raise error
        return
    _raise_first(error, _gather(None if error is None else _summary(error), group))


def each_rank(fn: Callable[[], T], group: Any = None) -> list[T]:
    """Run ``fn()`` on every rank (its own part of a step); return every rank's result,
    by rank, on every rank, or raise on every rank if any rank's ``fn`` failed."""
    if alone(group):
        return [fn()]
    result, error = _outcome(fn)
    gathered = _gather(("error", _summary(error)) if error is not None else ("ok", result),
                       group)
    _raise_first(error, [g[1] if g[0] == "error" else None for g in gathered])
    return [g[1] for g in gathered]


def collect(fn: Callable[[], T], then: Callable[[list[T]], R], group: Any = None) -> R | None:
    """Run ``fn()`` on every rank and gather the results on the coordinator only (not
    on every rank: what each sends is not multiplied by the world size), which runs
    ``then(results)``, by rank; return its result on the coordinator, None elsewhere.
    If any rank's ``fn`` or the coordinator's ``then`` failed, every rank raises (a
    failed rank its own error, the others the first failure's class)."""
    result, error = _outcome(fn)
    if alone(group):
        if error is not None:
            raise error
        return then([cast(T, result)])
    dist = _dist()
    mine = ("error", _summary(error)) if error is not None else ("ok", result)
    coordinator = rank(group) == 0
    gathered: list[Any] | None = [None] * world_size(group) if coordinator else None
    dst = dist.get_global_rank(group, 0) if group is not None else 0
    dist.gather_object(mine, gathered, dst=dst, group=group)

    def finish() -> R:
        assert gathered is not None  # the coordinator's
        _raise_first(error, [g[1] if g[0] == "error" else None for g in gathered])
        return then([g[1] for g in gathered])

    try:
        return on_coordinator(finish, group, share=False)
    except Exception:
        if error is not None:
            raise error from None
        raise


def checked(fn: Callable[[], T], group: Any = None) -> T:
    """Run ``fn()`` on every rank (its own checks before a load applies anything) and
    return this rank's result; raise on every rank if any rank's ``fn`` failed. Unlike
    :func:`each_rank`, only the failures are exchanged."""
    result, error = _outcome(fn)
    agree(error, group)
    return cast(T, result)  # agree raised unless fn() returned it


def _outcome(fn: Callable[[], T]) -> tuple[T | None, Exception | None]:
    """``fn()``'s result, or the error it raised, which every rank raises afterwards."""
    try:
        return fn(), None
    except Exception as exc:  # noqa: BLE001 - every rank raises it once they agree
        return None, exc


@overload
def on_coordinator(fn: Callable[[], T], group: Any = None, *,
                   share: Literal[True] = True) -> T: ...


@overload
def on_coordinator(fn: Callable[[], T], group: Any = None, *, share: bool) -> T | None: ...


def on_coordinator(fn: Callable[[], T], group: Any = None, *, share: bool = True) -> T | None:
    """Run ``fn()`` on rank 0 and give every rank its result (rank 0 only, with
    ``share=False``: others get None, for results that cannot be sent, such as a
    writer), or raise its error on every rank."""
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
    outcome = _broadcast(outcome, group)
    if outcome[0] == "ok":
        return result if rank(group) == 0 else outcome[1]
    if error is not None:
        raise error
    raise _same_error(outcome[1], f"rank 0: {outcome[2]}")
