"""``cloudckpt areal import|adopt ...``: bring a trial AReaL wrote under cloudckpt.

- ``import LOCAL_TRIAL URI``: a trial AReaL wrote on local disk (its recover state and
  exports) committed into a bucket, resumable from there (:func:`.importer.import_trial`);
- ``adopt URI``: a trial AReaL wrote that is already in a bucket (e.g. copied with
  ``aws s3 sync``) checked and committed, so it resumes (:func:`.adoption.adopt_trial`).

Each prints ``committed URI`` per checkpoint it committed. The storage options
(``-o KEY=VALUE``), logging (``-v``) and exit codes are the ``cloudckpt`` command's.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable

from cloudckpt.errors import EXIT_OK
from cloudckpt.util.cliargs import add_command, subcommands

TRIAL = "{fileroot}/checkpoints/{user}/{experiment}/{trial}"


def _committed(uris: Iterable[str]) -> int:
    for uri in uris:
        print(f"committed {uri}")
    return EXIT_OK


def cmd_import(args: argparse.Namespace) -> int:
    from cloudckpt.integrations.areal.importer import import_trial

    return _committed(import_trial(args.local_trial, args.uri, storage_options=args.options))


def cmd_adopt(args: argparse.Namespace) -> int:
    from cloudckpt.integrations.areal.adoption import adopt_trial

    return _committed(adopt_trial(args.uri, storage_options=args.options))


def add_commands(parser: argparse.ArgumentParser) -> None:
    """``cloudckpt areal``'s subcommands, added to ``parser``."""
    sub = subcommands(parser)
    sp = add_command(sub, "import", cmd_import, "commit a trial AReaL wrote on local disk "
                     "(its recover state and exports) into a bucket, resumable from there")
    sp.add_argument("local_trial", help=f"the trial on local disk: {TRIAL}")
    sp.add_argument("uri", help="the same trial's directory in the bucket")
    sp = add_command(sub, "adopt", cmd_adopt, "check and commit a trial AReaL wrote that is "
                     "already in a bucket (e.g. copied with `aws s3 sync`), so it resumes")
    sp.add_argument("uri", help=f"the trial's directory in the bucket: {TRIAL}")
