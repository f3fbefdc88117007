"""Background saves the process must not end without: finished, or reported.

A save that was started either commits or is reported, loudly, before the
process ends (invariant 11 of docs/architecture.md). Every background save (an async DCP
save, a manager's async save, a background Hub push) runs through
:func:`run_in_background`, which tracks it until it ends and its outcome has
been seen. Then:

- **at interpreter exit** (the script ends, ``sys.exit``, an uncaught
  exception), before Python stops the thread pools that uploads need, every
  pending save is waited for, up to :func:`exit_timeout` seconds in all. One
  that failed (and whose error nobody has seen) or is still running at the
  deadline gets an ERROR naming it, and the process exits with the command-line
  exit code of its error (4, incomplete, for one still running);
- **on SIGTERM** (Python's default skips exit handlers), while a save runs in
  the background, a handler chained in front of the previous one lets the saves
  finish or report within the same bound, then restores the previous handler
  and raises the signal again, so the process still ends as that signal.

The bound is ``CLOUDCKPT_EXIT_TIMEOUT`` (seconds, default 600).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from cloudckpt.compat.threading_private import register_before_pools_stop
from cloudckpt.errors import EXIT_INCOMPLETE, EXIT_INTERRUPTED, exit_code
from cloudckpt.util.text import plural

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Seconds the process waits at exit (or on SIGTERM) for its background saves.
DEFAULT_EXIT_TIMEOUT = 600.0


def exit_timeout() -> float:
    """``CLOUDCKPT_EXIT_TIMEOUT`` in seconds, else :data:`DEFAULT_EXIT_TIMEOUT`."""
    raw = os.environ.get("CLOUDCKPT_EXIT_TIMEOUT")
    try:
        return max(0.0, float(raw)) if raw else DEFAULT_EXIT_TIMEOUT
    except ValueError:
        log.warning("CLOUDCKPT_EXIT_TIMEOUT=%r is not a number of seconds; using %.0f",
                    raw, DEFAULT_EXIT_TIMEOUT)
        return DEFAULT_EXIT_TIMEOUT


class SaveFuture(Future):
    """A background save's future that knows whether its outcome was seen
    (``result()`` or ``exception()`` called): an unseen failure is reported at exit."""

    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what
        self.seen = False

    def result(self, timeout: float | None = None) -> Any:
        self.seen = True
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self.seen = True
        return super().exception(timeout)


_lock = threading.Lock()
_tracked: list[SaveFuture] = []
_hooked = False
_sigterm_previous: Any = None


def run_in_background(fn: Callable[[], T], what: str, *, name: str = "cloudckpt-save"
                      ) -> SaveFuture:
    """Run ``fn`` on a thread of its own; the returned future is tracked until it
    is done and its outcome has been seen (see the module docstring)."""
    future = SaveFuture(what)

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - surfaced on result(), or at exit
            future.set_exception(exc)

    _track(future)
    # A daemon thread: the exit hook waits for it with a bound; a non-daemon one would
    # be joined by Python without any.
    threading.Thread(target=run, name=name, daemon=True).start()
    return future


def _track(future: SaveFuture) -> None:
    global _hooked
    with _lock:
        _tracked[:] = [f for f in _tracked if _unsettled(f)]
        _tracked.append(future)
        first = not _hooked
        _hooked = True
    if first:
        _register_exit_hook()
    _chain_sigterm()


def outstanding() -> list[SaveFuture]:
    """Tracked saves still running, or failed with nobody having seen their error."""
    with _lock:
        return [f for f in _tracked if _unsettled(f)]


def _unsettled(f: SaveFuture) -> bool:
    """Still running, or failed unseen: what the exit must wait for or report."""
    return not f.done() or (not f.seen and _failed(f))


def _failed(f: Future) -> bool:
    return f.done() and not f.cancelled() and Future.exception(f) is not None


def _register_exit_hook() -> None:
    # Python stops concurrent.futures' pools (which every upload runs on) in a hook of
    # threading's, before atexit's handlers run; hooks registered later run earlier.
    import concurrent.futures.thread  # noqa: F401 - its hook must be registered first

    register_before_pools_stop(_at_exit)


def flush(timeout: float) -> list[tuple[SaveFuture, str]]:
    """Wait up to ``timeout`` seconds in all for the outstanding saves; return those
    that did not commit, each with what went wrong (an ERROR is logged for each)."""
    todo = outstanding()
    if not todo:
        return []
    running = [f for f in todo if not f.done()]
    if running:
        log.warning("the process is ending with %s still running (%s); waiting up to "
                    "%.0f s for %s (CLOUDCKPT_EXIT_TIMEOUT). Call close() or wait() before "
                    "the end to do this yourself.", plural(len(running), "background save"),
                    ", ".join(f.what for f in running), timeout,
                    "them" if len(running) != 1 else "it")
    deadline = time.monotonic() + timeout
    failed = []
    for f in todo:
        try:
            f.result(max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            failed.append((f, f"still running after {timeout:.0f} s; NOT committed"))
        except BaseException as exc:  # noqa: BLE001 - reported, not raised
            failed.append((f, f"failed, NOT committed: {type(exc).__name__}: {exc}"))
        else:
            log.info("%s finished before exit", f.what)
    for f, why in failed:
        log.error("checkpoint LOST: %s %s", f.what, why)
    return failed


def _exit_status(failed: list[tuple[SaveFuture, str]]) -> int:
    for f, _ in failed:
        if f.done():
            exc = Future.exception(f)
            if exc is not None:
                return exit_code(exc)
    return EXIT_INCOMPLETE


def _at_exit() -> None:
    try:
        failed = flush(exit_timeout())
    except KeyboardInterrupt:
        left = outstanding()
        for f in left:
            log.error("checkpoint LOST: %s was interrupted at exit; "
                      "NOT committed", f.what)
        _hard_exit(EXIT_INTERRUPTED if left else 0)
        return
    if failed:
        _hard_exit(_exit_status(failed))


def _hard_exit(status: int) -> None:
    """End now with ``status``: Python offers exit hooks no other way to change it."""
    if not status:
        return
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    os._exit(status)


# ------------------------------------------------------------------ SIGTERM


def _chain_sigterm() -> None:
    """Put :func:`_on_sigterm` in front of the process's SIGTERM handler (once; only
    the main thread may set handlers). It stays, and passes the signal straight on
    while no save is running."""
    global _sigterm_previous
    if threading.current_thread() is not threading.main_thread():
        return
    current = signal.getsignal(signal.SIGTERM)
    if current is _on_sigterm or current is None:  # None: set outside Python
        return
    _sigterm_previous = current
    signal.signal(signal.SIGTERM, _on_sigterm)
    log.debug("SIGTERM: background saves get up to %.0f s to finish first", exit_timeout())


def _on_sigterm(signum: int, frame: Any) -> None:
    previous = _sigterm_previous if _sigterm_previous is not None else signal.SIG_DFL
    # Restored first: a second SIGTERM while the saves finish goes to it at once.
    signal.signal(signal.SIGTERM, previous)
    if outstanding():
        log.warning("SIGTERM received while background saves run: letting them finish "
                    "first")
        flush(exit_timeout())
    signal.raise_signal(signum)  # to the previous handler: the process ends as before
