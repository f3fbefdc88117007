"""``cloudckpt roll upload|fetch ...``: move ROLL checkpoints between local disk and a
bucket outside a training run.

- ``upload LOCAL_DIR OUTPUT_DIR``: a local ``checkpoint-N`` in ROLL's merged layout
  (e.g. what the ``file_system`` uploader wrote) becomes a committed
  ``OUTPUT_DIR/checkpoint-N`` that cloudckpt and ``get_latest_ckpt`` resume from;
- ``fetch SRC DIR``: download the latest committed checkpoint under ``SRC`` (or
  ``SRC`` itself, a ``.../checkpoint-N``) into ``DIR/checkpoint-N`` and print that
  path: a value for ``resume_from_checkpoint`` that ROLL's ``download_model`` takes.

The storage options (``-o KEY=VALUE``, before or after the subcommand), logging
(``-v``) and exit codes are the ``cloudckpt`` command's. From Python, ``upload`` is
:func:`upload_checkpoint` and ``fetch`` is :func:`.resume.download_checkpoint`.
"""

from __future__ import annotations

import argparse
import logging
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cloudckpt.errors import EXIT_OK, ConfigError
from cloudckpt.integrations.roll.layout import CKPT_RE
from cloudckpt.integrations.roll.resume import download_checkpoint
from cloudckpt.util.cliargs import add_command, subcommands

if TYPE_CHECKING:  # the uploaders load torch: `cloudckpt roll --help` need not wait for it
    from cloudckpt.integrations.roll.uploader import RollUploader

log = logging.getLogger(__name__)


def uploader_for(output_dir: str, storage_options: Mapping[str, Any] | None = None,
                 **options: Any) -> RollUploader:
    """The uploader whose scheme ``output_dir`` uses (``s3://`` or ``gs://``)."""
    from cloudckpt.integrations.roll.uploader import GcsUploader, S3Uploader

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


def cmd_upload(args: argparse.Namespace) -> int:
    print(upload_checkpoint(args.local_dir, args.output_dir, args.options))
    return EXIT_OK


def cmd_fetch(args: argparse.Namespace) -> int:
    print(download_checkpoint(args.src, args.dir, args.options))
    return EXIT_OK


def add_commands(parser: argparse.ArgumentParser) -> None:
    """``cloudckpt roll``'s subcommands, added to ``parser``."""
    sub = subcommands(parser)
    up = add_command(sub, "upload", cmd_upload, "commit a local checkpoint-N into OUTPUT_DIR")
    up.add_argument("local_dir", help="the local checkpoint-N directory")
    up.add_argument("output_dir", help="checkpoint_config.output_dir, e.g. s3://bucket/run")
    fe = add_command(sub, "fetch", cmd_fetch, "download the latest committed checkpoint; "
                     "print its path")
    fe.add_argument("src", help="checkpoint_config.output_dir, or a .../checkpoint-N URI")
    fe.add_argument("dir", help="local directory; the files land in DIR/checkpoint-N")
