"""Stopping a batch's running tasks: its failure, or its caller's interrupt, ends them
at their next piece instead of their end.

:meth:`Store.map` gives its tasks a stop flag (a context variable, so nested work
in the same task sees it); long tasks call :func:`check_stop` between pieces
(each part written, each attempt of a request).
"""

from __future__ import annotations

import contextvars
import threading

from cloudckpt.errors import CloudCkptError

#: Set for the tasks of a batch once the batch has failed or its caller was interrupted.
_stop: contextvars.ContextVar[threading.Event | None] = contextvars.ContextVar(
    "cloudckpt_batch_stop", default=None)


class Stopped(CloudCkptError):
    """A task of a batch gave up because another failed or the caller was interrupted
    (never the error a batch raises, unless nothing else failed)."""


def check_stop() -> None:
    """Raise :class:`Stopped` if this task's batch has failed: called between the
    pieces of long tasks (each part written, each attempt of a request), so a
    failed or interrupted batch ends after the requests in flight, not the tasks."""
    stop = _stop.get()
    if stop is not None and stop.is_set():
        raise Stopped("stopped: another task of the batch failed, or it was interrupted")


def task_context(stop: threading.Event) -> contextvars.Context:
    """A copy of the caller's context in which :func:`check_stop` watches ``stop``."""
    ctx = contextvars.copy_context()
    ctx.run(_stop.set, stop)
    return ctx
