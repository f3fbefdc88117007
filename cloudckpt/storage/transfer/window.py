"""The upload window: a budget of bytes that streamed writes hold at once.

Every part a streamed upload fills or has in flight is a copy of the caller's
bytes; with many objects written in parallel those copies, not the state, set the
host memory a save needs. One :class:`ByteWindow` per process (per configured size)
bounds them all, so a save's extra memory is the window, whatever the state size.
"""

from __future__ import annotations

import mmap
import os
import threading

_windows: dict[int, ByteWindow] = {}
_lock = threading.Lock()


class ByteWindow:
    """A counting budget of bytes. ``acquire`` blocks until the bytes are free; a
    request larger than the whole window waits for an empty window instead, so it
    still runs (alone)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self.peak = 0
        self._cond = threading.Condition()
        # Part mappings given back, kept for reuse (a fresh mapping costs a page fault
        # per page) while what is used and kept fits the window; evicted as needed.
        self._kept: dict[int, list[mmap.mmap]] = {}
        self._kept_bytes = 0

    def acquire(self, n: int, *, wait: bool = True) -> int:
        """Take ``n`` bytes, waiting for them unless ``wait`` is False (then the window
        may run over); returns what to :meth:`release`."""
        with self._cond:
            while wait and self.used and self.used + n > self.capacity:
                self._cond.wait()
            self.used += n
            self.peak = max(self.peak, self.used)
        return n

    @property
    def kept(self) -> int:
        """Bytes of mappings kept for reuse (never more than the window leaves free)."""
        return self._kept_bytes

    def mapping(self, size: int) -> mmap.mmap:
        """An anonymous mapping of ``size`` bytes for a part: a kept one if there is.

        Kept mappings are evicted here, before a fresh one is made, not when bytes are
        acquired: the writer that acquired them is usually about to take a kept one.
        So the mappings alive stay within the window at every fresh mapping."""
        with self._cond:
            kept = self._kept.get(size)
            if kept:
                self._kept_bytes -= size
                return kept.pop()
            self._evict(self.capacity - self.used)
        return mmap.mmap(-1, size)

    def keep(self, mapped: mmap.mmap) -> None:
        """Take back a part's mapping: kept while it fits beside what is in use. Only
        for mappings nothing will write or send from any more (see :func:`exported`)."""
        self.release(0, keep=mapped)

    def _evict(self, room: int) -> None:
        """Close kept mappings until at most ``room`` bytes are kept (lock held)."""
        for size, kept in self._kept.items():
            while kept and self._kept_bytes > max(0, room):
                _close(kept.pop())
                self._kept_bytes -= size

    def __reduce__(self) -> tuple[object, tuple[int]]:
        # Unpickled in another process (a store sent to a worker): that process's window.
        return shared_window, (self.capacity,)

    def release(self, n: int, *, keep: mmap.mmap | None = None) -> None:
        """Give back ``n`` bytes and, in the same step, the mapping that held them
        (see :meth:`keep`): a writer let in by the bytes then finds it kept, rather
        than mapping afresh in between."""
        with self._cond:
            self.used -= max(n, 0)
            if keep is not None and self.used + self._kept_bytes + len(keep) <= self.capacity:
                self._kept.setdefault(len(keep), []).append(keep)
                self._kept_bytes += len(keep)
                keep = None
            if n > 0:
                self._cond.notify_all()
        if keep is not None:
            _close(keep)


def exported(mapped: mmap.mmap) -> bool:
    """Whether a view of ``mapped`` is alive (a resize to its own size refuses then):
    after a failed request, an HTTP client may still hold one for a while."""
    try:
        mapped.resize(len(mapped))
    except BufferError:
        return True
    except (ValueError, OSError):  # closed, or no mremap here: not reusable
        return True
    return False


def _close(mapped: mmap.mmap) -> None:
    try:
        mapped.close()
    except BufferError:  # a view of it is still alive: unmapped when that goes
        pass


def shared_window(capacity: int) -> ByteWindow:
    """The process's window of ``capacity`` bytes (stores with one value share it)."""
    with _lock:
        window = _windows.get(capacity)
        if window is None:
            window = _windows[capacity] = ByteWindow(capacity)
        return window


def _after_fork() -> None:
    # A forked child inherits no upload threads: nothing of the parent's is in use,
    # and a lock held by one of them at the fork would never be released.
    global _lock
    _lock = threading.Lock()
    for window in _windows.values():
        window.used = 0
        window._cond = threading.Condition()
        window._kept, window._kept_bytes = {}, 0


os.register_at_fork(after_in_child=_after_fork)
