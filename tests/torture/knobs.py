"""How big the torture suite runs: small in the regular test run, full under
``make torture`` (``CLOUDCKPT_TORTURE=full``)."""

from __future__ import annotations

import os

FULL = os.environ.get("CLOUDCKPT_TORTURE", "").lower() == "full"


def scale(fast: int, full: int) -> int:
    """How many trials to run: ``full`` under ``make torture``, else ``fast``."""
    return full if FULL else fast

