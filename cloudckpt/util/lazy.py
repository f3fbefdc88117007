"""Package attributes imported on first use, so that importing a package stays cheap
(``cloudckpt ls`` must not pay for torch, nor a framework plug-in's declaration for
the framework's code)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any


def lazy_exports(package: str, modules: Mapping[str, Iterable[str]]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package`` that imports each name of
    ``modules[module]`` from ``module`` (a submodule of ``package``, or a
    ``cloudckpt.`` path) when it is first asked for."""
    where = {name: module for module, names in modules.items() for name in names}

    def __getattr__(name: str) -> Any:
        if name in where:
            module = where[name]
            if not module.startswith("cloudckpt."):
                module = f"{package}.{module}"
            return getattr(importlib.import_module(module), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__


def load_target(target: str) -> Any:
    """The object a ``"module:name"`` string names (a plug-in's declaration), imported
    now; ``name`` may be dotted (``"module:Class.attr"``)."""
    module, sep, name = target.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"{target!r} is not a 'module:name' target")
    obj: Any = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj
