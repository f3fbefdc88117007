"""Peak memory beside speed: one resident-set sampler for every benchmark."""

from __future__ import annotations

import gc
import os
import threading
from typing import Any


class RssSampler:
    """Samples this process's resident set every ``interval`` seconds in a thread."""

    PAGE = os.sysconf("SC_PAGE_SIZE")

    def __init__(self, interval: float = 0.005) -> None:
        self.interval = interval
        self.baseline = 0
        self.peak = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @classmethod
    def rss(cls) -> int:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * cls.PAGE

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            self.samples += 1
            self._stop.wait(self.interval)

    def __enter__(self) -> RssSampler:
        gc.collect()
        self.baseline = self.peak = self.rss()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.rss())

    @property
    def above(self) -> int:
        return self.peak - self.baseline
