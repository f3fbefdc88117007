"""cloudckpt's activation hook: ``cloudckpt run`` puts this directory first on
``PYTHONPATH``. It activates the integrations ``CLOUDCKPT_INTEGRATIONS`` names in this
process (each binds when its framework is imported), then runs the ``sitecustomize``
this file shadows, if there is one."""

import os
import sys


def _chain() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    ours = sys.modules.pop("sitecustomize", None)
    try:
        import sitecustomize  # noqa: F401 - the one this file shadows, if any
    except ModuleNotFoundError as exc:
        if exc.name != "sitecustomize":
            raise
        if ours is not None:
            sys.modules["sitecustomize"] = ours


def _activate() -> None:
    if not os.environ.get("CLOUDCKPT_INTEGRATIONS", "").strip():
        return
    try:
        from cloudckpt.activation import activate_from_environment
    except ImportError as exc:
        sys.stderr.write(f"WARNING cloudckpt: CLOUDCKPT_INTEGRATIONS is set, but {sys.executable} "
                         f"cannot import cloudckpt ({exc}): nothing is bound in this process "
                         f"(pid {os.getpid()})\n")
        return
    try:
        activate_from_environment()
    except Exception as exc:  # site.py would print it and go on: stop here instead
        sys.stderr.write(f"ERROR cloudckpt: activation failed in pid {os.getpid()}: {exc}\n")
        sys.stderr.flush()
        os._exit(2)  # during start-up, SystemExit is a "Fatal Python error" with exit 1


_activate()
_chain()
