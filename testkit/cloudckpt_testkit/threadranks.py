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

:class:`SampledWorld` runs only some ranks of a larger world (the coordinator, the
last, a few between), for world sizes whose threads and states would not fit one
machine: the collectives hand every rank the contributions of all ``size`` ranks,
the absent ones' synthesised by a :class:`RankModel` the simulation provides.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
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
        #: The ranks that run, one thread each (every rank here; some in a SampledWorld).
        self.ranks: tuple[int, ...] = tuple(range(size))
        self._timeout = timeout
        self._slots: list[Any] = [None] * size
        self._kind = ""
        self._out: list[Any] = []
        self._barriers()

    def _barriers(self) -> None:
        # Every running rank has put its value in when the first opens (and the last to
        # arrive has completed the exchange); nobody overwrites a slot before everyone
        # has read the result when the second opens.
        n = len(self.ranks)
        self._arrive = threading.Barrier(n, action=self._complete_exchange,
                                         timeout=self._timeout)
        self._barrier = threading.Barrier(n, timeout=self._timeout)

    # --------------------------------------------------------------- running

    def run(self, fn: Callable[[int], T]) -> list[T]:
        """Call ``fn(rank)`` on every rank, one thread each; return the results by
        rank (None for a rank that does not run). A rank that raises breaks the world's
        barriers, so no other rank waits for it; the first rank's error is raised here."""
        self._arrive.reset()
        self._barrier.reset()
        results: list[Any] = [None] * self.size
        errors: list[BaseException | None] = [None] * self.size

        def body(rank: int) -> None:
            _RANK.set(rank)
            try:
                results[rank] = fn(rank)
            except BaseException as exc:  # noqa: BLE001 - raised by run() below
                errors[rank] = exc
                self._arrive.abort()
                self._barrier.abort()

        threads = [threading.Thread(target=contextvars.Context().run, args=(body, r),
                                    name=f"rank-{r}", daemon=True) for r in self.ranks]
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

    def _exchange(self, value: Any, kind: str) -> list[Any]:
        """Every rank puts ``value`` in and gets every rank's value back."""
        self._slots[self.rank()] = value
        self._kind = kind
        self._arrive.wait()  # the last to arrive has run _complete_exchange
        out = self._out
        self._barrier.wait()  # nobody overwrites a slot before everyone has read it
        return out

    def _complete_exchange(self) -> None:
        self._out = self.complete(self._kind, self._slots)

    def complete(self, kind: str, slots: list[Any]) -> list[Any]:
        """Every rank's value in the collective ``kind`` (a ``torch.distributed``
        function's name), from ``slots``, what the running ranks put in."""
        return list(slots)

    def _source(self, src: int) -> int:
        if src not in self.ranks:
            raise ValueError(f"rank {src} is the source of a collective but does not run "
                             f"here (running: {list(self.ranks)[:8]}...)")
        return src

    def all_gather_object(self, object_list: list[Any], obj: Any, group: Any = None) -> None:
        object_list[:] = self._exchange(obj, "all_gather_object")

    def gather_object(self, obj: Any, object_gather_list: list[Any] | None = None,
                      dst: int = 0, group: Any = None, **_: Any) -> None:
        values = self._exchange(obj, "gather_object")
        if self.rank() == dst and object_gather_list is not None:
            object_gather_list[:] = values

    def broadcast_object_list(self, object_list: list[Any], src: int = 0, group: Any = None,
                              **_: Any) -> None:
        src = self._source(src)
        values = self._exchange(list(object_list) if self.rank() == src else None,
                                "broadcast_object_list")
        object_list[:] = values[src]

    def scatter_object_list(self, scatter_object_output_list: list[Any],
                            scatter_object_input_list: list[Any] | None = None,
                            src: int = 0, group: Any = None, **_: Any) -> None:
        src = self._source(src)
        values = self._exchange(scatter_object_input_list if self.rank() == src else None,
                                "scatter_object_list")
        scatter_object_output_list[0] = values[src][self.rank()]

    def all_reduce(self, tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None,
                   async_op: bool = False) -> None:
        stacked = torch.stack(self._exchange(tensor.detach().clone(), "all_reduce"))
        if op == dist.ReduceOp.MAX:
            tensor.copy_(stacked.max(dim=0).values)
        elif op == dist.ReduceOp.MIN:
            tensor.copy_(stacked.min(dim=0).values)
        elif op == dist.ReduceOp.SUM:
            tensor.copy_(stacked.sum(dim=0))
        else:
            raise NotImplementedError(f"all_reduce op {op} in a thread world")

    def barrier(self, group: Any = None, **_: Any) -> None:
        self._exchange(None, "barrier")

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


# ----------------------------------------------------------- sampled ranks


def sample_ranks(size: int, k: int) -> tuple[int, ...]:
    """``k`` ranks of ``size`` to run: the coordinator (0), the last, and the rest
    evenly between (all of them when ``k >= size``).

    >>> sample_ranks(16, 3), sample_ranks(16384, 4), sample_ranks(3, 8)
    ((0, 8, 15), (0, 5461, 10922, 16383), (0, 1, 2))
    """
    if k < 2:
        raise ValueError(f"sample at least 2 ranks (the coordinator and the last), not {k}")
    if k >= size:
        return tuple(range(size))
    return tuple(sorted({round(i * (size - 1) / (k - 1)) for i in range(k)}))


@dataclass(frozen=True)
class Collective:
    """One collective of a sampled world, as its model sees it."""

    #: The ``torch.distributed`` function: ``all_gather_object``, ``gather_object``,
    #: ``broadcast_object_list``, ``scatter_object_list``, ``all_reduce``, ``barrier``.
    kind: str
    #: Its position among the collectives of the world's life (from 0).
    index: int
    #: What each running rank put in (a broadcast's or scatter's source: its list).
    sampled: Mapping[int, Any]
    size: int


class RankModel:
    """What the ranks that do not run would put into each collective.

    A simulation subclasses it: :meth:`contribution` gives an absent rank's value
    (its save plan, its write results...) at full size, as that rank would have
    computed it; :meth:`seen` sees every collective first (a scatter's list holds
    what each absent rank would have received). The base class knows only that a
    collective where every running rank put in None (a barrier, a check that
    passed) gets None from every absent rank too, and refuses anything else, so a
    payload nobody modelled fails loudly instead of being faked.
    """

    def seen(self, call: Collective) -> None:
        """Called once per collective, before any contribution is asked for."""

    def contribution(self, call: Collective, rank: int) -> Any:
        """Absent ``rank``'s value in ``call``."""
        if all(v is None for v in call.sampled.values()):
            return None
        kinds = sorted({type(v).__name__ for v in call.sampled.values()})
        raise NotImplementedError(
            f"{type(self).__name__} has no model of rank {rank}'s contribution to "
            f"{call.kind} #{call.index} (the running ranks put in {kinds}): model it in "
            "contribution(), or run every rank")


#: Collectives where only the source's value counts: absent ranks put in None.
_SOURCED = ("broadcast_object_list", "scatter_object_list")


class SampledWorld(ThreadWorld):
    """A world of ``size`` ranks of which only ``ranks`` run (see :func:`sample_ranks`);
    every collective hands the running ranks all ``size`` contributions, the absent
    ranks' from ``model``. A broadcast's or scatter's source must run.

    What the absent ranks would send to the store is not sent; a simulation can
    stand their objects in (:func:`cloudckpt_testkit.counting.phantom`).

    >>> class Same(RankModel):
    ...     def contribution(self, call, rank):
    ...         return call.sampled[0] + rank
    >>> world = SampledWorld(1000, sample_ranks(1000, 3), Same())
    >>> def body(rank):
    ...     out = []
    ...     dist.all_gather_object(out, 7)
    ...     return sum(out)
    >>> with world.patched():
    ...     [r for r in world.run(body) if r is not None]
    [505001, 505001, 505001]
    """

    def __init__(self, size: int, ranks: Sequence[int], model: RankModel, *,
                 timeout: float = 900.0) -> None:
        super().__init__(size, timeout=timeout)
        chosen = tuple(sorted(set(ranks)))
        if not chosen or chosen[0] != 0 or chosen[-1] >= size:
            raise ValueError(f"the ranks that run must include the coordinator (0) and lie "
                             f"below {size}: {list(chosen)[:8]}")
        self.ranks = chosen
        self.model = model
        self.collectives = 0
        self._barriers()

    def complete(self, kind: str, slots: list[Any]) -> list[Any]:
        # On a thread of its own, so that the model's CPU is not counted as the CPU
        # of whichever running rank arrived last (a simulation measures the
        # coordinator's thread).
        with ThreadPoolExecutor(1, thread_name_prefix="rank-model") as pool:
            return pool.submit(self._complete, kind, slots).result()

    def _complete(self, kind: str, slots: list[Any]) -> list[Any]:
        call = Collective(kind, self.collectives, {r: slots[r] for r in self.ranks},
                          self.size)
        self.collectives += 1
        self.model.seen(call)
        if kind == "barrier" or kind in _SOURCED:
            return [call.sampled.get(r) for r in range(self.size)]
        return [call.sampled[r] if r in call.sampled else self.model.contribution(call, r)
                for r in range(self.size)]
