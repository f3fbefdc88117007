"""Ctrl-C during a save is never swallowed, and never committed past.

Python raises ``KeyboardInterrupt`` wherever the main thread happens to be when
SIGINT arrives, and a few places drop it: a finalizer (``__del__``, a weakref
callback) prints it as "Exception ignored", and some C code clears it (a Cython
module's first import registers its types with ``collections.abc`` and ignores
what that raises: ``numpy.random``'s lazy import inside a save's RNG capture was
one). A save that swallowed the interrupt would go on and commit, and the user's
Ctrl-C would be lost.

While a save runs on the main thread with Python's own Ctrl-C handling,
:func:`watching` notes each SIGINT just before that handler raises it. The
commit calls :func:`raise_if_swallowed` before it writes the manifest, and the
watch raises it again on a clean exit: an interrupt that never came out comes
out there. A handler of the application's own is left alone.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

_depth = 0  # watches open on the main thread
_noted = False  # a SIGINT came during the outermost watch and has not come out


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    global _noted
    _noted = True
    signal.default_int_handler(signum, frame)  # raises KeyboardInterrupt


def _on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextmanager
def watching() -> Iterator[None]:
    """Note every Ctrl-C while the block runs, so a swallowed one is raised again
    (at the commit, or when the block ends); also a decorator. Nothing is changed
    off the main thread, or where SIGINT has a handler other than Python's own."""
    global _depth, _noted
    if not _on_main_thread():
        yield
        return
    if _depth == 0:
        if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            yield
            return
        _noted = False
        signal.signal(signal.SIGINT, _on_sigint)
    _depth += 1
    try:
        yield
    except BaseException:
        _noted = False  # it came out (or a failure did): nothing is lost
        raise
    else:
        raise_if_swallowed()
    finally:
        _depth -= 1
        if _depth == 0 and signal.getsignal(signal.SIGINT) is _on_sigint:
            signal.signal(signal.SIGINT, signal.default_int_handler)


def raise_if_swallowed() -> None:
    """Raise ``KeyboardInterrupt`` if a Ctrl-C came during this thread's watch and
    was swallowed on its way out (only the main thread receives signals)."""
    global _noted
    if _noted and _on_main_thread():
        _noted = False
        raise KeyboardInterrupt
