"""AReaL's ``saver:`` and ``recover:`` config sections, and what AReaL derives from them
(whether recover runs, steps per epoch); where their files go is :mod:`.layout`."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from cloudckpt.errors import ConfigError

_SAVER_MODES = ("auto", "sync", "async")
_RECOVER_MODES = ("on", "auto", "off", "disabled")

# -------------------------------------------------------------------------- config


def _check_freq(cls: str, name: str, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{cls}.{name} must be a positive integer or null, got {value!r}")


def _check_str(cls: str, name: str, value: Any, *, required: bool = True) -> None:
    if value is None and not required:
        return
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{cls}.{name} must be a non-empty string, got {value!r}")


def _from_dict(cls: type, data: Mapping[str, Any]) -> Any:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{cls.__name__} needs a mapping, got {type(data).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"unknown {cls.__name__} key(s) {unknown}; known keys: "
                          f"{sorted(known)}")
    try:
        return cls(**dict(data))
    except TypeError as exc:  # a required key is missing
        raise ConfigError(f"{cls.__name__}: {exc}") from None


@dataclass
class _Section:
    """What AReaL's ``saver:`` and ``recover:`` sections share: where, and how often."""

    experiment_name: str
    trial_name: str
    fileroot: str = "/tmp/areal/"
    freq_epochs: int | None = None
    freq_steps: int | None = None
    freq_secs: int | None = None
    MODES: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        _validate_common(self)
        mode = getattr(self, "mode", None)
        if mode not in self.MODES:
            hint = (f" (YAML reads a bare on/off as a boolean, as AReaL's loader does: "
                    f"quote it, mode: \"{'on' if mode else 'off'}\")"
                    if isinstance(mode, bool) else "")
            raise ConfigError(f"{type(self).__name__}.mode must be one of "
                              f"{list(self.MODES)}, got {mode!r}{hint}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Any:
        """Build from a YAML/dict section; unknown keys and bad values raise ConfigError."""
        return _from_dict(cls, data)


@dataclass
class SaverConfig(_Section):
    """AReaL's ``saver:`` section. ``fileroot`` may be a bucket URI; ``user`` (not an
    AReaL key) overrides the ``getpass.getuser()`` path part."""

    mode: str = "auto"
    user: str | None = None
    MODES: ClassVar[tuple[str, ...]] = _SAVER_MODES


@dataclass
class RecoverConfig(_Section):
    """AReaL's ``recover:`` section. ``retries`` is how many times the launcher
    (:func:`run_with_retries`) relaunches a failed job."""

    mode: str = "disabled"
    retries: int = 3
    no_save_optim: bool = False
    no_load_optim: bool = False
    user: str | None = None
    MODES: ClassVar[tuple[str, ...]] = _RECOVER_MODES

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.retries, bool) or not isinstance(self.retries, int) \
                or self.retries < 0:
            raise ConfigError(f"RecoverConfig.retries must be an integer >= 0, "
                              f"got {self.retries!r}")
        for key in ("no_save_optim", "no_load_optim"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"RecoverConfig.{key} must be true or false, "
                                  f"got {getattr(self, key)!r}")

    @property
    def enabled(self) -> bool:
        return recover_enabled(self)


def _validate_common(cfg: _Section) -> None:
    name = type(cfg).__name__
    for key in ("experiment_name", "trial_name", "fileroot"):
        _check_str(name, key, getattr(cfg, key))
    _check_str(name, "user", cfg.user, required=False)  # type: ignore[attr-defined]  # each section has one
    for key in ("experiment_name", "trial_name", "user"):
        value = getattr(cfg, key)
        if value is not None and ("/" in value or value in (".", "..")):
            raise ConfigError(f"{name}.{key} is a path part and cannot be {value!r}")
    for key in ("freq_epochs", "freq_steps", "freq_secs"):
        _check_freq(name, key, getattr(cfg, key))


# ------------------------------------------------------------------------- helpers


def recover_enabled(cfg: Any) -> bool:
    """AReaL's rule: recover runs in modes ``on`` and ``auto``."""
    return cfg.mode in ("on", "auto")


def areal_class(module: str, name: str, fallback: type) -> type:
    """AReaL's class ``module.name`` when AReaL is in use (already imported; its
    engines may check types), else ``fallback``, this package's same-shaped one."""
    return getattr(sys.modules.get(module), name, fallback)


def steps_per_epoch(ft_spec: Any) -> int:
    """AReaL's ``FinetuneSpec`` (or anything with ``steps_per_epoch``), or an int."""
    n = ft_spec if isinstance(ft_spec, int) else getattr(ft_spec, "steps_per_epoch", None)
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ConfigError(f"need AReaL's FinetuneSpec or a number of steps per epoch >= 0, "
                          f"got {ft_spec!r}")
    return n
