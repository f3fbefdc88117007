"""verl steps between local disk and a bucket, both ways:

- :func:`upload_step`: a ``global_step_N`` verl wrote on local disk (its own code, no
  manifest) checked and committed in a bucket, as the bound trainer commits one, so it
  resumes there;
- :func:`download_step`: a committed step brought into a local ``default_local_dir``
  with verl's tracker, so verl's own ``find_latest_ckpt_path`` and
  ``FSDPCheckpointManager.load_checkpoint`` resume it.
"""

from __future__ import annotations

import json
import logging
import os
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cloudckpt.core.checkpoint import Checkpoint
from cloudckpt.errors import CheckpointNotFoundError, CorruptCheckpointError
from cloudckpt.integrations.verl.layout import (
    ACTOR,
    CRITIC,
    DATA,
    FSDP_LAYOUT,
    KIND,
    MEGATRON_CONTENTS,
    MEGATRON_LAYOUT,
    RANK_FILES,
    ROLE_KIND,
    SFT_KIND,
    STEP_KINDS,
    TRACKER,
    parse_step,
    rank_file,
    rank_file_world,
    step_name,
)
from cloudckpt.integrations.verl.resume import open_step
from cloudckpt.integrations.verl.workers import files_under, role_parts
from cloudckpt.movement.checkpoint_copy import download
from cloudckpt.storage import open_store
from cloudckpt.training import multipart

log = logging.getLogger(__name__)


def _check_role(role_dir: Path) -> tuple[int, str]:
    """The world size and layout of a role directory verl wrote, after checking it:
    an FSDP role's rank files, or a Megatron role's ``dist_ckpt`` directories."""
    if (role_dir / MEGATRON_CONTENTS).is_file():
        return _check_megatron(role_dir), MEGATRON_LAYOUT
    return _check_rank_files(role_dir), FSDP_LAYOUT


def _check_megatron(role_dir: Path) -> int:
    """The world size of a Megatron role directory, after checking that each
    ``dist_ckpt`` its ``ckpt_contents.json`` (written last by verl) names is whole:
    torch DCP's ``.metadata`` and Megatron-Core's ``metadata.json``."""
    path = role_dir / MEGATRON_CONTENTS
    try:
        contents = json.loads(path.read_text())
        world = int(contents["world_size"])
        entries = list(contents.get("contents", {}).values())
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CorruptCheckpointError(f"{path} is not verl's contents manifest ({exc!r})"
                                     ) from None
    for entry in entries:
        if entry.get("format") != "megatron_dist_checkpoint":
            continue
        for name in (".metadata", "metadata.json"):
            if not (role_dir / entry["path"] / name).is_file():
                raise CorruptCheckpointError(f"{role_dir / entry['path']} has no {name}: the "
                                             "dist_ckpt save did not finish")
    return world


def _check_rank_files(role_dir: Path) -> int:
    """The world size of an FSDP role directory, after checking that every rank's file
    of each content it holds is there and intact (each is a ``torch.save`` zip, whose
    members carry CRC32s)."""
    names = [p.name for p in role_dir.iterdir() if p.is_file()]
    worlds = {w for n in names if (w := rank_file_world(n)) is not None}
    if len(worlds) != 1:
        raise CorruptCheckpointError(
            f"{role_dir} holds rank files of world sizes {sorted(worlds) or 'none'}; a verl "
            "role directory holds one save's files")
    world = worlds.pop()
    for content in RANK_FILES:
        present = [r for r in range(world) if rank_file(content, world, r) in names]
        if present and len(present) != world:
            missing = sorted(set(range(world)) - set(present))
            raise CorruptCheckpointError(f"{role_dir}: the {content} files of ranks {missing} "
                                         "are missing; the save did not finish")
        for r in present:
            path = role_dir / rank_file(content, world, r)
            try:
                with zipfile.ZipFile(path) as z:
                    bad = z.testzip()
            except (OSError, zipfile.BadZipFile) as exc:
                raise CorruptCheckpointError(f"{path} is not a whole torch.save file ({exc}); "
                                             "the save did not finish") from None
            if bad is not None:
                raise CorruptCheckpointError(f"{path}: {bad} fails its CRC32")
    return world


def upload_step(local_step: str | os.PathLike, dst_root: str, *,
                storage_options: Mapping[str, Any] | None = None) -> Checkpoint:
    """Commit the ``global_step_N`` verl wrote at ``local_step`` under ``dst_root`` (the
    run's root in the bucket), its rank files checked first: a PPO step (each role
    part and ``data.pt``) or an SFT step (the rank files at its top)."""
    src = Path(local_step)
    step = parse_step(str(src))
    store = open_store(dst_root.rstrip("/"), storage_options).child(step_name(step))
    roles = [r for r in (ACTOR, CRITIC) if (src / r).is_dir()]
    if ACTOR not in roles:
        if not any(rank_file_world(p.name) for p in src.iterdir() if p.is_file()):
            raise CheckpointNotFoundError(
                f"{src} has no {ACTOR}/ and no rank files at its top: not a verl step")
        committed = multipart.save(store, role_parts(src, files_under(src)), step=step,
                                   kind=SFT_KIND, metadata={
                                       "world_size": _check_rank_files(src),
                                       "layout": "verl-sft",
                                       "uploaded_from": "verl"})
        assert committed is not None  # this process is its own rank 0
        log.info("uploaded verl SFT step %s -> %s (%d objects)", src, committed.uri,
                 len(committed.files))
        return committed
    checked = {r: _check_role(src / r) for r in roles}
    shared = {DATA: (src / DATA).read_bytes()} if (src / DATA).is_file() else {}
    if not shared:
        log.warning("%s has no %s: a resume restarts the dataloader (as verl does)", src, DATA)

    def saver(role: str) -> Any:
        return lambda uri: multipart.save(
            open_store(uri, storage_options), role_parts(src / role, files_under(src / role)),
            step=step, kind=ROLE_KIND,
            metadata={"world_size": checked[role][0], "layout": checked[role][1]})

    committed = multipart.drive(store, [(role, saver(role)) for role in roles], shared,
                                step=step, kind=KIND, metadata={
                                    "roles": roles,
                                    "uploaded_from": "verl"})
    log.info("uploaded verl step %s -> %s (%d objects)", src, committed.uri,
             len(committed.files))
    return committed


def download_step(step_uri: str, local_root: str | os.PathLike, *,
                  storage_options: Mapping[str, Any] | None = None) -> Path:
    """Bring the committed step at ``step_uri`` into ``local_root/global_step_N`` and
    point verl's tracker there at it, unless the tracker names a newer step."""
    ckpt = open_step(step_uri, storage_options, kinds=STEP_KINDS)
    step = parse_step(ckpt.uri)
    root = Path(local_root)
    out = download(ckpt, root / step_name(step))
    tracker = root / TRACKER
    current = tracker.read_text().strip() if tracker.is_file() else ""
    if not current.isdigit() or int(current) < step:
        tmp = tracker.with_suffix(".tmp")
        tmp.write_text(str(step))
        os.replace(tmp, tracker)
    log.info("downloaded verl step %d into %s", step, out)
    return out
