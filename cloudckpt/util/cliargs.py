"""The options every ``cloudckpt`` command takes, at every level of its subcommands.

``-v/--verbose`` (counted; the CLI hands the total to :func:`cloudckpt.util.logsetup.configure`)
and ``-o/--storage-option/--option KEY=VALUE`` (repeatable; the CLI turns every pair
into ``args.options``, a dict, with :func:`cloudckpt.storage.parse_options` before the
command's handler runs, and maps a bad pair to exit 2). Both are accepted before the
command, after it and after a subcommand: ``cloudckpt -o a=1 NAME -o b=2 CMD -o c=3``.

argparse parses each subcommand into a namespace of its own, whose defaults overwrite
what the level above parsed; so each level keeps its own destination (:data:`LEVELS`),
and :func:`verbosity` and :func:`option_pairs` add them up.

A framework's ``add_commands(parser)`` takes :func:`subcommands` of its parser and adds
each subcommand with :func:`add_command`: the common options, and ``func`` set to its
handler, ``handler(args) -> int`` (the exit status; raising a
:class:`~cloudckpt.errors.CloudCkptError` gives that error's exit code). The
``cloudckpt`` command's own subcommands use :func:`add_command` too.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

#: Destination suffixes, from the top: ``cloudckpt`` itself, one of its commands
#: (``cloudckpt ls``, ``cloudckpt NAME``), a command's subcommand (``cloudckpt NAME CMD``).
TOP, COMMAND, SUBCOMMAND = "", "_command", "_subcommand"
LEVELS = (TOP, COMMAND, SUBCOMMAND)

VERBOSE_HELP = ("more logging (-v: progress, -vv: cloudckpt's debug and tracebacks, "
                "-vvv: every library's debug)")
OPTION_HELP = "storage option for the URI (repeatable), e.g. endpoint_url=http://..."

Handler = Callable[[argparse.Namespace], int]


def common_options(level: str = SUBCOMMAND) -> argparse.ArgumentParser:
    """A parent parser (for ``parents=[...]``) holding -v and -o at ``level``."""
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, not {level!r}")
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("-v", "--verbose", action="count", default=0, dest=f"verbose{level}",
                   help=VERBOSE_HELP)
    p.add_argument("-o", "--storage-option", "--option", action="append", metavar="KEY=VALUE",
                   dest=f"storage_option{level}", help=OPTION_HELP)
    return p


def subcommands(parser: argparse.ArgumentParser) -> Any:
    """The subcommands of ``parser`` (``cloudckpt NAME COMMAND``): one is required, and
    each is added with :func:`add_command`."""
    return parser.add_subparsers(dest="subcommand", required=True, metavar="COMMAND",
                                 help="what to do (COMMAND --help says more)")


def add_command(subparsers: Any, name: str, handler: Handler, help: str,
                level: str = SUBCOMMAND, **kwargs: Any) -> argparse.ArgumentParser:
    """Add the subcommand ``name`` to ``subparsers`` (what ``add_subparsers`` returned):
    ``help`` is also its description, it takes the common options, and ``func`` is
    ``handler``. Returns its parser, for its own arguments."""
    kwargs.setdefault("description", help)
    sp = subparsers.add_parser(name, help=help, parents=[common_options(level)], **kwargs)
    sp.set_defaults(func=handler)
    return sp


def verbosity(args: argparse.Namespace) -> int:
    """How many -v were given, at every level."""
    return sum(getattr(args, f"verbose{level}", 0) or 0 for level in LEVELS)


def option_pairs(args: argparse.Namespace) -> list[str]:
    """Every -o KEY=VALUE given, top level first (a later pair wins a repeated key)."""
    return [pair for level in LEVELS for pair in getattr(args, f"storage_option{level}", None)
            or []]
