"""Logging for cloudckpt's commands: cloudckpt's own lines at the level asked for,
every other library's at WARNING until asked (``-vvv``).

A root logger at INFO lets the storage clients' own INFO lines through ("Found
credentials in environment variables", per-request notes): noise, and lines that
can quote endpoints or headers.
"""

from __future__ import annotations

import logging
import sys

_OURS = {0: logging.WARNING, 1: logging.INFO, 2: logging.DEBUG}


def configure(verbose: int = 0, fmt: str = "%(levelname)s %(name)s: %(message)s") -> None:
    """``verbose`` 0: warnings; 1: cloudckpt's progress (INFO); 2: cloudckpt's debug
    lines; 3 or more: every library's debug lines."""
    logging.basicConfig(level=logging.DEBUG if verbose >= 3 else logging.WARNING, format=fmt)
    logging.getLogger("cloudckpt").setLevel(_OURS.get(verbose, logging.DEBUG))


def on_stderr(logger: logging.Logger) -> logging.Logger:
    """``logger`` with a handler of its own on stderr at INFO, not propagating (once):
    for lines a launched process must show whatever logging its framework set up
    (activation's "bound ..." lines, a binding's note of what it placed)."""
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger
