"""Activation: bind the integrations into the frameworks' own modules, only when the
user asks, so that a framework's unchanged trainer saves to a bucket.

Asked for in one of three ways, all the same mechanism:

- ``cloudckpt run [--integration NAME] -- <launch command>`` runs the command with
  this package's hook directory first on ``PYTHONPATH`` and ``CLOUDCKPT_INTEGRATIONS``
  set, so the hook (a ``sitecustomize`` that then runs any ``sitecustomize`` it
  shadows) activates in that process and every Python process it starts (torchrun's
  workers, a local Ray's workers);
- the same two variables set by the cluster (``cloudckpt run --print-env`` prints them),
  for workers started elsewhere (a Ray cluster's need none: :mod:`.ray` carries
  activation in each job's ``runtime_env``);
- :func:`activate` from the user's own code.

Each integration declares what it binds (:class:`~cloudckpt.core.plugins.Binding`);
a binding runs when the framework's module is imported, checks the framework's
version (or, without one, its code's fingerprint) against the tested ones; each
process logs one INFO line per framework naming what it bound and what waits for its
module's import. ``import cloudckpt`` alone binds nothing.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterable, Mapping
from functools import partial
from pathlib import Path

from cloudckpt.activation.binding import (
    ENV_ALLOW_UNTESTED,
    announce,
    bind,
    describe,
    fingerprint,
    identify,
)
from cloudckpt.activation.hooks import when_imported
from cloudckpt.core.plugins import Framework, frameworks
from cloudckpt.errors import ConfigError
from cloudckpt.util import logsetup

#: Comma-separated integration names to activate, or ``auto`` for every one.
ENV_INTEGRATIONS = "CLOUDCKPT_INTEGRATIONS"
AUTO = "auto"

log = logging.getLogger(__name__)
_from_environment: dict[str, list[str]] = {}  # what this process activated from it

__all__ = ["AUTO", "ENV_ALLOW_UNTESTED", "ENV_INTEGRATIONS", "activate",
           "activate_from_environment", "environment", "fingerprint", "hook_directory",
           "identify"]


def hook_directory() -> str:
    """The directory whose ``sitecustomize`` activates what ``CLOUDCKPT_INTEGRATIONS``
    names: put it first on ``PYTHONPATH``."""
    return str(Path(__file__).resolve().parent / "site")


def choose(names: Iterable[str] | str | None) -> list[Framework]:
    """The frameworks ``names`` means (``None``/``auto``: every one with bindings)."""
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    known = {f.name: f for f in frameworks() if f.bindings}
    wanted = list(names or [AUTO])
    if AUTO in wanted:
        return list(known.values())
    unknown = [n for n in wanted if n not in known]
    if unknown:
        raise ConfigError(f"no integration named {', '.join(unknown)} can be activated "
                          f"(known: {', '.join(known) or 'none'}, or {AUTO})")
    return [known[n] for n in dict.fromkeys(wanted)]


def activate(names: Iterable[str] | str | None = None, *,
             allow_untested: bool | None = None) -> list[str]:
    """Bind the integrations ``names`` (default: every one) into their frameworks'
    modules, now for those already imported, else right after their import. Returns
    the names activated. ``allow_untested`` (default: ``$CLOUDCKPT_ALLOW_UNTESTED``)
    binds into versions the integration was not tested with, with a warning."""
    if names is not None and not isinstance(names, str):
        names = list(names)
    chosen = choose(names)
    for fw in chosen:
        _bind_imported(fw, allow_untested)
        for binding in fw.bindings:
            when_imported(binding.module,
                          partial(bind, fw, binding, allow_untested=allow_untested))
    _carry_into_ray(names, chosen, allow_untested)
    return [fw.name for fw in chosen]


def _bind_imported(fw: Framework, allow_untested: bool | None) -> None:
    """Bind now into the framework's modules already imported, said in one line."""
    now = [(b, sys.modules[b.module]) for b in fw.bindings if b.module in sys.modules]
    bound = [f"{module.__name__}.{name}" for b, module in now
             for name in bind(fw, b, module, allow_untested=allow_untested, say=False)]
    if bound:
        announce(fw, describe(fw, identify(fw, *now[0])), bound)


def _carry_into_ray(names: Iterable[str] | str | None, chosen: list[Framework],
                    allow_untested: bool | None) -> None:
    """Once ``ray`` is imported, each job's workers activate the same (``.ray``), on
    whatever cluster they run."""
    from cloudckpt.activation import ray as carry

    auto = names is None or names == AUTO or (not isinstance(names, str) and AUTO in names)
    if allow_untested is None:
        allow_untested = os.environ.get(ENV_ALLOW_UNTESTED, "") not in ("", "0")
    when_imported("ray", partial(carry.carry_into,
                                 integrations=AUTO if auto else ",".join(f.name for f in chosen),
                                 allow_untested=allow_untested))


def activate_from_environment(environ: Mapping[str, str] = os.environ) -> list[str]:
    """What the hook runs: :func:`activate` the names in ``CLOUDCKPT_INTEGRATIONS``
    (nothing when it is unset), with the binding lines shown on stderr."""
    names = environ.get(ENV_INTEGRATIONS, "").strip()
    if not names:
        return []
    if names in _from_environment:  # the start-up hook, then Ray's setup hook
        return _from_environment[names]
    logsetup.on_stderr(log)
    _from_environment[names] = activate(names)
    return _from_environment[names]


def environment(names: Iterable[str] | str | None = None, *, allow_untested: bool = False,
                environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The variables that activate ``names`` in a process and every Python process it
    starts: the hook directory first on ``PYTHONPATH``, ``CLOUDCKPT_INTEGRATIONS``."""
    chosen = AUTO if names in (None, AUTO) else ",".join(fw.name for fw in choose(names))
    path = [hook_directory(), *(p for p in environ.get("PYTHONPATH", "").split(os.pathsep)
                                if p and p != hook_directory())]
    env = {"PYTHONPATH": os.pathsep.join(path), ENV_INTEGRATIONS: chosen}
    if allow_untested:
        env[ENV_ALLOW_UNTESTED] = "1"
    return env
