"""argparse's private internal: the action class behind ``add_subparsers``.

argparse has no public base class for a subcommands action, and the CLI's
:class:`~cloudckpt.cli.frameworks.LazySubcommands` must be one (``add_subparsers(action=
...)`` makes it with that class's arguments) to add a framework's arguments only once
its subcommand is chosen.
"""

from __future__ import annotations

import argparse

from cloudckpt.compat import Internal

INTERNALS = {
    "argparse._SubParsersAction": Internal(
        "the base of LazySubcommands: the action add_subparsers makes, whose __call__ "
        "picks the subcommand's parser"),
}

#: ``argparse._SubParsersAction``.
SubParsersAction = argparse._SubParsersAction
