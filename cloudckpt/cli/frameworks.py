"""The frameworks' commands: ``cloudckpt NAME COMMAND ...``, one ``NAME`` per framework
that :func:`cloudckpt.core.plugins.frameworks` declares with ``commands``.

This module names no framework. A framework's ``commands`` module is imported, and
its ``add_commands(parser)`` called, only when its name is the command on the command
line: ``cloudckpt ls`` or ``cloudckpt --help`` load no framework code (nor torch).
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from cloudckpt.compat.argparse_private import SubParsersAction
from cloudckpt.core.plugins import Framework, frameworks
from cloudckpt.util.cliargs import COMMAND, common_options
from cloudckpt.util.lazy import load_target

log = logging.getLogger(__name__)


class LazySubcommands(SubParsersAction):
    """Subcommands some of whose arguments are added only once argparse picks them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pending: dict[str, Callable[[], None]] = {}

    def defer(self, name: str, fill: Callable[[], None]) -> None:
        """Call ``fill`` (which adds the subcommand ``name``'s arguments) just before
        ``name`` parses its part of the command line."""
        self._pending[name] = fill

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Sequence[Any] | str | None, option_string: str | None = None) -> None:
        fill = self._pending.pop(values[0], None) if values else None
        if fill is not None:
            fill()
        super().__call__(parser, namespace, values, option_string)


def add_frameworks(sub: LazySubcommands) -> None:
    """One subcommand per framework with commands, its summary as its help."""
    for fw in frameworks():
        if not fw.commands:
            continue
        if fw.name in sub.choices:
            log.warning("cloudckpt: the framework %r has the name of a cloudckpt command; "
                        "its commands are left out", fw.name)
            continue
        summary = fw.summary or f"the commands of {fw.name}"
        sp = sub.add_parser(fw.name, help=summary, description=summary,
                            parents=[common_options(COMMAND)])
        sub.defer(fw.name, partial(_load, fw, sp))


def _load(fw: Framework, parser: argparse.ArgumentParser) -> None:
    """Import ``fw.commands`` (``"module:function"``) and let it fill ``parser``."""
    try:
        add_commands = load_target(fw.commands or "")
    except (ImportError, AttributeError, ValueError) as exc:
        parser.error(f"the commands of {fw.name} ({fw.commands}) failed to load: "
                     f"{type(exc).__name__}: {exc}")
    add_commands(parser)
