"""A config composed with hydra as a framework's launcher composes it, for a doctor that
reads a launch before it runs: hydra imported only when asked (reading a launch must not
pull in a framework's stack), its global state cleared first, its warnings about the
framework's own config style kept off the user's screen, and each failure a
:class:`ConfigError` that says which launch needed what."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from cloudckpt.errors import ConfigError

if TYPE_CHECKING:
    from omegaconf import DictConfig

__all__ = ["compose"]


def compose(config_dir: str | Path, config_name: str | None, overrides: Sequence[str] = (),
            *, needed_by: str, version_base: str | None, job_name: str = "app",
            return_hydra_config: bool = False) -> DictConfig:
    """``config_name`` of the absolute ``config_dir`` with ``overrides``, as hydra's
    ``initialize_config_dir(job_name, version_base)`` and ``compose`` give it.

    ``needed_by`` names the reading in the errors ("reading an RLinf launch"): hydra
    missing, or any failure to compose (a missing config, a bad override), raises
    :class:`ConfigError` naming it, the config and what to do."""
    try:
        from hydra import compose as hydra_compose
        from hydra import initialize_config_dir
        from hydra.core.global_hydra import GlobalHydra
    except ImportError as exc:
        raise ConfigError(f"{needed_by} needs hydra-core ({exc}): pip install "
                          "hydra-core") from None
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    try:  # frameworks' configs draw hydra's warnings (a defaults list without _self_)
        with warnings.catch_warnings(), initialize_config_dir(
                config_dir=str(config_dir), job_name=job_name, version_base=version_base):
            warnings.simplefilter("ignore", UserWarning)
            return hydra_compose(config_name=config_name, overrides=list(overrides),
                                 return_hydra_config=return_hydra_config)
    except Exception as exc:  # hydra's and omegaconf's errors have no common base
        with_overrides = f" with overrides {list(overrides)}" if overrides else ""
        raise ConfigError(
            f"{needed_by}: hydra could not compose the config {config_name or '(none named)'}"
            f" in {config_dir}{with_overrides} ({type(exc).__name__}: {exc}); fix the file "
            "or the override it names") from exc
