"""Device steps for child processes that save through a pinned pool on CPU: a memcpy
that leaves a marker file once copying has begun and takes a little time per chunk,
so that a parent can signal a save while it is copying. Enabled by THROUGH_POOL=1
(COPY_MARKER: the marker's path)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch

from cloudckpt.dcp.devicecopy import Copier, HostOps, PinnedPool


class SlowOps(HostOps):
    def __init__(self, marker: str | None) -> None:
        self.marker = marker

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        if self.marker:
            Path(self.marker).touch()
        time.sleep(0.02)
        return super().to_host(dst, src)


def writer_options() -> dict[str, Any]:
    """``{"copier": ...}`` taking every tensor through a small pool, or nothing."""
    if os.environ.get("THROUGH_POOL") != "1":
        return {}
    ops = SlowOps(os.environ.get("COPY_MARKER"))
    return {"copier": Copier(PinnedPool(256 << 10, 1 << 20, ops=ops), ops=ops,
                             every_tensor=True)}
