"""Activation carried into a Ray job's workers, wherever the cluster was started.

The start-up hook reaches the processes that inherit ``cloudckpt run``'s environment:
a Ray cluster the driver starts itself (``ray.init()``) is one. A cluster started on
its own (``ray start --head``, a KubeRay cluster) starts its workers from its raylets,
which never saw that environment. What does reach them is the job's ``runtime_env``,
so when activation is on and ``ray`` is imported, :func:`carry_into` wraps
``ray.init``: the job's ``runtime_env`` gets

- ``env_vars``: what activation reads (``CLOUDCKPT_INTEGRATIONS``,
  ``CLOUDCKPT_ALLOW_UNTESTED`` if set) and the attempt this launch is
  (:mod:`cloudckpt.runtime.attempt`), so a worker's save knows its run;
- ``worker_process_setup_hook``: :func:`setup_worker` by its module path, which Ray
  runs in each worker before its first task; it is imported from the worker's own
  installation of cloudckpt, never from a path on the driver's machine.

The user's ``runtime_env`` is merged, never replaced: their variables stay, their own
setup hook runs after :func:`setup_worker`; a variable of theirs that says otherwise
than activation is refused (:class:`~cloudckpt.errors.ConfigError`).
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

from cloudckpt.errors import ConfigError
from cloudckpt.runtime import attempt

log = logging.getLogger(__name__)

__all__ = ["SETUP_HOOK", "carried", "carry_into", "merged", "setup_worker"]

#: What the job's ``worker_process_setup_hook`` names: a module path, importable in
#: any worker with cloudckpt installed.
SETUP_HOOK = "cloudckpt.activation.ray.setup_worker"
#: Where Ray itself keeps an exported setup hook: a runtime_env that sets it has a
#: hook this module cannot run after its own.
_RAY_HOOK_VAR = "__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR"

_said = False  # one line per process, however often ray.init runs


def setup_worker() -> None:
    """Ray's setup hook in each of the job's workers: activate what the job's
    ``env_vars`` name (each integration binds when its framework is imported)."""
    from cloudckpt.activation import activate_from_environment

    activate_from_environment()


def carried(integrations: str, *, allow_untested: bool,
            environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The variables a job's workers need for this process's activation."""
    from cloudckpt.activation import ENV_ALLOW_UNTESTED, ENV_INTEGRATIONS

    env = {ENV_INTEGRATIONS: integrations}
    if allow_untested:
        env[ENV_ALLOW_UNTESTED] = "1"
    for name in attempt.CARRIED:
        if environ.get(name):
            env[name] = environ[name]
    return env


class _ThenTheirs:
    """The setup hook when the user's ``runtime_env`` has one too: activation first,
    so their hook may import a framework, then theirs (a callable or a module path).
    Ray names a hook by its ``__name__`` and ships it pickled: this class is imported
    by reference in the worker, as :data:`SETUP_HOOK` is."""

    def __init__(self, theirs: Callable[[], Any] | str) -> None:
        self.theirs = theirs
        self.__name__ = f"cloudckpt_then_{getattr(theirs, '__name__', theirs)}"

    def __call__(self) -> None:
        setup_worker()
        hook = self.theirs
        if isinstance(hook, str):
            module, _, name = hook.rpartition(".")
            hook = getattr(importlib.import_module(module), name)
        hook()


def merged(runtime_env: Mapping[str, Any] | None, env: Mapping[str, str]
           ) -> dict[str, Any]:
    """``runtime_env`` (the user's, or None) with ``env`` added to its ``env_vars`` and
    the setup hook set: a new dict, the user's own left as it was."""
    out = dict(runtime_env or {})
    theirs = dict(out.get("env_vars") or {})
    clash = {k: (theirs[k], v) for k, v in env.items() if k in theirs and theirs[k] != v}
    if clash:
        said = ", ".join(f"{k}={was!r} (activation: {want!r})" for k, (was, want) in clash.items())
        raise ConfigError(f"ray.init's runtime_env sets {said} in env_vars, which contradicts "
                          "this launch's activation: remove them from the runtime_env (`cloudckpt "
                          "run` carries them into the job's workers), or launch with the "
                          "--integration / --run-id / --allow-untested that says the same")
    if _RAY_HOOK_VAR in theirs:
        raise ConfigError(f"ray.init's runtime_env already holds Ray's exported setup hook "
                          f"({_RAY_HOOK_VAR}); cloudckpt cannot run its activation hook beside "
                          "it: pass the hook as runtime_env['worker_process_setup_hook'] "
                          "instead (it then runs after cloudckpt's)")
    out["env_vars"] = {**theirs, **env}
    hook = out.get("worker_process_setup_hook")
    out["worker_process_setup_hook"] = SETUP_HOOK if hook in (None, SETUP_HOOK) \
        else _ThenTheirs(hook)
    return out


def carry_into(ray: ModuleType, integrations: str, *, allow_untested: bool) -> None:
    """Wrap ``ray.init`` (module ``ray``, just imported) so that each job this process
    starts carries activation into its workers (see the module's docstring)."""
    init = ray.init
    if getattr(init, "__cloudckpt_carries__", False):
        return

    @functools.wraps(init)
    def init_carrying(*args: Any, **kwargs: Any) -> Any:
        job_config = kwargs.get("job_config")
        base = kwargs.get("runtime_env")
        if base is None and job_config is not None:  # ray.init prefers runtime_env=
            base = getattr(job_config, "runtime_env", None)
        env = carried(integrations, allow_untested=allow_untested)
        kwargs["runtime_env"] = merged(base, env)
        _say(env, kwargs["runtime_env"]["worker_process_setup_hook"])
        return init(*args, **kwargs)

    init_carrying.__cloudckpt_carries__ = True  # type: ignore[attr-defined]
    ray.init = init_carrying  # type: ignore[attr-defined]  # a module's attribute, replaced


def _say(env: Mapping[str, str], hook: object) -> None:
    global _said
    if _said:
        return
    _said = True
    name = hook if isinstance(hook, str) else f"{SETUP_HOOK}, then {getattr(hook, 'theirs', hook)}"
    log.info("cloudckpt: ray.init carries activation into the job's Ray workers, pid %d: "
             "runtime_env env_vars %s; worker_process_setup_hook %s", os.getpid(),
             ", ".join(f"{k}={v}" for k, v in env.items()), name)
