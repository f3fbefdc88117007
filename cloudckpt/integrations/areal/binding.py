"""What activation binds into AReaL: the ``Saver`` and ``RecoverHandler`` its trainer
modules build become cloudckpt's for a bucket ``fileroot``; for a local one they stay
AReaL's own. Their ``cycle_dataloader`` counts epochs from the resumed one after
cloudckpt's handler restored the dataloader (:mod:`.dataorder`), else as AReaL's own.
And ``parse_cli_args``, through which AReaL's ``load_expr_config`` and its launchers
compose every config, places a bucket ``cluster.fileroot`` (:mod:`.placement`): the
checkpoints in the bucket, AReaL's local files under a local directory named for it.
Nothing of AReaL's is edited: only those names in its modules are replaced."""

from __future__ import annotations

import functools
import importlib
import logging
from types import ModuleType
from typing import Any

from cloudckpt.integrations.areal.dataorder import cycle_from_resumed_epoch
from cloudckpt.integrations.areal.placement import place
from cloudckpt.integrations.areal.plugin import TRAINERS
from cloudckpt.storage import is_remote
from cloudckpt.util import logsetup
from cloudckpt.util.lazy import load_target

_OURS = {"Saver": "cloudckpt.integrations.areal.saver:Saver",
         "RecoverHandler": "cloudckpt.integrations.areal.resume:RecoverHandler"}


class ByFileroot:
    """Stands where a trainer module names one of AReaL's classes: called with a config
    whose ``fileroot`` is a bucket URI it builds cloudckpt's class, else AReaL's own;
    every attribute (the static path helpers) is AReaL's class's."""

    def __init__(self, own: type, ours: str) -> None:
        self.own = own
        self.ours = ours

    def __call__(self, config: Any, *args: Any, **kwargs: Any) -> Any:
        fileroot = getattr(config, "fileroot", None)
        cls = load_target(self.ours) if is_remote(fileroot) else self.own
        return cls(config, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.own, name)

    def __repr__(self) -> str:
        return f"<{self.own.__qualname__}: AReaL's for a local fileroot, {self.ours} for a bucket>"


def bind_trainers(package: ModuleType) -> tuple[str, ...]:
    """Replace ``Saver``, ``RecoverHandler`` and ``cycle_dataloader`` in each of AReaL's
    trainer modules."""
    bound = []
    for trainer in TRAINERS:
        module = importlib.import_module(f"{package.__name__}.{trainer}")
        for name, ours in _OURS.items():
            own = getattr(module, name)
            if not isinstance(own, ByFileroot):
                setattr(module, name, ByFileroot(own, ours))
            bound.append(f"{trainer}.{name}")
        own_cycle = getattr(module, "cycle_dataloader", None)  # the RL trainer has none
        if own_cycle is not None:
            if not hasattr(own_cycle, "__wrapped__"):
                module.cycle_dataloader = cycle_from_resumed_epoch(own_cycle)  # type: ignore[attr-defined]  # AReaL's
            bound.append(f"{trainer}.cycle_dataloader")
    return tuple(bound)


def _stderr_log() -> logging.Logger:
    """The logger of what the binding did with the config, with a handler of its own
    on stderr (as activation's "bound ..." line has): AReaL's ``getLogger`` replaces
    the logging module's root and manager, so a logger found by name later would have
    neither handler nor level."""
    return logsetup.on_stderr(logging.getLogger(__name__))


def placing(parse: Any) -> Any:
    """AReaL's ``parse_cli_args(argv) -> (config, config_file)``, its config placed
    (:func:`~cloudckpt.integrations.areal.placement.place`) before AReaL resolves it."""
    if hasattr(parse, "__wrapped__"):
        return parse

    @functools.wraps(parse)
    def parse_cli_args(argv: list[str]) -> Any:
        cfg, config_file = parse(argv)
        placed = place(cfg)
        moved = [p for p in placed if p.moved]
        if moved:
            _stderr_log().info(
                "cloudckpt: areal config %s: %s stay in the bucket; %s", config_file,
                ", ".join(f"{p.key}={p.lands}" for p in placed if p.in_bucket),
                ", ".join(f"{p.key} -> {p.lands}" for p in moved))
        return cfg, config_file

    return parse_cli_args


def bind_config(module: ModuleType) -> tuple[str, ...]:
    """Replace ``parse_cli_args`` in ``areal.api.cli_args`` (``load_expr_config`` calls
    it by its module-level name; the launchers import it after this binding)."""
    module.parse_cli_args = placing(module.parse_cli_args)  # type: ignore[attr-defined]  # AReaL's
    return ("parse_cli_args",)
