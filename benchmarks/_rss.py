"""Peak RSS of one call, from the kernel's own high-water mark as well as samples.

A sampling thread alone can miss a buffer that lives for less than its
interval; the kernel's ``VmHWM`` cannot. Writing ``5`` to
``/proc/self/clear_refs`` resets that mark to the current RSS (Linux >= 4.0),
so after the call it is the true peak during the call. Where the reset is not
allowed, the samples are all there is, and ``hwm`` says so.
"""

from __future__ import annotations

import ctypes
import gc
import re
from typing import Any

from memory import RssSampler  # benchmarks/memory.py: run as a script, its folder is on the path

_HWM = re.compile(rb"^VmHWM:\s+(\d+) kB", re.M)


def trim_heap() -> None:
    """Give freed heap back to the OS, so earlier garbage cannot hide a call's needs."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


def reset_hwm() -> bool:
    """Reset the kernel's peak-RSS mark to the current RSS; False if not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def read_hwm() -> int:
    with open("/proc/self/status", "rb") as f:
        m = _HWM.search(f.read())
    return int(m[1]) * 1024 if m else 0


class PeakRss(RssSampler):
    """:class:`RssSampler` whose peak also takes the kernel's mark, reset on entry."""

    def __init__(self, interval: float = 0.005) -> None:
        super().__init__(interval)
        self.hwm = False

    def __enter__(self) -> PeakRss:
        gc.collect()
        trim_heap()
        self.hwm = reset_hwm()
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        if self.hwm:
            self.peak = max(self.peak, read_hwm())
