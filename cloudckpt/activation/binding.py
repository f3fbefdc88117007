"""Binding one framework: check that its code is what the integration was tested
with, let the integration bind its names, say so in one line."""

from __future__ import annotations

import hashlib
import inspect
import logging
import os
from importlib.metadata import PackageNotFoundError, version
from types import ModuleType

from cloudckpt.core.plugins import Binding, Framework
from cloudckpt.errors import UntestedVersionError
from cloudckpt.util.lazy import load_target

log = logging.getLogger("cloudckpt.activation")

#: Set to ``1`` to bind into framework versions the integration was not tested with.
ENV_ALLOW_UNTESTED = "CLOUDCKPT_ALLOW_UNTESTED"


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


def bind(fw: Framework, binding: Binding, module: ModuleType, *,
         allow_untested: bool | None = None) -> tuple[str, ...]:
    """Bind ``binding`` into ``module`` (once), after checking what it is."""
    done = module.__dict__.setdefault("__cloudckpt_bound__", set())
    if binding.bind in done:
        return ()
    found = identify(fw, binding, module)
    if allow_untested is None:
        allow_untested = os.environ.get(ENV_ALLOW_UNTESTED, "") not in ("", "0")
    what = f"{fw.distribution} {found}" if fw.distribution else f"{fw.name} (code {found})"
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
    log.info("cloudckpt: bound the %s integration into %s, pid %d: %s", fw.name, what,
             os.getpid(),
             ", ".join(f"{module.__name__}.{n}" for n in names))
    return tuple(names)
