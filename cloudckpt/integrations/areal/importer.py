"""Bring a trial that AReaL wrote on local disk into a bucket, resumable from there.

``cloudckpt areal import LOCAL_TRIAL URI`` commits the recover
state (every ``{name}/recover_checkpoint/`` and ``recover_info/``) as the trial slot's
generation, and every ``{name}/epoch{E}epochstep{S}globalstep{G}/`` export as a
committed export, each file checked on the way. Other files are not copied.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cloudckpt.errors import CheckpointNotFoundError
from cloudckpt.hf import KIND as HF_KIND
from cloudckpt.integrations.areal.layout import EXPORT_RE, INFO_DIR, is_recover_file
from cloudckpt.integrations.areal.resume import KIND
from cloudckpt.training.slot import RecoverSlot
from cloudckpt.training.staging import upload_dir

log = logging.getLogger(__name__)


def _recover_files(trial: Path) -> list[str]:
    return [rel for rel in (p.relative_to(trial).as_posix() for p in sorted(trial.rglob("*"))
                            if p.is_file()) if is_recover_file(rel)]


def import_trial(local_trial: str | os.PathLike, uri: str, *,
                 storage_options: Mapping[str, Any] | None = None) -> list[str]:
    """Commit an AReaL trial directory's recover state and exports below ``uri`` (the
    same trial's directory in the bucket). Returns the URIs committed."""
    trial = Path(local_trial)
    step_file = trial / INFO_DIR / "step_info.json"
    if not step_file.is_file():
        raise CheckpointNotFoundError(
            f"{trial} holds no {INFO_DIR}/step_info.json: not an AReaL trial directory "
            "(expected {fileroot}/checkpoints/{user}/{experiment}/{trial})")
    step = json.loads(step_file.read_text())
    uris = []
    for export in sorted(trial.glob("*/epoch*")):
        m = EXPORT_RE.match(export.name)
        if export.is_dir() and m:
            dest = f"{uri.rstrip('/')}/{export.parent.name}/{export.name}"
            upload_dir(export, dest, storage_options=storage_options, kind=HF_KIND,
                       step=int(m.group(3)), takeover=True)
            uris.append(dest)
    slot = RecoverSlot(uri.rstrip("/"), storage_options=storage_options)
    files = _recover_files(trial)
    generation = slot.commit(
        lambda gen: upload_dir(trial, gen, select=files, kind=KIND,
                               step=int(step["global_step"]), metadata={"imported": True}),
        step=int(step["global_step"]), step_info=step)
    uris.append(slot.store.child(generation).uri)
    log.info("imported %s into %s: %d export(s) and the recover state of global step %s",
             trial, uri, len(uris) - 1, step["global_step"])
    return uris
