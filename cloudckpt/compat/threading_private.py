"""threading's private internal: its exit hooks, which run before concurrent.futures'
pools stop.

Python stops concurrent.futures' pools (which every upload runs on) in a hook of
threading's, before atexit's handlers run; a save pending at exit must finish before
that, so it waits in a hook of the same kind, registered later and so run earlier.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from cloudckpt.compat import Internal

INTERNALS = {
    "threading._register_atexit": Internal(
        "a hook run at exit before concurrent.futures' pools stop, so that a pending "
        "save can still upload"),
}


def register_before_pools_stop(hook: Callable[[], None]) -> None:
    """``threading._register_atexit(hook)``: ``hook`` runs at exit before the pools of
    concurrent.futures stop, when registered after they were imported (hooks run last
    registered first); ``atexit.register`` where threading has no such hook."""
    register = getattr(threading, "_register_atexit", None)
    if register is None:  # pragma: no cover - every CPython cloudckpt supports has it
        import atexit

        register = atexit.register
    register(hook)
