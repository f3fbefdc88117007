"""What activation binds into AReaL: the ``Saver`` and ``RecoverHandler`` its trainer
modules build become cloudckpt's for a bucket ``fileroot``; for a local one they stay
AReaL's own. Their ``cycle_dataloader`` counts epochs from the resumed one after
cloudckpt's handler restored the dataloader (:mod:`.dataorder`), else as AReaL's own.
Nothing of AReaL's is edited: only those three names in each trainer module are
replaced."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from cloudckpt.integrations.areal.dataorder import cycle_from_resumed_epoch
from cloudckpt.integrations.areal.plugin import TRAINERS
from cloudckpt.storage import is_remote
from cloudckpt.util.lazy import load_target

_OURS = {"Saver": "cloudckpt.integrations.areal.saver:Saver",
         "RecoverHandler": "cloudckpt.integrations.areal.recover:RecoverHandler"}


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
                module.cycle_dataloader = cycle_from_resumed_epoch(own_cycle)
            bound.append(f"{trainer}.cycle_dataloader")
    return tuple(bound)
