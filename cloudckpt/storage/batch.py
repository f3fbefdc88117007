"""Parallel batches of requests: the thread pool a store and its children share.

:class:`BatchMixin` is part of every :class:`~cloudckpt.storage.Store`. It runs
``map``, ``put_many``, ``get_many``, ``get_ranges`` and ``iter_ranges`` on the
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
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor, wait
from typing import Any

from cloudckpt.storage.objects import ObjectInfo, T
from cloudckpt.storage.stopping import Stopped, task_context
from cloudckpt.util.crc import Buffer

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


class BatchMixin:
    """Batches over the store's own ``put``, ``get`` and ``get_range``, with at most
    ``max_concurrency`` requests in flight."""

    max_concurrency: int
    # put, get and get_range: the Store's own (see base.py)

    def map(self, fn: Callable[[Any], T], items: Sequence[Any]) -> list[T]:
        """Run ``fn`` over ``items`` with at most ``max_concurrency`` in flight.

        Results keep the order of ``items``. The first failure is raised after
        the requests already in flight have finished (nothing keeps running
        behind the caller's back).
        """
        if len(items) <= 1 or getattr(_worker, "active", False):
            # Inline inside a pool thread: nested batches must not wait on the
            # pool they occupy (that deadlocks once every worker waits).
            return [fn(i) for i in items]
        # Each task runs in a copy of the caller's context (its context variables: who
        # asked, for logging and request accounting), with the batch's stop flag.
        stop = threading.Event()
        futures = [self._executor().submit(task_context(stop).run, _in_worker, fn, i)
                   for i in items]
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

    def put_many(self, items: Mapping[str, Buffer]) -> dict[str, ObjectInfo]:
        """Write many objects in parallel; return their infos by key."""
        infos = self.map(lambda kv: self.put(kv[0], kv[1]), list(items.items()))
        return {i.key: i for i in infos}

    def get_many(self, keys: Sequence[str]) -> dict[str, bytes]:
        """Read many whole objects in parallel."""
        keys = list(keys)
        return dict(zip(keys, self.map(self.get, keys), strict=True))

    def get_ranges(self, ranges: Sequence[tuple[str, int, int]]) -> list[bytes]:
        """Read many ``(key, start, end)`` ranges in parallel, in the given order."""
        return self.map(lambda r: self.get_range(*r), list(ranges))

    def _get_range_tuple(self, r: tuple[str, int, int]) -> bytes:
        return self.get_range(*r)

    def iter_ranges(self, ranges: Sequence[tuple[str, int, int]], *,
                    max_bytes: int | None = None) -> Iterator[bytes]:
        """Read ``(key, start, end)`` ranges in parallel; yield them in the given order,
        each as soon as it has arrived, so the caller works on one while later ones
        are fetched.

        At most ``max_concurrency`` requests run at once, and at most ``max_bytes``
        are requested or yielded but not yet consumed (one range alone may exceed
        it). Closing the iterator early, or a failed read, cancels the requests not
        started and waits for those running (nothing keeps running behind the
        caller's back); the failure is raised in order.
        """
        ranges = list(ranges)
        if getattr(_worker, "active", False):
            # Inside a pool thread: one at a time, inline (see map()).
            for key, start, end in ranges:
                yield self.get_range(key, start, end)
            return
        pending: deque[tuple[Future[bytes], int]] = deque()
        held = 0
        nxt = 0
        try:
            while nxt < len(ranges) or pending:
                while nxt < len(ranges):
                    key, start, end = ranges[nxt]
                    if pending and max_bytes is not None and held + (end - start) > max_bytes:
                        break
                    fut = self._executor().submit(contextvars.copy_context().run, _in_worker,
                                                  self._get_range_tuple,
                                                  (key, start, end))
                    pending.append((fut, end - start))
                    held += end - start
                    nxt += 1
                fut, size = pending.popleft()
                data = fut.result()
                yield data
                held -= size  # consumed: the caller asked for the next one
        finally:
            for fut, _ in pending:
                fut.cancel()
            wait([fut for fut, _ in pending])

    def _executor(self) -> ThreadPoolExecutor:
        return io_pool(self.max_concurrency)
