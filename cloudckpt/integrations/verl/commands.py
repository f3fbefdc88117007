"""``cloudckpt verl upload|download|latest ...``: verl's steps outside a run.

- ``upload LOCAL_STEP ROOT``: a ``global_step_N`` verl wrote on local disk (its PPO
  trainer's or its SFT trainer's), checked
  and committed under the run's root in a bucket (:func:`.localsteps.upload_step`);
- ``download STEP_URI LOCAL_ROOT``: a committed step into a local
  ``default_local_dir``, with verl's tracker (:func:`.localsteps.download_step`);
- ``latest ROOT``: print the step ``resume_mode: auto`` resumes.

Storage options come from the ``cloudckpt`` command's ``-o KEY=VALUE``; logging
(``-v``) and exit codes are the ``cloudckpt`` command's.
"""

from __future__ import annotations

import argparse

from cloudckpt.errors import EXIT_OK, CheckpointNotFoundError
from cloudckpt.integrations.verl.layout import STEP_KINDS
from cloudckpt.integrations.verl.localsteps import download_step, upload_step
from cloudckpt.integrations.verl.resume import latest_step
from cloudckpt.util.cliargs import add_command, subcommands


def cmd_upload(args: argparse.Namespace) -> int:
    ckpt = upload_step(args.local_step, args.root, storage_options=args.options)
    print(f"uploaded {ckpt.uri} ({len(ckpt.files)} objects)")
    return EXIT_OK


def cmd_download(args: argparse.Namespace) -> int:
    out = download_step(args.step_uri, args.local_root, storage_options=args.options)
    print(f"downloaded into {out}")
    return EXIT_OK


def cmd_latest(args: argparse.Namespace) -> int:
    uri = latest_step(args.root, args.options, kinds=STEP_KINDS)
    if uri is None:
        raise CheckpointNotFoundError(f"no committed verl step under {args.root}")
    print(uri)
    return EXIT_OK


def add_commands(parser: argparse.ArgumentParser) -> None:
    """``cloudckpt verl``'s subcommands, added to ``parser``."""
    sub = subcommands(parser)
    up = add_command(sub, "upload", cmd_upload, "check a global_step_N verl wrote on local "
                     "disk and commit it under a run's root in a bucket")
    up.add_argument("local_step", help="the local .../global_step_N")
    up.add_argument("root", help="the run's root (trainer.default_local_dir), e.g. "
                    "s3://bucket/run")
    down = add_command(sub, "download", cmd_download, "bring a committed step into a local "
                       "default_local_dir, with verl's tracker")
    down.add_argument("step_uri", help="e.g. s3://bucket/run/global_step_N")
    down.add_argument("local_root", help="the local trainer.default_local_dir")
    lt = add_command(sub, "latest", cmd_latest, "print the step `resume_mode: auto` resumes")
    lt.add_argument("root", help="the run's root, e.g. s3://bucket/run")
