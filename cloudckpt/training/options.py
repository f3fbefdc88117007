"""ManagerOptions: how a :class:`~cloudckpt.training.manager.CheckpointManager` behaves."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cloudckpt.errors import ConfigError
from cloudckpt.runtime.preemption import Preemption
from cloudckpt.training.reports import Report
from cloudckpt.training.tiers import LocalTier


@dataclass(frozen=True)
class ManagerOptions:
    """How a :class:`CheckpointManager` behaves.

    Save when any of ``every_steps``/``every_epochs``/``every_seconds`` fires;
    keep the newest ``keep_last`` checkpoints (None: all) plus every one whose
    step is a multiple of ``keep_every``; ``async_save`` blocks only for staging
    at most ``staging_budget`` bytes of tensors in host memory (None: a quarter of
    the host's memory per local rank) and for uploading what does not fit.
    ``local`` puts a node-local tier in front of the bucket (:class:`LocalTier`):
    its saves run on their own schedule, and some of them drain to the bucket.
    ``preemption`` (:class:`Preemption`) saves once to the bucket when the job is
    told to end (SIGTERM), within a time budget (see :mod:`cloudckpt.runtime.preemption`).
    Every save, drain and restore is reported (:class:`Report`, logged at INFO on rank
    0), and handed to ``on_report`` there. ``incremental`` stores each save's objects
    in the root's blob area by their content: what did not change since an earlier
    save (a frozen base model) is referenced, not sent again (:mod:`cloudckpt.core.blobs`).
    """

    every_steps: int | None = None
    every_epochs: int | None = None
    every_seconds: float | None = None
    keep_last: int | None = None
    keep_every: int | None = None
    async_save: bool = False
    staging_budget: int | None = None
    name_format: str = "step-{step}"
    strict: bool = False
    local: LocalTier | None = None
    preemption: Preemption | None = None
    on_report: Callable[[Report], Any] | None = None
    incremental: bool = False

    def __post_init__(self) -> None:
        if self.staging_budget is not None and self.staging_budget < 0:
            raise ConfigError(f"ManagerOptions.staging_budget must be >= 0 bytes or None, "
                              f"got {self.staging_budget}")
        for name in ("every_steps", "every_epochs", "every_seconds", "keep_last", "keep_every"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"ManagerOptions.{name} must be positive or None, got {value}")
        if "{step}" not in self.name_format:
            raise ConfigError("ManagerOptions.name_format must contain '{step}'")
