"""How the command prints: sizes, times, plurals, progress bars."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from cloudckpt.util.text import plural  # noqa: F401 - the commands' plural is every message's


def size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def when(t: float | None) -> str:
    """Local time with its UTC offset, so times read alike anywhere."""
    return time.strftime("%Y-%m-%d %H:%M:%S %z", time.localtime(t)) if t else "-"


@contextmanager
def progress(total: int, desc: str) -> Iterator[Callable[[int], object]]:
    """A tqdm bar on a terminal (nothing when stderr is not a TTY), left showing its
    final count once the block ends. Print the block's results after it: a line
    printed while the bar is drawn lands on the bar's line."""
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
               disable=not sys.stderr.isatty())
    try:
        yield bar.update
    finally:
        bar.close()  # drawn once more with the real count, then a newline


def plural_prefix(n: int) -> str:
    return f"{n} prefix{'' if n == 1 else 'es'}"
