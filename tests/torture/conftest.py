"""The torture suite: crash, fault, concurrency and security trials.

Every test here runs in the regular test run at a small scale, and at full
scale under ``make torture`` (``CLOUDCKPT_TORTURE=full``). Tests record what
they did with :func:`record` and count per-trial failures instead of stopping
at the first one, so the summary table printed at the end of the run gives
honest figures (trials, faults injected, failures); each test then asserts
that its failures are zero. With ``CLOUDCKPT_TORTURE_REPORT=path`` the table
is also written there as JSON (``docs/reliability.md`` quotes it).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import pytest
from knobs import FULL, start_forkserver


@dataclass
class Row:
    """One line of the summary table."""

    area: str
    case: str
    trials: int
    faults: int = 0
    failures: int = 0
    seconds: float = 0.0
    detail: dict[str, Any] = field(default_factory=dict)


_ROWS: list[Row] = []


PRELOAD = ["crash_worker", "race_worker", "cloudckpt.storage.backends.s3",
           "cloudckpt.storage.backends.gcs",
           "cloudckpt.storage.backends.azure", "cloudckpt.storage.backends.file",
           "torch.distributed.checkpoint"]


@pytest.fixture(scope="session")
def forks() -> Any:
    """A multiprocessing context whose processes fork from a server that imported
    torch and cloudckpt once: a worker starts in milliseconds, not seconds."""
    here = os.path.dirname(__file__)
    return start_forkserver(PRELOAD, [here, os.path.dirname(here)])


@pytest.fixture
def record() -> Callable[..., Row]:
    """``record(area, case, trials, faults=0, failures=0, **detail)`` adds a row.

    The row's time is measured from the start of the test to the call.
    """
    t0 = time.monotonic()

    def add(area: str, case: str, trials: int, faults: int = 0, failures: int = 0,
            **detail: Any) -> Row:
        row = Row(area, case, trials, faults, failures, round(time.monotonic() - t0, 1),
                  detail)
        _ROWS.append(row)
        return row

    return add


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _ROWS:
        return
    tr = terminalreporter
    tr.section(f"cloudckpt torture summary ({'full' if FULL else 'fast'} scale)")
    head = f"{'area':<12} {'case':<44} {'trials':>7} {'faults':>7} {'failures':>8} {'s':>7}"
    tr.write_line(head)
    tr.write_line("-" * len(head))
    for r in _ROWS:
        tr.write_line(f"{r.area:<12} {r.case[:44]:<44} {r.trials:>7} {r.faults:>7} "
                      f"{r.failures:>8} {r.seconds:>7.1f}")
    tr.write_line("-" * len(head))
    tr.write_line(f"{'total':<12} {'':<44} {sum(r.trials for r in _ROWS):>7} "
                  f"{sum(r.faults for r in _ROWS):>7} {sum(r.failures for r in _ROWS):>8}")
    path = os.environ.get("CLOUDCKPT_TORTURE_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump({"scale": "full" if FULL else "fast", "rows": [asdict(r) for r in _ROWS]},
                      f, indent=1)
