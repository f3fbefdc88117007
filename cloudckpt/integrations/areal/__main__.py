"""``python -m cloudckpt.integrations.areal {import,adopt} ... [-o KEY=VALUE]...``"""

from __future__ import annotations

import argparse
import sys

from cloudckpt.errors import CloudCkptError, exit_code
from cloudckpt.integrations.areal.adoption import adopt_trial
from cloudckpt.integrations.areal.importer import import_trial
from cloudckpt.storage import parse_options
from cloudckpt.util import logsetup


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m cloudckpt.integrations.areal",
                                description="AReaL trials and cloudckpt")
    sub = p.add_subparsers(dest="command", required=True)
    sp = sub.add_parser("import", help="commit a trial AReaL wrote on local disk (its "
                        "recover state and exports) into a bucket, resumable from there")
    sp.add_argument("local_trial", help="{fileroot}/checkpoints/{user}/{experiment}/{trial}")
    sp.add_argument("uri", help="the same trial's directory in the bucket")
    ad = sub.add_parser("adopt", help="check and commit a trial AReaL wrote that is "
                        "already in a bucket (e.g. copied with `aws s3 sync`), so it resumes")
    ad.add_argument("uri", help="the trial's directory in the bucket: "
                    "{fileroot}/checkpoints/{user}/{experiment}/{trial}")
    for s in (sp, ad):
        s.add_argument("-o", "--option", action="append", metavar="KEY=VALUE",
                       help="storage option (e.g. endpoint_url=http://...)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logsetup.configure(1, fmt="%(message)s")
    options = parse_options(args.option)
    try:
        if args.command == "adopt":
            uris = adopt_trial(args.uri, storage_options=options)
        else:
            uris = import_trial(args.local_trial, args.uri, storage_options=options)
        for uri in uris:
            print(f"committed {uri}")
    except CloudCkptError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exit_code(exc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
