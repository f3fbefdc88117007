"""RLinf's ``runner.*`` config keys and its ``save_interval`` rule."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cloudckpt.errors import ConfigError
from cloudckpt.integrations.rlinf.layout import checkpoints_root


def _plain(cfg: Any) -> dict[str, Any]:
    """A plain dict from a mapping or an OmegaConf/Hydra ``DictConfig`` (resolved)."""
    if cfg is None:
        return {}
    try:  # OmegaConf, without depending on it
        from omegaconf import OmegaConf

        if OmegaConf.is_config(cfg):
            return OmegaConf.to_container(cfg, resolve=True)
    except ImportError:
        pass
    if not isinstance(cfg, Mapping):
        raise ConfigError(f"expected a mapping for the RLinf config, got {type(cfg).__name__}")
    return dict(cfg)


@dataclass(frozen=True)
class RunnerConfig:
    """The ``runner.*`` keys RLinf's checkpointing reads.

    ``max_steps`` is RLinf's raw value: -1 (the default in most of RLinf's configs)
    means "``max_epochs`` epochs"; :meth:`total_steps` resolves it as RLinf does.
    """

    output_dir: str
    experiment_name: str
    save_interval: int = -1
    resume_dir: str | None = None
    max_steps: int = -1
    max_epochs: int | None = None

    @classmethod
    def from_config(cls, cfg: Any) -> RunnerConfig:
        """From the whole Hydra config (with a ``runner`` section) or the section itself."""
        top = _plain(cfg)
        runner = _plain(top["runner"]) if "runner" in top else top
        missing = [k for k in ("output_dir", "experiment_name") if not runner.get(k)]
        if missing:
            raise ConfigError(f"the RLinf config lacks runner.{', runner.'.join(missing)}")
        resume = runner.get("resume_dir")
        epochs = runner.get("max_epochs")
        return cls(output_dir=str(runner["output_dir"]),
                   experiment_name=str(runner["experiment_name"]),
                   save_interval=_int(runner, "save_interval", -1),
                   resume_dir=None if resume is None else str(resume),
                   max_steps=_int(runner, "max_steps", -1),
                   max_epochs=None if epochs is None else int(epochs))

    @property
    def root(self) -> str:
        return checkpoints_root(self.output_dir, self.experiment_name)

    def total_steps(self, steps_per_epoch: int | None) -> int | None:
        """The run's last step, as RLinf's runner computes it (``_set_max_steps``):
        ``steps_per_epoch * max_epochs``, capped by ``max_steps`` when that is >= 0.
        None when it cannot be known (``max_steps`` < 0 and no epochs or length)."""
        return total_steps(self.max_steps, self.max_epochs, steps_per_epoch)


def _int(section: Mapping[str, Any], key: str, default: int) -> int:
    value = section.get(key)
    return default if value is None else int(value)


def total_steps(max_steps: int | None, max_epochs: int | None,
                steps_per_epoch: int | None) -> int | None:
    """RLinf's ``max_steps``: ``len(train_dataloader) * max_epochs``, then
    ``min(that, max_steps)`` if ``max_steps >= 0``. Without the epoch count or the
    dataloader's length, ``max_steps`` itself when it is >= 0, else None."""
    cap = None if max_steps is None or max_steps < 0 else int(max_steps)
    if max_epochs is None or steps_per_epoch is None:
        return cap
    derived = int(steps_per_epoch) * int(max_epochs)
    return derived if cap is None else min(derived, cap)


def should_save(step: int, save_interval: int, *, max_steps: int | None = None,
                time_limit_hit: bool = False) -> bool:
    """RLinf's rule (``check_progress``), for ``step`` counted from 1 (the number of
    updates done).

    ``save_interval`` <= 0 disables saving entirely; otherwise save when
    ``step % save_interval == 0``, at ``max_steps`` (the resolved last step), or
    when the time limit is hit.
    """
    if save_interval <= 0:
        return False
    return step % save_interval == 0 or (max_steps is not None and step == max_steps) \
        or time_limit_hit
