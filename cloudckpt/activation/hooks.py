"""Run code right after a module is imported: how activation binds into a framework's
module without importing the framework itself (most processes an activated launch
starts never import it, and must not pay for it)."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

Callback = Callable[[ModuleType], object]  # what it returns is not used

_lock = threading.Lock()
_waiting: dict[str, list[Callback]] = {}
_asking = threading.local()  # the names this thread is asking the other finders about


def when_imported(name: str, callback: Callback) -> None:
    """Call ``callback(module)`` once module ``name`` has been executed: now if it
    already is, else right after its import (an exception it raises fails that
    import). Each callback runs once."""
    with _lock:
        if name not in sys.modules:
            _install()
            _waiting.setdefault(name, []).append(callback)
            return
    callback(sys.modules[name])


class _Loader(importlib.abc.Loader):
    """The module's own loader, then the callbacks waiting for it."""

    def __init__(self, loader: importlib.abc.Loader, callbacks: list[Callback]) -> None:
        self.loader = loader
        self.callbacks = callbacks

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        # The module sees its own loader (inspect.getsource, resources), never this one.
        module.__loader__ = self.loader
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        for callback in self.callbacks:
            callback(module)


class _Finder(importlib.abc.MetaPathFinder):
    """First on ``sys.meta_path``: finds nothing itself; for a module someone waits
    for, asks the finders after it and wraps the loader they return."""

    def find_spec(self, name: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        asking = _asking.__dict__.setdefault("names", set())
        if name not in _waiting or name in asking:
            return None
        asking.add(name)
        try:  # a finder that asks importlib again does not come back here
            spec = None
            for finder in sys.meta_path:
                if finder is not self and hasattr(finder, "find_spec"):
                    spec = finder.find_spec(name, path, target)
                    if spec is not None:
                        break
        finally:
            asking.discard(name)
        if spec is None:
            return None
        with _lock:
            callbacks = _waiting.pop(name, [])
        if spec.loader is None or not hasattr(spec.loader, "exec_module") or not callbacks:
            with _lock:  # a namespace package, or raced: wait for the next import
                _waiting.setdefault(name, []).extend(callbacks)
            return spec
        spec.loader = _Loader(spec.loader, callbacks)
        return spec


_finder: Any = None


def _install() -> None:
    global _finder
    if _finder is None:
        _finder = _Finder()
        sys.meta_path.insert(0, _finder)
