"""Binding one framework: check that its code is what the integration was tested
with, let the integration bind its names, say so in one line per process."""

from __future__ import annotations

import hashlib
import inspect
import logging
import os
import sys
from importlib.metadata import PackageNotFoundError, version
from types import ModuleType

from cloudckpt.core.plugins import Binding, Framework
from cloudckpt.errors import UntestedVersionError
from cloudckpt.util.lazy import load_target

log = logging.getLogger(__name__)

#: Set to ``1`` to bind into framework versions the integration was not tested with.
ENV_ALLOW_UNTESTED = "CLOUDCKPT_ALLOW_UNTESTED"

_announced: set[tuple[str, int]] = set()  # (framework, pid): its INFO line was logged


def fingerprint(module: ModuleType, names: tuple[str, ...]) -> str:
    """A short digest of the source of ``names`` in ``module``: what identifies a
    framework's code where no version can be read."""
    digest = hashlib.sha256()
    for name in names:
        obj: object = module
        for part in name.split("."):
            obj = getattr(obj, part)
        digest.update(name.encode() + b"\0" + inspect.getsource(obj).encode() + b"\0")  # type: ignore[arg-type]
    return "sha256:" + digest.hexdigest()[:16]


def identify(fw: Framework, binding: Binding, module: ModuleType) -> str:
    """The framework's version (of its distribution) or its code's fingerprint."""
    if fw.distribution is not None:
        try:
            return version(fw.distribution)
        except PackageNotFoundError:
            pass
    if binding.fingerprint:
        return fingerprint(module, binding.fingerprint)
    return "unknown"


def describe(fw: Framework, found: str) -> str:
    """What the log lines call the framework: its distribution and version, or its
    code's fingerprint (``found``: :func:`identify`'s answer)."""
    return f"{fw.distribution} {found}" if fw.distribution else f"{fw.name} (code {found})"


def bind(fw: Framework, binding: Binding, module: ModuleType, *,
         allow_untested: bool | None = None, say: bool = True) -> tuple[str, ...]:
    """Bind ``binding`` into ``module`` (once), after checking what it is; ``say``:
    :func:`announce` it (the caller announces a batch itself)."""
    done = module.__dict__.setdefault("__cloudckpt_bound__", set())
    if binding.bind in done:
        return ()
    found = identify(fw, binding, module)
    if allow_untested is None:
        allow_untested = os.environ.get(ENV_ALLOW_UNTESTED, "") not in ("", "0")
    what = describe(fw, found)
    if found not in fw.tested:
        tested = ", ".join(fw.tested) or "none"
        if not allow_untested:
            raise UntestedVersionError(
                f"cloudckpt's {fw.name} integration was not tested with {what} "
                f"(module {module.__name__}; tested: {tested}), so it binds nothing into "
                f"it. Install a tested version, or set {ENV_ALLOW_UNTESTED}=1 (`cloudckpt "
                "run --allow-untested`) to bind anyway")
        log.warning("cloudckpt: binding %s into %s, which it was not tested with "
                    "(tested: %s; %s is set)", fw.name, what, tested, ENV_ALLOW_UNTESTED)
    names = load_target(binding.bind)(module)
    done.add(binding.bind)
    if say:
        announce(fw, what, [f"{module.__name__}.{n}" for n in names])
    return tuple(names)


def announce(fw: Framework, what: str, bound: list[str]) -> None:
    """The process's one INFO line for ``fw``: what its first binding bound, and the
    modules whose bindings wait for their import; later bindings say theirs at DEBUG
    (a worker that imports five of a framework's modules logs one line, not five)."""
    key = (fw.name, os.getpid())  # a forked child that binds more is a new process
    if key in _announced:
        log.debug("cloudckpt: also bound %s, pid %d: %s", fw.name, os.getpid(),
                  ", ".join(bound))
        return
    _announced.add(key)
    waiting = [b.module for b in fw.bindings if not _is_bound(b)]
    log.info("cloudckpt: bound the %s integration into %s, pid %d: %s%s", fw.name, what,
             os.getpid(), ", ".join(bound),
             f"; binds into {', '.join(waiting)} at their import" if waiting else "")


def _is_bound(binding: Binding) -> bool:
    module = sys.modules.get(binding.module)
    return module is not None and binding.bind in module.__dict__.get("__cloudckpt_bound__", ())
