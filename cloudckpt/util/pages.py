"""Faulting in memory before bytes are copied into it, on the thread that asks.

A load receives each piece of a response into its destination tensor on the event
loop's thread; a destination freshly allocated (``torch.empty``) is not yet backed
by pages, so every first write to a 4 KiB page stops that thread for the kernel to
find and zero one (about 65,000 times per 256 MiB). ``madvise(MADV_POPULATE_WRITE)``
(Linux 5.14+) makes the pages writable in one call without touching the bytes, so a
reader's worker thread does it, without the GIL, before the loop writes there.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import sys
from typing import Any

#: madvise's advice to fault pages in writable, without writing them (Linux 5.14+).
_MADV_POPULATE_WRITE = 23
#: Below this, faulting in as the bytes arrive costs less than the call.
_WORTH = 1 << 20


def _madvise() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    fn = libc.madvise
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


_call = _madvise()


def populate(address: int, size: int) -> bool:
    """Fault in the whole pages of ``[address, address + size)`` writable, leaving
    their bytes as they are; False where the system cannot (an older kernel, memory
    that is not the process's ordinary memory, another OS): the first writes then
    fault them in as usual."""
    if _call is None or size < _WORTH:
        return False
    page = mmap.PAGESIZE
    start = -(-address // page) * page
    end = (address + size) // page * page
    if end <= start:
        return False
    return _call(start, end - start, _MADV_POPULATE_WRITE) == 0
