"""Which verl step to resume: the newest committed ``global_step_N`` of a run's
bucket root, or the one ``trainer.resume_from_path`` names, opened and checked."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from cloudckpt.core.checkpoint import Checkpoint, open_checkpoint
from cloudckpt.core.expected import expect_kind, expect_step
from cloudckpt.core.listing import list_checkpoints
from cloudckpt.errors import (
    CheckpointNotFoundError,
    ConfigError,
    IncompleteCheckpointError,
)
from cloudckpt.integrations.verl.layout import KIND, STEP_RE, parse_step
from cloudckpt.storage import is_remote, open_store

log = logging.getLogger(__name__)

UPLOAD_HINT = "cloudckpt verl upload"
MODES = ("auto", "disable", "resume_path")


def run_root(default_local_dir: Any, default_hdfs_dir: Any) -> str | None:
    """A run's bucket root: ``default_local_dir`` when it is a bucket URI, else
    ``default_hdfs_dir`` when that one is; None for a local run (verl's own code)."""
    if is_remote(default_local_dir):
        if default_hdfs_dir is not None:
            raise ConfigError(f"trainer.default_local_dir is a bucket ({default_local_dir}) "
                              f"and trainer.default_hdfs_dir is set too ({default_hdfs_dir}): "
                              "set one of them")
        return str(default_local_dir).rstrip("/")
    if is_remote(default_hdfs_dir):
        return str(default_hdfs_dir).rstrip("/")
    return None


def resolve(mode: str, resume_from_path: Any, root: str | None, *,
            kinds: tuple[str, ...] = (KIND,), auto_takes_path: bool = False) -> str | None:
    """The committed step ``trainer.resume_mode`` resumes (None: a fresh start): the one
    ``resume_from_path`` names (``resume_path``; also ``auto`` where verl's trainer
    takes it there, ``auto_takes_path``), else the newest committed under ``root``."""
    if mode not in MODES:
        raise ConfigError(f"trainer.resume_mode is {mode!r}; verl knows {', '.join(MODES)}")
    if mode == "disable":
        return None
    if mode == "resume_path" or (auto_takes_path and resume_from_path is not None):
        if not isinstance(resume_from_path, str) or "global_step_" not in resume_from_path:
            raise ConfigError(f"trainer.resume_mode is {mode} and resume_from_path is "
                              f"{resume_from_path!r}: name a step, .../global_step_<N>")
        return open_step(resume_from_path, kinds=kinds).uri
    return None if root is None else latest_step(root, kinds=kinds)


def open_step(uri: str, storage_options: Mapping[str, Any] | None = None, *,
              kinds: tuple[str, ...] = (KIND,)) -> Checkpoint:
    """A committed verl step of one of ``kinds`` (a trailing slash is fine), its
    manifest's step the one its name says; one verl wrote itself (no manifest) is
    refused with the command that commits it."""
    uri = uri.rstrip("/")
    step = parse_step(uri)
    try:
        ckpt = open_checkpoint(uri, storage_options)
    except (CheckpointNotFoundError, IncompleteCheckpointError) as exc:
        raise IncompleteCheckpointError(
            f"{uri} is not a committed verl step ({exc}). A step verl wrote itself is "
            f"committed once with `{UPLOAD_HINT} LOCAL_STEP_DIR {uri}`") from exc
    return expect_step(expect_kind(ckpt, kinds, "a verl step"), step)


def latest_step(root: str, storage_options: Mapping[str, Any] | None = None, *,
                kinds: tuple[str, ...] = (KIND,)) -> str | None:
    """The newest whole committed step of one of ``kinds`` under ``root``, or None.
    Newer steps that never committed, or whose objects disagree with their manifest
    (:meth:`~cloudckpt.core.listing.CheckpointInfo.whole`), are skipped with a WARNING;
    one verl wrote itself is refused (resuming past it would later collide with its
    name)."""
    store = open_store(root, storage_options)
    infos = [i for i in list_checkpoints(store, include_uncommitted=True)
             if STEP_RE.match(i.name)]
    for info in sorted(infos, key=lambda i: parse_step(i.name), reverse=True):
        if info.committed and info.kind in kinds:
            if info.whole(store):
                return info.uri
            continue
        if info.committed:
            log.warning("skipping %s: a %r checkpoint, not a verl step", info.uri,
                        info.kind)
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
