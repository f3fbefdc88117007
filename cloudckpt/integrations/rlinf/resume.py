"""Which RLinf checkpoint to resume from: ``runner.resume_dir`` resolved (``auto``, a
URI, or nothing) to a committed ``global_step_N``."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from ...checkpoint import Checkpoint, open_checkpoint
from ...errors import CorruptCheckpointError
from ...listing import list_checkpoints
from ...storage import Store, as_store
from .layout import _STEP_RE, KIND, parse_step

log = logging.getLogger("cloudckpt.rlinf")

_NULLS = {"", "null", "none", "~"}


def open_rlinf_checkpoint(uri: str | Store,
                          storage_options: Mapping[str, Any] | None = None) -> Checkpoint:
    """Open a committed ``global_step_N`` (a trailing slash is fine)."""
    if isinstance(uri, str):
        uri = uri.rstrip("/") or uri
    ckpt = open_checkpoint(uri, storage_options)
    if ckpt.manifest.kind != KIND:
        raise CorruptCheckpointError(
            f"{ckpt.uri} is a {ckpt.manifest.kind!r} checkpoint, not an RLinf one")
    return ckpt


def _checked_step(ckpt: Checkpoint) -> int:
    step = parse_step(ckpt.uri)
    if ckpt.step is not None and ckpt.step != step:
        raise CorruptCheckpointError(
            f"{ckpt.uri} is named for step {step} but its manifest says step {ckpt.step}; "
            "was it renamed or copied to the wrong place?")
    return step


def resolve_resume_dir(resume_dir: str | None, root: str | Store,
                       storage_options: Mapping[str, Any] | None = None) -> str | None:
    """``runner.resume_dir`` -> the URI of a committed ``global_step_N``, or None.

    - null / empty: None (fresh start);
    - ``auto``: the highest committed step under ``root`` (None if there is none);
      uncommitted (torn) ``global_step_*`` prefixes are skipped with a WARNING;
    - a URI or path: that checkpoint, which must be committed.
    """
    if resume_dir is None or str(resume_dir).strip().lower() in _NULLS:
        return None
    store = as_store(root, storage_options)
    if str(resume_dir).strip().lower() == "auto":
        return _latest(store)
    target = str(resume_dir).strip().rstrip("/")
    if target.startswith(store.uri + "/"):  # below the root: reuse its client and options
        ckpt = open_rlinf_checkpoint(store.child(target[len(store.uri) + 1:]))
    else:
        ckpt = open_rlinf_checkpoint(target, storage_options)
    _checked_step(ckpt)
    return ckpt.uri


def _latest(store: Store) -> str | None:
    infos = [i for i in list_checkpoints(store, include_uncommitted=True)
             if _STEP_RE.match(i.name)]
    best: tuple[int, str] | None = None
    for info in sorted(infos, key=lambda i: parse_step(i.name), reverse=True):
        if not info.committed:
            log.warning("skipping %s: torn checkpoint (no cloudckpt manifest%s); a save "
                        "that never finished", info.uri, f": {info.error}" if info.error else "")
            continue
        best = (parse_step(info.name), info.uri)
        break
    if best is None:
        log.info("resume_dir=auto: no committed checkpoint under %s; starting fresh", store.uri)
        return None
    return best[1]
