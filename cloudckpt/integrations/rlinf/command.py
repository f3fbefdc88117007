"""``python -m cloudckpt.integrations.rlinf {convert,latest,adopt,upload} ...``: the command
line."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from cloudckpt.errors import CloudCkptError, exit_code
from cloudckpt.integrations.rlinf.adoption import adopt_step, upload_step
from cloudckpt.integrations.rlinf.converter import convert
from cloudckpt.integrations.rlinf.layout import checkpoints_root
from cloudckpt.integrations.rlinf.resume import resolve_resume_dir
from cloudckpt.util import logsetup


def _options(args: argparse.Namespace) -> dict[str, Any]:
    from cloudckpt.storage import parse_options

    opts = json.loads(args.storage_options) if args.storage_options else {}
    opts.update(parse_options(args.storage_option))
    return opts


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m cloudckpt.integrations.rlinf {convert,latest,adopt,upload} ...``"""
    p = argparse.ArgumentParser(prog="python -m cloudckpt.integrations.rlinf",
                                description="RLinf checkpoints on object storage")
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("convert", help="DCP actor checkpoint -> torch.save state dict")
    c.add_argument("--dcp_path", "--dcp-path", required=True,
                   help="global_step_N, its actor/ or actor/dcp_checkpoint (any URI)")
    c.add_argument("--output_path", "--output-path", required=True,
                   help="file to write (a local path or any URI)")
    lt = sub.add_parser("latest", help="print the URI `resume_dir: auto` would resume from")
    lt.add_argument("--output_dir", "--output-dir", required=True)
    lt.add_argument("--experiment_name", "--experiment-name", required=True)
    ad = sub.add_parser("adopt", help="check and commit a global_step_N written by RLinf "
                        "itself (in a bucket or on disk), so it resumes")
    ad.add_argument("uri", help=".../checkpoints/global_step_N")
    up = sub.add_parser("upload", help="put a global_step_N written by RLinf on local disk "
                        "into a bucket, checked and committed")
    up.add_argument("local_step", help="the local .../checkpoints/global_step_N")
    up.add_argument("dst", help="the run's checkpoints URI (or the step's URI there)")
    for sp in (c, lt, ad, up):
        sp.add_argument("--storage-options", default=None, help="storage options as JSON")
        sp.add_argument("-o", "--storage-option", action="append", metavar="KEY=VALUE")
    args = p.parse_args(argv)
    logsetup.configure(1)
    try:
        if args.cmd == "adopt":
            ckpt = adopt_step(args.uri, _options(args))
            print(f"adopted {ckpt.uri} ({len(ckpt.files)} objects)")
            return 0
        if args.cmd == "upload":
            ckpt = upload_step(args.local_step, args.dst, storage_options=_options(args))
            print(f"uploaded {ckpt.uri} ({len(ckpt.files)} objects)")
            return 0
        if args.cmd == "convert":
            n = convert(args.dcp_path, args.output_path, storage_options=_options(args))
            print(f"wrote {n} tensors to {args.output_path}")
            return 0
        uri = resolve_resume_dir("auto", checkpoints_root(args.output_dir,
                                                          args.experiment_name),
                                 _options(args))
        if uri is None:
            print("no committed checkpoint", file=sys.stderr)
            return 1
        print(uri)
        return 0
    except CloudCkptError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exit_code(exc)
