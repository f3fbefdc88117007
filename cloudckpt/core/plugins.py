"""What the core must know of a framework, declared by the framework itself.

Each integration declares one :class:`Framework` (plain data: importing it loads no
torch and no framework code) and names it in the ``cloudckpt.frameworks`` entry-point
group; the core asks :func:`frameworks`, never an integration's module. A new
framework is one package under ``cloudckpt/integrations/`` and one entry point.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib.metadata import entry_points

log = logging.getLogger(__name__)

GROUP = "cloudckpt.frameworks"


@dataclass(frozen=True)
class Binding:
    """Names cloudckpt binds into one of the framework's modules, only when the user
    activates the integration (``cloudckpt run``, ``CLOUDCKPT_INTEGRATIONS``)."""

    #: The framework's module; bound right after it is imported (or at once if it is).
    module: str
    #: ``"module:function"``: ``function(module)`` binds cloudckpt into the framework's
    #: module and returns the names it bound there.
    bind: str
    #: Names in :attr:`module` (``"Class.method"`` too) whose source identifies the
    #: framework's code where it has no version to read (a source tree).
    fingerprint: tuple[str, ...] = ()


@dataclass(frozen=True)
class Framework:
    """One framework's declaration."""

    #: Its name: the ``cloudckpt <name> ...`` subcommand.
    name: str
    #: One line for ``cloudckpt --help``.
    summary: str = ""
    #: The manifest kinds its checkpoints carry.
    kinds: tuple[str, ...] = ()
    #: Top-level sub-prefixes of one of its saves that hold that save's own committed
    #: parts (a claimed prefix with checkpoints only there is one save, not a root).
    part_dirs: tuple[str, ...] = ()
    #: Sub-prefixes of its bookkeeping objects: reserved names, and proof that a
    #: prefix holding them is a save of cloudckpt's.
    marker_dirs: tuple[str, ...] = ()
    #: ``{manifest kind: (DCP part inside such a checkpoint, its model keys' prefix)}``,
    #: for converting a model out of one of its checkpoints.
    dcp_layouts: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    #: ``{manifest kind: sub-prefix}``: where one of its checkpoints of that kind holds an
    #: HF export (committed on its own), for ``push`` to point at.
    exports: Mapping[str, str] = field(default_factory=dict)
    #: The framework setting that makes its saves hold that export, for ``push`` to name.
    export_setting: str | None = None
    #: ``"module:function"``: ``function(parser)`` adds its ``cloudckpt <name>``
    #: subcommands to an ``argparse`` parser (with :func:`cloudckpt.util.cliargs.subcommands`
    #: and ``add_command``); imported only when that command runs.
    commands: str | None = None
    #: What activation binds (see :class:`Binding`); nothing is bound otherwise.
    bindings: tuple[Binding, ...] = ()
    #: The installed distribution whose version activation checks, if it has one.
    distribution: str | None = None
    #: The versions of :attr:`distribution` the bindings were tested with; without a
    #: distribution, the tested fingerprints of the bindings' code.
    tested: tuple[str, ...] = ()
    #: ``"module:function"``: ``function(command)`` reads a launch command (argv, or a
    #: config file's path alone) and returns a :class:`~cloudckpt.core.launchplan.
    #: LaunchPlan` of the paths it uses, or None when the command is not this
    #: framework's (``cloudckpt doctor``, ``cloudckpt run --check``). Imported only
    #: when asked.
    doctor: str | None = None


_lock = threading.Lock()
_registered: dict[str, Framework] = {}
_loaded = False


def register(framework: Framework) -> None:
    """Add (or replace) a framework: what an entry point does, for code that has none."""
    with _lock:
        _registered[framework.name] = framework


def _load_entry_points() -> None:
    global _loaded
    with _lock:
        if _loaded:
            return
        _loaded = True
    for ep in entry_points(group=GROUP):
        try:
            fw = ep.load()
        except Exception as exc:  # a broken plug-in must not break every command
            log.warning("cloudckpt: the framework plug-in %s (%s) failed to load: %s",
                        ep.name, ep.value, exc)
            continue
        if not isinstance(fw, Framework):
            log.warning("cloudckpt: the framework plug-in %s (%s) is not a Framework",
                        ep.name, ep.value)
            continue
        with _lock:
            _registered.setdefault(fw.name, fw)


def frameworks() -> tuple[Framework, ...]:
    """Every registered framework, in name order."""
    _load_entry_points()
    with _lock:
        return tuple(_registered[n] for n in sorted(_registered))


def part_dirs() -> frozenset[str]:
    """Every framework's :attr:`Framework.part_dirs`."""
    return frozenset(d for f in frameworks() for d in f.part_dirs)


def marker_dirs() -> tuple[str, ...]:
    """Every framework's :attr:`Framework.marker_dirs`."""
    return tuple(d for f in frameworks() for d in f.marker_dirs)


def dcp_layouts() -> dict[str, tuple[str, str]]:
    """Every framework's :attr:`Framework.dcp_layouts`."""
    return {k: v for f in frameworks() for k, v in f.dcp_layouts.items()}


def export_of(kind: str) -> tuple[str, str | None] | None:
    """Where a checkpoint of ``kind`` holds an HF export, and the setting that makes it
    (:attr:`Framework.exports`, :attr:`Framework.export_setting`); None if no framework
    says."""
    for f in frameworks():
        if kind in f.exports:
            return f.exports[kind], f.export_setting
    return None


def kinds() -> dict[str, str]:
    """``{manifest kind: framework name}`` over every framework."""
    return {k: f.name for f in frameworks() for k in f.kinds}
