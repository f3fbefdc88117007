"""Framework integrations: each framework's keys and layout mapped onto cloudckpt.

One package per framework (``areal``, ``roll``, ``rlinf``); nothing is
re-implemented there, only translated.
"""

from __future__ import annotations


def dcp_layouts() -> dict[str, tuple[str, str]]:
    """The framework checkpoint layouts :mod:`cloudckpt.hf.convert` reads a model from:
    ``{manifest kind: (the DCP part inside such a checkpoint, its model key prefix)}``.

    Each framework declares its own; they are imported here on call, so that convert
    (a lower layer) imports nothing from above it when it is itself imported.
    """
    from cloudckpt.integrations.rlinf.layout import DCP_LAYOUTS as rlinf

    return {**rlinf}
