"""RLinf's ``runner.*`` config keys and its ``save_interval`` rule."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...errors import ConfigError
from .layout import checkpoints_root


def _plain(cfg: Any) -> dict[str, Any]:
    """A plain dict from a mapping or an OmegaConf/Hydra ``DictConfig`` (resolved)."""
    if cfg is None:
        return {}
    try:  # OmegaConf, without depending on it
        from omegaconf import OmegaConf

        if OmegaConf.is_config(cfg):
            return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
    except ImportError:
        pass
    if not isinstance(cfg, Mapping):
        raise ConfigError(f"expected a mapping for the RLinf config, got {type(cfg).__name__}")
    return dict(cfg)


@dataclass(frozen=True)
class RunnerConfig:
    """The ``runner.*`` keys RLinf's checkpointing reads."""

    output_dir: str
    experiment_name: str
    save_interval: int = -1
    resume_dir: str | None = None
    max_steps: int | None = None

    @classmethod
    def from_config(cls, cfg: Any) -> RunnerConfig:
        """From the whole Hydra config (with a ``runner`` section) or the section itself."""
        top = _plain(cfg)
        runner = _plain(top["runner"]) if "runner" in top else top
        missing = [k for k in ("output_dir", "experiment_name") if not runner.get(k)]
        if missing:
            raise ConfigError(f"the RLinf config lacks runner.{', runner.'.join(missing)}")
        resume = runner.get("resume_dir")
        max_steps = runner.get("max_steps")
        return cls(output_dir=str(runner["output_dir"]),
                   experiment_name=str(runner["experiment_name"]),
                   save_interval=int(-1 if runner.get("save_interval") is None
                                     else runner["save_interval"]),
                   resume_dir=None if resume is None else str(resume),
                   max_steps=None if max_steps in (None, -1) else int(max_steps))

    @property
    def root(self) -> str:
        return checkpoints_root(self.output_dir, self.experiment_name)


def should_save(step: int, save_interval: int, *, max_steps: int | None = None,
                time_limit_hit: bool = False) -> bool:
    """RLinf's rule, for ``step`` counted from 1 (the number of updates done).

    ``save_interval`` <= 0 disables saving entirely; otherwise save when
    ``step % save_interval == 0``, at ``max_steps``, or when the time limit is hit.
    """
    if save_interval <= 0:
        return False
    return step % save_interval == 0 or (max_steps is not None and step == max_steps) \
        or time_limit_hit
