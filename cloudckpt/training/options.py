"""ManagerOptions: how a :class:`~cloudckpt.training.manager.CheckpointManager` behaves."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cloudckpt.core.profiles import FULL, check_name
from cloudckpt.errors import ConfigError
from cloudckpt.runtime.preemption import Preemption
from cloudckpt.training.reports import Report
from cloudckpt.training.snapshot import Selection, is_lora
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

    Save profiles (:mod:`cloudckpt.core.profiles`): the saves of the schedule above are
    of ``profile`` (``"full"``: everything a resume needs; ``"weights"``: the model
    only; ``"adapters"``: its trainable parameters only), a ``save(..., profile=)``
    overriding it; ``weights_every_steps`` adds ``weights`` saves on a schedule of
    their own. The entries of the state that hold the model are ``model_keys``
    (every other entry is optimizer or other state); an ``adapters`` save of a
    mapping of tensors keeps the names ``adapter_filter`` takes (see
    :class:`~cloudckpt.training.snapshot.Selection`). A partial save is named by
    :meth:`name_of` (``weights-step-100``), so retention keeps ``keep_last`` of each
    profile, and a resume tells them apart from the full ones by name. Preemption saves
    and the local tier's are always ``full``.
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
    profile: str = FULL
    weights_every_steps: int | None = None
    model_keys: tuple[str, ...] = ("model",)
    adapter_filter: Callable[[str], bool] = is_lora

    def __post_init__(self) -> None:
        check_name(self.profile)
        if isinstance(self.model_keys, str) or not self.model_keys or not all(
                isinstance(k, str) for k in self.model_keys):
            raise ConfigError(f"ManagerOptions.model_keys must be a non-empty tuple of the "
                              f"state's entry names, e.g. ('model',); got {self.model_keys!r}")
        if self.staging_budget is not None and self.staging_budget < 0:
            raise ConfigError(f"ManagerOptions.staging_budget must be >= 0 bytes or None, "
                              f"got {self.staging_budget}")
        for name in ("every_steps", "every_epochs", "every_seconds", "keep_last", "keep_every",
                     "weights_every_steps"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"ManagerOptions.{name} must be positive or None, got {value}")
        if "{step}" not in self.name_format:
            raise ConfigError("ManagerOptions.name_format must contain '{step}'")

    @property
    def selection(self) -> Selection:
        """Which entries of the state a partial save keeps."""
        return Selection(tuple(self.model_keys), self.adapter_filter)

    def name_format_of(self, profile: str) -> str:
        """The names of ``profile``'s saves: ``name_format`` for ``full``; for the
        others, the profile's name before it (``weights-step-{step}``)."""
        return self.name_format if check_name(profile) == FULL else f"{profile}-{self.name_format}"

    def name_of(self, profile: str, step: int) -> str:
        """The name of the save of ``step`` with ``profile``."""
        return self.name_format_of(profile).format(step=step)
