"""``python -m cloudckpt.integrations.roll``: move ROLL checkpoints between local disk
and a bucket outside a training run.

- ``upload LOCAL_DIR OUTPUT_DIR``: a local ``checkpoint-N`` in ROLL's merged layout
  (e.g. what the ``file_system`` uploader wrote) becomes a committed
  ``OUTPUT_DIR/checkpoint-N`` that cloudckpt and ``get_latest_ckpt`` resume from;
- ``fetch SRC DIR``: download the latest committed checkpoint under ``SRC`` (or
  ``SRC`` itself, a ``.../checkpoint-N``) into ``DIR/checkpoint-N`` and print that
  path: a value for ``resume_from_checkpoint`` that ROLL's ``download_model`` takes.
"""

from __future__ import annotations

import argparse
import logging
import sys
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from cloudckpt.errors import CloudCkptError, ConfigError, exit_code
from cloudckpt.integrations.roll.resume import CKPT_RE, download_checkpoint
from cloudckpt.integrations.roll.uploader import GcsUploader, RollUploader, S3Uploader
from cloudckpt.storage import parse_options
from cloudckpt.util import logsetup

log = logging.getLogger("cloudckpt.roll")


def uploader_for(output_dir: str, storage_options: Mapping[str, Any] | None = None,
                 **options: Any) -> RollUploader:
    """The uploader whose scheme ``output_dir`` uses (``s3://`` or ``gs://``)."""
    scheme = output_dir.split("://", 1)[0] if "://" in output_dir else ""
    for cls in (S3Uploader, GcsUploader):
        if scheme in cls.schemes:
            return cls(output_dir, storage_options=storage_options, **options)
    raise ConfigError(f"{output_dir!r}: ROLL checkpoints go to s3:// or gs:// URIs")


def upload_checkpoint(local_dir: str | Path, output_dir: str,
                      storage_options: Mapping[str, Any] | None = None) -> str:
    """Upload a complete local ``checkpoint-N`` as one part and commit it; returns its
    URI. A fresh attempt id makes parts left by an earlier, interrupted run not count.
    Raises :class:`IncompleteCheckpointError` (nothing committed) when ROLL could not
    resume from it: no pipeline state, or DCP shards its ``.metadata`` names missing."""
    src = Path(local_dir)
    if not CKPT_RE.match(src.name) or not src.is_dir():
        raise ConfigError(f"{src} is not a ROLL checkpoint directory named checkpoint-N")
    up = uploader_for(output_dir, storage_options, async_upload=False, keep_local_file=True,
                      part_id="local", attempt_id=uuid.uuid4().hex)
    up.upload(ckpt_id=src.name, local_state_path=str(src))
    return up.commit(src.name, expected_uploads=1, timeout=0)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m cloudckpt.integrations.roll",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("-o", "--storage-option", action="append", metavar="KEY=VALUE",
                   help="storage option (repeatable), e.g. endpoint_url=http://...")
    sub = p.add_subparsers(dest="command", required=True)
    up = sub.add_parser("upload", help="commit a local checkpoint-N into OUTPUT_DIR")
    up.add_argument("local_dir", help="the local checkpoint-N directory")
    up.add_argument("output_dir", help="checkpoint_config.output_dir, e.g. s3://bucket/run")
    fe = sub.add_parser("fetch", help="download the latest committed checkpoint; print its path")
    fe.add_argument("src", help="checkpoint_config.output_dir, or a .../checkpoint-N URI")
    fe.add_argument("dir", help="local directory; the files land in DIR/checkpoint-N")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logsetup.configure(0)
    try:
        options = parse_options(args.storage_option)
        if args.command == "upload":
            out = upload_checkpoint(args.local_dir, args.output_dir, options)
        else:
            out = download_checkpoint(args.src, args.dir, options)
    except CloudCkptError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exit_code(exc)
    print(out)
    return 0
