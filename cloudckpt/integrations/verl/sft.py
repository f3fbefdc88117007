"""verl's SFT trainer on a bucket: what ``CheckpointHandler.save_checkpoint`` and
``load_checkpoint`` do (``verl/utils/checkpoint/checkpoint_handler.py``) when
``trainer.default_local_dir`` is a bucket URI, or ``default_hdfs_dir`` is one beside a
local ``default_local_dir``.

verl's handler runs on every rank (torchrun): the engine saves its checkpoint
manager's files into ``global_step_N``, each data-parallel source rank writes
``data_{dp_rank}.pt``, rank 0 the LoRA metadata and the tracker. Bound, the same
files are written into a staging directory (or verl's local ``default_local_dir``,
which keeps verl's own local retention), then every rank takes part in one commit
of ``{root}/global_step_N`` (kind :data:`~.layout.SFT_KIND`). Only then does rank 0
write the tracker and apply ``max_ckpt_to_keep`` to whole committed steps. A crash
before the commit leaves no step to resume.

A load resolves the step among committed ones on rank 0 (one listing); every rank
checks the step (its kind, the step its manifest names) and reads its own
``data_{dp_rank}.pt`` with ``weights_only=True`` before anything is applied; then the
engine loads its own files (the bound manager: each rank reads only its own, checked
before it applies any), and the dataloader its state.
"""

from __future__ import annotations

import io
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cloudckpt.core import blobs
from cloudckpt.core.blobs import BlobArea
from cloudckpt.core.checkpoint import Checkpoint
from cloudckpt.core.profiles import PROFILE_KEY
from cloudckpt.core.retention import Managed, apply_retention
from cloudckpt.errors import ConfigError
from cloudckpt.integrations.verl import profile
from cloudckpt.integrations.verl.layout import (
    LORA_META,
    SFT_DATA,
    SFT_KIND,
    STEP_RE,
    parse_step,
    step_name,
)
from cloudckpt.integrations.verl.resume import open_step, resolve, run_root
from cloudckpt.integrations.verl.trainer import kept, write_tracker
from cloudckpt.integrations.verl.workers import files_under, role_parts
from cloudckpt.runtime import coordination as coord
from cloudckpt.serialization.torchload import numpy_rng_allowed, safe_torch_load
from cloudckpt.storage import Store, is_remote, open_store
from cloudckpt.training import multipart
from cloudckpt.training.staging import staging_dir

log = logging.getLogger(__name__)


def handler_root(handler: Any) -> str | None:
    """The bucket root of a ``CheckpointHandler`` (None: a local run, verl's own)."""
    return run_root(handler.default_local_dir, handler.default_hdfs_dir)


def _require_spmd(handler: Any) -> None:
    if getattr(handler.mode, "name", None) != "SPMD":
        raise ConfigError(
            f"verl's CheckpointHandler in {handler.mode} mode (the Ray SFT trainer) cannot "
            "save to or resume from a bucket with cloudckpt; run the torchrun SFT trainer "
            "(verl.trainer.sft_trainer), or keep trainer.default_local_dir local")


def save_step(handler: Any, step: int) -> Checkpoint | None:
    """``CheckpointHandler.save_checkpoint(step)`` for a bucket root; call on every
    rank. Returns the committed step on rank 0, None elsewhere."""
    _require_spmd(handler)
    root = handler_root(handler)
    assert root is not None
    root_store = open_store(root)
    name = step_name(step)
    if is_remote(handler.default_local_dir):
        with staging_dir() as stage:
            committed = _commit(handler, step, root_store.child(name), stage, local=False)
        local_root = None
    else:
        local_root = str(handler.default_local_dir)
        committed = _commit(handler, step, root_store.child(name), Path(local_root) / name,
                            local=True)

    def after_commit() -> None:  # the tracker is never ahead of a committed step
        write_tracker(root_store, step, local_root)
        apply_retention(root_store, kept(handler.max_ckpt_to_keep),
                        number=Managed(SFT_KIND, STEP_RE), keep=name)

    coord.on_coordinator(after_commit, share=False)
    if committed is not None:
        log.info("verl SFT step %d committed at %s (%d files)", step, committed.uri,
                 len(committed.files))
    return committed


def _commit(handler: Any, step: int, store: Store, target: Path, *, local: bool
            ) -> Checkpoint | None:
    """verl's files of one step written into ``target`` (the engine's, the dataloader
    state, the LoRA metadata), then committed at ``store`` by every rank. ``local``:
    ``target`` is verl's own local copy (its retention applies; of its files, only
    this save's go up), else a fresh staging directory."""
    started = time.time()
    handler.engine.save_checkpoint(local_path=str(target), global_step=step,
                                   max_ckpt_to_keep=handler.max_ckpt_to_keep if local else None)
    coord.each_rank(lambda: _write_own(handler, target))
    select = files_under(target, started) if local else None
    meta: dict[str, Any] = {"world_size": coord.world_size(), "layout": "verl-sft"}
    manager = getattr(handler.engine, "checkpoint_manager", None)
    if manager is not None:  # what the engine's checkpoint manager saved of the state
        meta[PROFILE_KEY] = profile.saved(manager).record()
    area = BlobArea.above(store, 1) if blobs.requested(None) else None  # $CLOUDCKPT_INCREMENTAL
    return multipart.save(store, role_parts(target, select, area), step=step, kind=SFT_KIND,
                          metadata=meta, blobs=area)


def _write_own(handler: Any, target: Path) -> None:
    """What verl's handler writes beside the engine's files, where it writes them."""
    if handler.rank == 0 and handler.lora_train_meta is not None:
        target.mkdir(parents=True, exist_ok=True)
        (target / LORA_META).write_text(json.dumps(handler.lora_train_meta,
                                                   ensure_ascii=False, indent=4))
    if handler.is_mp_src_rank_with_outputs:
        import torch

        target.mkdir(parents=True, exist_ok=True)
        torch.save(handler.train_dataloader.state_dict(),
                   target / SFT_DATA.format(dp_rank=handler.dp_rank))


def load(handler: Any, own_load: Callable[[Any], int]) -> int:
    """``CheckpointHandler.load_checkpoint()``: from the bucket where the run's root or
    ``resume_from_path`` is one, else verl's own. Returns the resumed step (0: none)."""
    root = handler_root(handler)
    if root is None and not is_remote(handler.resume_from_path):
        return own_load(handler)
    _require_spmd(handler)
    uri = coord.on_coordinator(lambda: resolve(
        handler.resume_mode, handler.resume_from_path, root, kinds=(SFT_KIND,),
        auto_takes_path=True))
    if uri is None:
        return 0
    # Checked on every rank before anything is applied: the step's kind and number (one
    # copied under a newer name is refused), and this rank's dataloader state read.
    data = coord.checked(lambda: _data_state(handler, open_step(uri, kinds=(SFT_KIND,))))
    step = parse_step(uri)
    log.info("resuming verl SFT step %d from %s", step, uri)
    handler.engine.load_checkpoint(uri)  # the bound manager: this rank's own files, checked
    if data is not None:
        handler.train_dataloader.load_state_dict(data)
    handler.resume_global_step = step
    return step


def _data_state(handler: Any, ckpt: Checkpoint) -> Any:
    """This rank's ``data_{dp_rank}.pt``, read and decoded (None: the step has none)."""
    key = SFT_DATA.format(dp_rank=handler.dp_rank)
    if key not in ckpt.manifest.files:
        log.warning("%s holds no %s: the dataloader starts from scratch", ckpt.uri, key)
        return None
    with numpy_rng_allowed():
        return safe_torch_load(io.BytesIO(ckpt.read(key)), f"{ckpt.uri}/{key}")
