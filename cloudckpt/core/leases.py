"""Keeping a record of ownership alive while its writer works.

A claim that only its writer's pid vouches for cannot be judged from another container
or node (:mod:`cloudckpt.core.liveness`). So while a writer holds one, it rewrites it
every quarter of its lease, compare-and-swap on the version it last wrote: a record not
renewed for a whole lease belongs to a writer that is gone, wherever it ran. One daemon
thread per process renews every held :class:`Lease`; a renewal that finds the record
changed or removed (taken over, seized by a delete) stops, and :attr:`Lease.lost` says so.
"""

from __future__ import annotations

import heapq
import logging
import os
import threading
import time
from collections.abc import Callable

from cloudckpt.errors import CommitConflictError
from cloudckpt.storage import RetryPolicy, Store

log = logging.getLogger(__name__)


class Lease:
    """The record at ``key`` of ``store``, last written as ``version``, renewed with the
    bytes ``record()`` gives every ``seconds / 4`` until :meth:`stop`."""

    def __init__(self, store: Store, key: str, record: Callable[[], bytes], version: str,
                 seconds: float) -> None:
        self.interval = seconds / 4
        # Each renewal gets a quarter of the lease, retries included, so a slow one
        # does not hold the next back.
        self._store = store.with_retry(RetryPolicy(max_attempts=4, deadline=self.interval))
        self._key = key
        self._record = record
        self.version = version
        self.lost: str | None = None  # why the record is no longer this lease's
        self._held = True
        self._failing = False
        self._lock = threading.Lock()  # one renewal at a time; stop waits for it

    def start(self) -> Lease:
        _renewer.add(self)
        return self

    def stop(self) -> None:
        """Renew no more; returns once a renewal under way has ended."""
        with self._lock:
            self._held = False

    def renew(self) -> bool:
        """Rewrite the record once; False when the lease has ended (stopped or lost)."""
        with self._lock:
            if not self._held:
                return False
            try:
                self.version = self._store.put_if_match(self._key, self._record(),
                                                        self.version).version or self.version
            except (CommitConflictError, FileNotFoundError):
                self._held = False
                self.lost = "it was replaced or removed by another process"
                log.warning("%s was replaced or removed by another process while this one "
                            "held it (taken over after its lease looked expired, or by a "
                            "delete); what this process writes there will not commit",
                            self._store.key_uri(self._key))
                return False
            except Exception as exc:  # noqa: BLE001 - the next renewal tries again
                if not self._failing:
                    log.warning("could not renew %s (%s); trying again in %.0f s",
                                self._store.key_uri(self._key), exc, self.interval)
                self._failing = True
                return True
            self._failing = False
            return True


class _Renewer:
    """The thread renewing every lease of this process when each falls due."""

    def __init__(self) -> None:
        self._due: list[tuple[float, int, Lease]] = []
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None

    def add(self, lease: Lease) -> None:
        with self._cv:
            heapq.heappush(self._due, (time.monotonic() + lease.interval, id(lease), lease))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="cloudckpt-leases",
                                                daemon=True)
                self._thread.start()
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._due or self._due[0][0] > time.monotonic():
                    self._cv.wait(self._due[0][0] - time.monotonic() if self._due else None)
                _, key, lease = heapq.heappop(self._due)
            if lease.renew():
                with self._cv:
                    heapq.heappush(self._due, (time.monotonic() + lease.interval, key, lease))


_renewer = _Renewer()


def _after_fork() -> None:
    global _renewer
    _renewer = _Renewer()  # the parent's thread does not run in a forked child


os.register_at_fork(after_in_child=_after_fork)
