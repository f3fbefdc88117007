"""Which verl step to resume: the newest committed ``global_step_N`` of a root, or
the one ``trainer.resume_from_path`` names, opened and checked."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from cloudckpt.core.checkpoint import Checkpoint, open_checkpoint
from cloudckpt.core.listing import list_checkpoints
from cloudckpt.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
)
from cloudckpt.integrations.verl.layout import KIND, STEP_RE, parse_step
from cloudckpt.storage import open_store

log = logging.getLogger("cloudckpt.verl")

UPLOAD_HINT = "cloudckpt verl upload"


def open_step(uri: str, storage_options: Mapping[str, Any] | None = None) -> Checkpoint:
    """A committed verl step (a trailing slash is fine); one verl wrote itself (no
    manifest) is refused with the command that commits it."""
    uri = uri.rstrip("/")
    step = parse_step(uri)
    try:
        ckpt = open_checkpoint(uri, storage_options)
    except (CheckpointNotFoundError, IncompleteCheckpointError) as exc:
        raise IncompleteCheckpointError(
            f"{uri} is not a committed verl step ({exc}). A step verl wrote itself is "
            f"committed once with `{UPLOAD_HINT} LOCAL_STEP_DIR {uri}`") from exc
    if ckpt.manifest.kind != KIND:
        raise CorruptCheckpointError(
            f"{ckpt.uri} is a {ckpt.manifest.kind!r} checkpoint, not a verl step")
    if ckpt.step is not None and ckpt.step != step:
        raise CorruptCheckpointError(
            f"{ckpt.uri} is named for step {step} but its manifest says step {ckpt.step}; "
            "was it renamed or copied to the wrong place?")
    return ckpt


def latest_step(root: str, storage_options: Mapping[str, Any] | None = None) -> str | None:
    """The newest committed step under ``root`` (one listing), or None. Newer steps
    that never committed are skipped with a WARNING; one verl wrote itself is
    refused (resuming past it would later collide with its name)."""
    store = open_store(root, storage_options)
    infos = [i for i in list_checkpoints(store, include_uncommitted=True)
             if STEP_RE.match(i.name)]
    for info in sorted(infos, key=lambda i: parse_step(i.name), reverse=True):
        if info.committed and info.manifest is not None and info.manifest.kind == KIND:
            return info.uri
        if info.committed:
            log.warning("skipping %s: a %r checkpoint, not a verl step", info.uri,
                        info.manifest.kind if info.manifest else None)
            continue
        if info.status == "foreign":
            raise IncompleteCheckpointError(
                f"resume_mode=auto: the newest step {info.uri} was written by verl itself "
                f"(no cloudckpt manifest); commit it once with `{UPLOAD_HINT} "
                f"LOCAL_STEP_DIR {info.uri}`, or remove it")
        log.warning("skipping %s: torn checkpoint (no cloudckpt manifest%s); a save that "
                    "never finished", info.uri, f": {info.error}" if info.error else "")
    log.info("resume_mode=auto: no committed verl step under %s; training from scratch",
             store.uri)
    return None
