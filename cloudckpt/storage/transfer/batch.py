"""Parallel batches of requests: the thread pool a store and its children share.

:class:`Batches` runs a :class:`~cloudckpt.storage.Store`'s ``map``, ``put_many``,
``get_many``, ``get_ranges`` and ``iter_ranges`` on the
process's pool of ``max_concurrency`` threads (:func:`io_pool`): started once and
kept, because each save and load opens its stores afresh, and starting 16 threads
took about 40 ms of a 256 MiB load. Stores used at once share it. Nested batches (a
batch started from a pool thread) run inline, so a batch never waits on the pool it
occupies.
"""

from __future__ import annotations

import contextvars
import os
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor, wait
from typing import Any

from cloudckpt.storage.objects import T
from cloudckpt.storage.transfer.stopping import Stopped, task_context

_worker = threading.local()
_pools: dict[int, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def io_pool(size: int) -> ThreadPoolExecutor:
    """The process's pool of ``size`` I/O threads, started on first use."""
    with _pools_lock:
        pool = _pools.get(size)
        if pool is None:
            pool = _pools[size] = ThreadPoolExecutor(size, thread_name_prefix="cloudckpt-io")
        return pool


def _forget_pools() -> None:
    # A forked child has none of the parent's threads (nor, maybe, a free lock).
    global _pools_lock
    _pools.clear()
    _pools_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_pools)


def _in_worker(fn: Callable[[Any], T], item: Any) -> T:
    _worker.active = True
    try:
        return fn(item)
    finally:
        _worker.active = False


def _first(errors: list[BaseException]) -> BaseException:
    """The error a failed batch raises: an interrupt of the caller first, then the first
    task's own failure, not the :class:`Stopped` of the tasks that gave up after it."""
    for exc in errors:
        if not isinstance(exc, Exception):
            return exc
    given_up = (Stopped, CancelledError)
    return next((e for e in errors if not isinstance(e, given_up)), errors[0])


class Batches:
    """Calls run in parallel on the process's pool of ``size`` threads: at most ``size``
    in flight."""

    def __init__(self, size: int) -> None:
        self.size = size

    def map(self, fn: Callable[[Any], T], items: Sequence[Any]) -> list[T]:
        """Run ``fn`` over ``items`` with at most ``size`` in flight.

        Results keep the order of ``items``. The first failure is raised after
        the calls already in flight have finished (nothing keeps running
        behind the caller's back).
        """
        if len(items) <= 1 or getattr(_worker, "active", False):
            # Inline inside a pool thread: nested batches must not wait on the
            # pool they occupy (that deadlocks once every worker waits).
            return [fn(i) for i in items]
        # Each task runs in a copy of the caller's context (its context variables: who
        # asked, for logging and request accounting), with the batch's stop flag.
        stop = threading.Event()
        pool = io_pool(self.size)
        futures = [pool.submit(task_context(stop).run, _in_worker, fn, i) for i in items]
        results: list[T] = []
        errors: list[BaseException] = []
        for f in futures:
            while True:  # until f is done: an interrupt while waiting for it waits again
                try:
                    results.append(f.result())
                    break
                except BaseException as exc:  # noqa: BLE001 - re-raised below
                    # Failed, or this caller interrupted (Ctrl-C): the others stop at
                    # their next piece, and are waited for, unless interrupted again.
                    errors.append(exc)
                    stop.set()
                    for g in futures:
                        g.cancel()
                    if sum(not isinstance(e, Exception) for e in errors) >= 2:
                        raise
                    if f.done():
                        break
        if errors:
            raise _first(errors)
        return results

    def in_order(self, fn: Callable[[Any], T], items: Sequence[Any],
                 size_of: Callable[[Any], int], max_bytes: int | None) -> Iterator[T]:
        """Run ``fn`` over ``items`` in parallel; yield the results in the given order,
        each as soon as it has arrived, so the caller works on one while later ones
        run.

        At most ``size`` calls run at once, and at most ``max_bytes`` (each item's
        ``size_of``) are asked for or yielded but not yet consumed (one item alone may
        exceed it). Closing the iterator early, or a failed call, cancels the calls
        not started and waits for those running (nothing keeps running behind the
        caller's back); the failure is raised in order.
        """
        if getattr(_worker, "active", False):
            # Inside a pool thread: one at a time, inline (see map()).
            for item in items:
                yield fn(item)
            return
        pool = io_pool(self.size)
        pending: deque[tuple[Future[T], int]] = deque()
        held = 0
        nxt = 0
        try:
            while nxt < len(items) or pending:
                while nxt < len(items):
                    size = size_of(items[nxt])
                    if pending and max_bytes is not None and held + size > max_bytes:
                        break
                    fut = pool.submit(contextvars.copy_context().run, _in_worker, fn,
                                      items[nxt])
                    pending.append((fut, size))
                    held += size
                    nxt += 1
                fut, size = pending.popleft()
                data = fut.result()
                yield data
                held -= size  # consumed: the caller asked for the next one
        finally:
            for fut, _ in pending:
                fut.cancel()
            wait([fut for fut, _ in pending])
