"""``cloudckpt rlinf convert|latest|adopt|upload ...``: RLinf's steps outside a run.

- ``convert --dcp_path STEP --output_path FILE``: RLinf's DCP -> ``torch.save``
  converter, on any URI on either side (:func:`.converter.convert`);
- ``latest --output_dir D --experiment_name E``: print the step ``resume_dir: auto``
  resumes from;
- ``adopt URI``: check and commit a ``global_step_N`` RLinf wrote (in a bucket or on
  disk), so it resumes (:func:`.adoption.adopt_step`);
- ``upload LOCAL_STEP DST``: put a ``global_step_N`` RLinf wrote on local disk into a
  bucket, checked and committed (:func:`.adoption.upload_step`).

Each also takes ``--storage-options JSON`` (as RLinf's YAML spells them), under the
``cloudckpt`` command's ``-o KEY=VALUE`` (an ``-o`` wins a key both give); logging
(``-v``) and exit codes are the ``cloudckpt`` command's.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from cloudckpt.errors import EXIT_OK, CheckpointNotFoundError, ConfigError
from cloudckpt.integrations.rlinf.adoption import adopt_step, upload_step
from cloudckpt.integrations.rlinf.converter import convert
from cloudckpt.integrations.rlinf.layout import checkpoints_root
from cloudckpt.integrations.rlinf.resume import resolve_resume_dir
from cloudckpt.util.cliargs import add_command, subcommands


def _options(args: argparse.Namespace) -> dict[str, Any]:
    """``--storage-options`` JSON, updated with the ``-o`` options."""
    opts: Any = {}
    if args.storage_options:
        try:
            opts = json.loads(args.storage_options)
        except ValueError as exc:
            raise ConfigError(f"--storage-options is not JSON: {exc}") from None
        if not isinstance(opts, dict):
            raise ConfigError("--storage-options must be a JSON object, e.g. "
                              '\'{"endpoint_url": "http://..."}\'')
    return {**opts, **args.options}


def cmd_convert(args: argparse.Namespace) -> int:
    n = convert(args.dcp_path, args.output_path, storage_options=_options(args))
    print(f"wrote {n} tensors to {args.output_path}")
    return EXIT_OK


def cmd_latest(args: argparse.Namespace) -> int:
    root = checkpoints_root(args.output_dir, args.experiment_name)
    uri = resolve_resume_dir("auto", root, _options(args))
    if uri is None:
        raise CheckpointNotFoundError(f"no committed checkpoint under {root}")
    print(uri)
    return EXIT_OK


def cmd_adopt(args: argparse.Namespace) -> int:
    ckpt = adopt_step(args.uri, _options(args))
    print(f"adopted {ckpt.uri} ({len(ckpt.files)} objects)")
    return EXIT_OK


def cmd_upload(args: argparse.Namespace) -> int:
    ckpt = upload_step(args.local_step, args.dst, storage_options=_options(args))
    print(f"uploaded {ckpt.uri} ({len(ckpt.files)} objects)")
    return EXIT_OK


def _flags(parser: argparse.ArgumentParser, **helps: str) -> None:
    """Required ``--name`` options, spelled as RLinf's tool does (``--dcp_path``) and
    with dashes (``--dcp-path``)."""
    for name, text in helps.items():
        parser.add_argument(f"--{name}", f"--{name.replace('_', '-')}", required=True,
                            help=text)


def add_commands(parser: argparse.ArgumentParser) -> None:
    """``cloudckpt rlinf``'s subcommands, added to ``parser``."""
    sub = subcommands(parser)
    c = add_command(sub, "convert", cmd_convert, "DCP actor checkpoint -> torch.save state dict")
    _flags(c, dcp_path="global_step_N, its actor/ or actor/dcp_checkpoint (any URI)",
           output_path="file to write (a local path or any URI)")
    lt = add_command(sub, "latest", cmd_latest, "print the URI `resume_dir: auto` would "
                     "resume from")
    _flags(lt, output_dir="runner.output_dir, e.g. s3://bucket/rlinf-logs",
           experiment_name="runner.experiment_name")
    ad = add_command(sub, "adopt", cmd_adopt, "check and commit a global_step_N written by "
                     "RLinf itself (in a bucket or on disk), so it resumes")
    ad.add_argument("uri", help=".../checkpoints/global_step_N")
    up = add_command(sub, "upload", cmd_upload, "put a global_step_N written by RLinf on "
                     "local disk into a bucket, checked and committed")
    up.add_argument("local_step", help="the local .../checkpoints/global_step_N")
    up.add_argument("dst", help="the run's checkpoints URI (or the step's URI there)")
    for sp in (c, lt, ad, up):
        sp.add_argument("--storage-options", default=None, metavar="JSON",
                        help="storage options as a JSON object (the -o options win a key "
                        "both give)")
