"""What each save, drain and restore cost: one small :class:`Report`, logged at INFO
and handed to the user's callback (TensorBoard, W&B, a framework's stats logger).

Every rank counts its own requests (:func:`cloudckpt.storage.transfer.tally.counting`) and
time; rank 0 gathers them, so a report names the slowest rank. The figures known
before the commit (the ranks' write times and requests up to then) also go into the
checkpoint's manifest (:class:`Figures`, under ``metadata["report"]``), where
``cloudckpt info`` shows them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from cloudckpt.core.checkpoint import Checkpoint, CheckpointWriter
from cloudckpt.runtime import coordination as coord
from cloudckpt.storage import Store
from cloudckpt.storage.transfer.tally import Tally

log = logging.getLogger(__name__)

#: The manifest metadata key of the figures known at commit.
REPORT_KEY = "report"


@dataclass(frozen=True)
class Report:
    """One save, drain or restore, for the whole job (rank 0 makes it).

    ``blocked_s`` is how long the training loop waited; ``durable_s`` the time from
    the call until the checkpoint was committed in its tier (for a drain: from the
    local save's call until it is committed in the bucket). ``requests`` and
    ``retries`` add up every rank's.
    """

    op: str
    tier: str
    step: int | None
    uri: str
    bytes: int
    objects: int
    requests: int
    retries: int
    blocked_s: float
    durable_s: float
    slowest_rank: int
    slowest_s: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def line(self) -> str:
        return (f"{self.op} of step {self.step} ({self.tier}) {self.uri}: "
                f"{self.bytes / 1e6:.1f} MB in {self.objects} objects, "
                f"{self.requests} requests ({self.retries} retries); "
                + (f"took {self.durable_s:.2f} s; " if self.op == "restore" else
                   f"blocked {self.blocked_s:.2f} s, durable after {self.durable_s:.2f} s; ")
                + f"slowest rank {self.slowest_rank} ({self.slowest_s:.2f} s)")


@dataclass
class Timing:
    """When an operation began, and how long the training loop waited for it (once
    known: an async save's background part may end first)."""

    start: float = field(default_factory=time.monotonic)
    blocked: float | None = None


@dataclass(frozen=True)
class RankFigures:
    """One rank's share: seconds since the operation began, requests, retries, and the
    size of the checkpoint it stands for (none: counted by another rank)."""

    seconds: float
    requests: int
    retries: int
    bytes: int = 0
    objects: int = 0


def gather(start: float, tally: Tally, group: Any = None,
           ckpt: Checkpoint | None = None) -> list[RankFigures]:
    """Every rank's figures, on every rank (a collective)."""
    def mine() -> RankFigures:
        return RankFigures(time.monotonic() - start, tally.requests, tally.retries,
                           ckpt.total_size if ckpt else 0, len(ckpt.files) if ckpt else 0)

    return coord.each_rank(mine, group)


def summary(ranks: list[RankFigures]) -> dict[str, Any]:
    slowest = max(range(len(ranks)), key=lambda r: ranks[r].seconds)
    return {"slowest_rank": slowest, "slowest_s": round(ranks[slowest].seconds, 3),
            "requests": sum(r.requests for r in ranks),
            "retries": sum(r.retries for r in ranks)}


@dataclass
class Figures:
    """A :class:`~cloudckpt.training.multipart.Part`, last in a save: every rank's
    figures up to the commit, into the manifest's metadata."""

    start: float
    tally: Tally

    def write(self, store: Store, group: Any) -> list[RankFigures]:
        return gather(self.start, self.tally, group)

    def commit(self, writer: CheckpointWriter, written: list[RankFigures]) -> None:
        writer.metadata[REPORT_KEY] = summary(written)


def report(op: str, tier: str, step: int | None, uri: str, ranks: list[RankFigures], *,
           blocked_s: float, durable_s: float, group: Any = None) -> Report | None:
    """The report of an operation (on rank 0 of ``group``; None on other ranks)."""
    if coord.rank(group) != 0:
        return None
    s = summary(ranks)
    return Report(op, tier, step, uri, sum(r.bytes for r in ranks),
                  sum(r.objects for r in ranks), s["requests"], s["retries"],
                  round(blocked_s, 3), round(durable_s, 3), s["slowest_rank"], s["slowest_s"])


def deliver(rep: Report | None, callback: Callable[[Report], Any] | None) -> None:
    """Log the report at INFO and hand it to ``callback``, whose failure never fails
    the operation (a WARNING)."""
    if rep is None:
        return
    log.info("%s", rep.line())
    if callback is None:
        return
    try:
        callback(rep)
    except Exception as exc:  # noqa: BLE001 - a stats logger must not fail a save
        log.warning("the report callback failed (%s: %s); the %s itself is done",
                    type(exc).__name__, exc, rep.op)
