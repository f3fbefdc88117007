"""How big the torture suite runs (small in the regular test run, full under
``make torture``, ``CLOUDCKPT_TORTURE=full``), and the forkserver its workers fork from."""

from __future__ import annotations

import os
from typing import Any

FULL = os.environ.get("CLOUDCKPT_TORTURE", "").lower() == "full"


def scale(fast: int, full: int) -> int:
    """How many trials to run: ``full`` under ``make torture``, else ``fast``."""
    return full if FULL else fast



def start_forkserver(preload: list[str], paths: list[str]) -> Any:
    """The forkserver context whose server imported ``preload`` once (with ``paths``
    first on its ``PYTHONPATH``: Python < 3.12 imports the preload list before it
    applies the parent's sys.path, and ignores failures)."""
    import multiprocessing as mp
    from multiprocessing import forkserver

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(preload)
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([*paths, *([saved] if saved else [])])
    try:
        forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved
    return ctx
