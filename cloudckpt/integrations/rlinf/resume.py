"""Which RLinf checkpoint to resume from: ``runner.resume_dir`` resolved (``auto``, a
URI, or nothing) to a committed ``global_step_N``."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from cloudckpt.core.checkpoint import Checkpoint, open_checkpoint
from cloudckpt.core.expected import expect_kind, expect_step
from cloudckpt.core.listing import list_checkpoints
from cloudckpt.core.ownership import FOREIGN, survey
from cloudckpt.errors import (
    CheckpointNotFoundError,
    ConfigError,
    IncompleteCheckpointError,
)
from cloudckpt.integrations.rlinf.layout import ACTOR, DCP_DIR, KIND, STEP_RE, parse_step
from cloudckpt.storage import Store, as_store

log = logging.getLogger(__name__)

ADOPT_HINT = "cloudckpt rlinf adopt"


def open_rlinf_checkpoint(uri: str | Store,
                          storage_options: Mapping[str, Any] | None = None) -> Checkpoint:
    """Open a committed ``global_step_N`` (a trailing slash is fine). A step written
    by RLinf itself (no manifest) is refused with the command that adopts it."""
    if isinstance(uri, str):
        uri = uri.rstrip("/") or uri
    try:
        ckpt = open_checkpoint(uri, storage_options)
    except (CheckpointNotFoundError, IncompleteCheckpointError) as exc:
        store = as_store(uri, storage_options)
        if survey(store).kind == FOREIGN and store.exists(f"{ACTOR}/{DCP_DIR}/.metadata"):
            raise IncompleteCheckpointError(
                f"{store.uri} was written by RLinf itself (no cloudckpt manifest); check and "
                f"commit it once with `{ADOPT_HINT} {store.uri}`, then resume") from exc
        raise
    return expect_kind(ckpt, KIND, "an RLinf step")


def checked_step(ckpt: Checkpoint) -> int:
    """The step of ``ckpt``'s name (RLinf resumes at it), which its manifest must say."""
    step = parse_step(ckpt.uri)
    expect_step(ckpt, step)
    return step


def resolve_resume_dir(resume_dir: str | None, root: str | Store,
                       storage_options: Mapping[str, Any] | None = None) -> str | None:
    """``runner.resume_dir`` -> the URI of a committed ``global_step_N``, or None.

    As RLinf's runner reads it: None (YAML ``null``) starts fresh; ``auto`` is the
    highest step under ``root``, here the highest *committed* one (torn saves are
    skipped with a WARNING; None if there is none); anything else names a step
    directory ending in ``global_step_<N>`` (a trailing slash is fine), which must
    be committed. Other strings ("Auto", "None", "") are refused, where RLinf would
    fail on ``int()``.
    """
    if resume_dir is None:
        return None
    text = str(resume_dir)
    if text == "auto":
        return _latest(as_store(root, storage_options))
    if text.strip().lower() in ("auto", "null", "none", "~", ""):
        raise ConfigError(
            f"runner.resume_dir is the string {text!r}; RLinf knows only null (no quotes: a "
            "fresh start), auto, or a path ending in global_step_<N>")
    parse_step(text)  # the name, before any request
    store = as_store(root, storage_options)
    target = text.rstrip("/")
    if target.startswith(store.uri + "/"):  # below the root: reuse its client and options
        ckpt = open_rlinf_checkpoint(store.child(target[len(store.uri) + 1:]))
    else:
        ckpt = open_rlinf_checkpoint(target, storage_options)
    checked_step(ckpt)
    return ckpt.uri


def _latest(store: Store) -> str | None:
    infos = [i for i in list_checkpoints(store, include_uncommitted=True)
             if STEP_RE.match(i.name)]
    for info in sorted(infos, key=lambda i: parse_step(i.name), reverse=True):
        if info.committed and not info.whole(store):  # fall back from it, as for a torn one
            continue
        if info.committed:  # checked as a named one is, before any worker loads it
            ckpt = open_rlinf_checkpoint(store.child(info.name))
            checked_step(ckpt)
            return ckpt.uri
        if info.status == "foreign":
            # RLinf would resume from it; skipping it would later collide with its name.
            raise IncompleteCheckpointError(
                f"resume_dir=auto: the newest step {info.uri} was written by RLinf itself "
                f"(no cloudckpt manifest); commit it once with `{ADOPT_HINT} {info.uri}`, "
                "or remove it")
        log.warning("skipping %s: torn checkpoint (no cloudckpt manifest%s); a save "
                    "that never finished", info.uri, f": {info.error}" if info.error else "")
    log.info("resume_dir=auto: no committed checkpoint under %s; starting fresh", store.uri)
    return None
