"""Ranks as threads: N ranks of one job simulated by N threads of one process.

For simulations at a world size no machine can start as processes (the scale
simulation runs 1,024 ranks on two cores). Inside :meth:`ThreadWorld.patched`,
the ``torch.distributed`` calls that cloudckpt's coordination helpers and
DCP's ``_DistWrapper`` make (rank, world size, the object collectives,
``all_reduce``, ``barrier``) are served by an in-process exchange between the
threads, each of which knows its rank from a context variable.

Objects are handed over by reference, not pickled as a real collective would
(copying a 1,024-rank plan to every thread would take longer than the
simulation); nothing in cloudckpt mutates what it received. Requests a rank
makes from a store's pool threads carry its rank along (the pool copies the
caller's context variables), so :func:`current_rank` tells who asked.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")

_RANK: contextvars.ContextVar[int | None] = contextvars.ContextVar("cloudckpt_thread_rank",
                                                                    default=None)
_GROUP = object()  # what new_group returns: the one group every rank is in


def current_rank() -> int | None:
    """The simulated rank of the calling thread (None outside :meth:`ThreadWorld.run`)."""
    return _RANK.get()


class ThreadWorld:
    """``size`` ranks as threads, exchanging objects through shared slots.

    >>> world = ThreadWorld(4)
    >>> with world.patched():
    ...     world.run(lambda rank: dist.get_rank() * 10)
    [0, 10, 20, 30]
    """

    def __init__(self, size: int, *, timeout: float = 900.0) -> None:
        if size < 1:
            raise ValueError("a world has at least one rank")
        self.size = size
        self._timeout = timeout
        self._barrier = threading.Barrier(size, timeout=timeout)
        self._slots: list[Any] = [None] * size

    # --------------------------------------------------------------- running

    def run(self, fn: Callable[[int], T]) -> list[T]:
        """Call ``fn(rank)`` on every rank, one thread each; return the results by
        rank. A rank that raises breaks the world's barrier, so no other rank
        waits for it; the first rank's error is raised here."""
        self._barrier.reset()
        results: list[Any] = [None] * self.size
        errors: list[BaseException | None] = [None] * self.size

        def body(rank: int) -> None:
            _RANK.set(rank)
            try:
                results[rank] = fn(rank)
            except BaseException as exc:  # noqa: BLE001 - raised by run() below
                errors[rank] = exc
                self._barrier.abort()

        threads = [threading.Thread(target=contextvars.Context().run, args=(body, r),
                                    name=f"rank-{r}", daemon=True) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        failed = [e for e in errors if e is not None]
        # A broken barrier is the echo of another rank's failure: report the cause.
        causes = [e for e in failed if not isinstance(e, threading.BrokenBarrierError)]
        if causes or failed:
            raise (causes or failed)[0]
        return results

    # ----------------------------------------------------------- collectives

    def rank(self) -> int:
        rank = _RANK.get()
        if rank is None:
            raise RuntimeError("a collective called outside ThreadWorld.run()")
        return rank

    def _exchange(self, value: Any) -> list[Any]:
        """Every rank puts ``value`` in and gets every rank's value back."""
        self._slots[self.rank()] = value
        self._barrier.wait()
        out = list(self._slots)
        self._barrier.wait()  # nobody overwrites a slot before everyone has read it
        return out

    def all_gather_object(self, object_list: list[Any], obj: Any, group: Any = None) -> None:
        object_list[:] = self._exchange(obj)

    def gather_object(self, obj: Any, object_gather_list: list[Any] | None = None,
                      dst: int = 0, group: Any = None, **_: Any) -> None:
        values = self._exchange(obj)
        if self.rank() == dst and object_gather_list is not None:
            object_gather_list[:] = values

    def broadcast_object_list(self, object_list: list[Any], src: int = 0, group: Any = None,
                              **_: Any) -> None:
        values = self._exchange(list(object_list) if self.rank() == src else None)
        object_list[:] = values[src]

    def scatter_object_list(self, scatter_object_output_list: list[Any],
                            scatter_object_input_list: list[Any] | None = None,
                            src: int = 0, group: Any = None, **_: Any) -> None:
        values = self._exchange(scatter_object_input_list if self.rank() == src else None)
        scatter_object_output_list[0] = values[src][self.rank()]

    def all_reduce(self, tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None,
                   async_op: bool = False) -> None:
        stacked = torch.stack(self._exchange(tensor.detach().clone()))
        if op == dist.ReduceOp.MAX:
            tensor.copy_(stacked.max(dim=0).values)
        elif op == dist.ReduceOp.MIN:
            tensor.copy_(stacked.min(dim=0).values)
        elif op == dist.ReduceOp.SUM:
            tensor.copy_(stacked.sum(dim=0))
        else:
            raise NotImplementedError(f"all_reduce op {op} in a thread world")

    def barrier(self, group: Any = None, **_: Any) -> None:
        self._exchange(None)

    # -------------------------------------------------------------- patching

    @contextmanager
    def patched(self) -> Iterator[ThreadWorld]:
        """``torch.distributed`` served by this world, until the block ends."""
        calls: dict[str, Any] = {
            "is_available": lambda: True,
            "is_initialized": lambda: True,
            "get_rank": lambda group=None: self.rank(),
            "get_world_size": lambda group=None: self.size,
            "get_global_rank": lambda group, group_rank: group_rank,
            "get_backend": lambda group=None: "gloo",
            "new_group": lambda *a, **k: _GROUP,
            "all_gather_object": self.all_gather_object,
            "gather_object": self.gather_object,
            "broadcast_object_list": self.broadcast_object_list,
            "scatter_object_list": self.scatter_object_list,
            "all_reduce": self.all_reduce,
            "barrier": self.barrier,
        }
        saved = {name: getattr(dist, name) for name in calls}
        for name, fn in calls.items():
            setattr(dist, name, fn)
        try:
            yield self
        finally:
            for name, fn in saved.items():
                setattr(dist, name, fn)
