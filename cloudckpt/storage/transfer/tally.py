"""Counting the requests (and retries) an operation made, across the threads it used.

:func:`counting` opens a :class:`Tally` in a context variable; every attempt of a
storage operation (:meth:`RetryPolicy.call`) in that context, or in the tasks of
the batches it starts (which run in copies of it), adds to it. Reports of saves
and restores read it.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class Tally:
    """Requests made (every attempt counts) and how many of them were retries."""

    requests: int = 0
    retries: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, retry: bool) -> None:
        with self._lock:
            self.requests += 1
            self.retries += int(retry)


_current: contextvars.ContextVar[Tally | None] = contextvars.ContextVar(
    "cloudckpt_tally", default=None)


@contextmanager
def counting() -> Iterator[Tally]:
    """Count the requests made inside the ``with`` block (in this context)."""
    tally = Tally()
    token = _current.set(tally)
    try:
        yield tally
    finally:
        _current.reset(token)


def count_attempt(retry: bool) -> None:
    """One attempt of a storage operation (``retry``: not its first)."""
    tally = _current.get()
    if tally is not None:
        tally.add(retry)
