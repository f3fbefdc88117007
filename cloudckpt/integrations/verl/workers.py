"""verl's checkpoint managers on a bucket: what ``FSDPCheckpointManager.
save_checkpoint`` / ``load_checkpoint`` do (``verl/utils/checkpoint/
fsdp_checkpoint_manager.py``) for a role directory that is a bucket URI, and the
Megatron manager's local-staging path.

A save runs verl's own ``save_checkpoint`` into a local directory (a staging one, or
verl's ``default_local_dir`` when the bucket is ``default_hdfs_dir``), then every
rank of the role's workers takes part in one upload that commits the directory as
the role's part (``.../global_step_N/actor``, kind
:data:`~cloudckpt.integrations.verl.layout.ROLE_KIND`); a ``huggingface/`` folder
holding the model (``hf_model`` in ``save_contents``) is committed inside it as an HF
export of its own, which ``cloudckpt push`` takes. The part records its save profile
(:mod:`.profile`). A crash before the commit leaves no committed part, so nothing
resumes it.

An FSDP load reads only the rank's own three files, loads them with
``weights_only=True`` (verl's own loader uses ``weights_only=False``), and applies
them as verl does. A Megatron load (:func:`load_staged`) downloads the part once per
host into a staging directory and runs verl's own load there: its ``dist_ckpt``
shards are read by whichever ranks the load's sharding needs.
"""

from __future__ import annotations

import io
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from cloudckpt.core import blobs, kinds
from cloudckpt.core.blobs import BlobArea
from cloudckpt.core.checkpoint import Checkpoint, CheckpointWriter, open_checkpoint
from cloudckpt.core.expected import expect_kind, expect_step, expect_world_size
from cloudckpt.core.profiles import PROFILE_KEY
from cloudckpt.errors import ConfigError, CorruptCheckpointError, IncompleteCheckpointError
from cloudckpt.integrations.verl import profile
from cloudckpt.integrations.verl.layout import (
    FSDP_LAYOUT,
    HF_DIR,
    MEGATRON_LAYOUT,
    ROLE_KIND,
    SFT_KIND,
    rank_file,
    rank_file_world,
    step_named,
    step_of_role,
)
from cloudckpt.names import MANIFEST_NAME
from cloudckpt.runtime import coordination as coord
from cloudckpt.serialization.torchload import numpy_rng_allowed, safe_torch_load
from cloudckpt.storage import Store, is_remote, open_store
from cloudckpt.training import multipart
from cloudckpt.training.staging import LocalFiles, download_dir, staging_dir, upload_dir

log = logging.getLogger(__name__)

def files_under(root: str | Path, since: float | None = None) -> set[str]:
    """The files below ``root`` as relative paths, but the manifests of an earlier
    download; with ``since``, only those modified at or after it (this save's: a local
    role directory may hold older files of another world size)."""
    base = Path(root)
    slack = 2.0  # timestamps of some file systems are coarse
    return {p.relative_to(base).as_posix() for p in base.rglob("*")
            if p.is_file() and p.name != MANIFEST_NAME
            and (since is None or p.stat().st_mtime >= since - slack)}


def save_manager(own_save: Callable[..., None], manager: Any, local_path: str,
                 hdfs_path: str | None, global_step: int, max_ckpt_to_keep: int | None, *,
                 layout: str) -> Checkpoint | None:
    """A manager's ``save_checkpoint`` where a path is a bucket URI: ``local_path``
    itself (staged), or ``hdfs_path`` beside a local ``local_path`` (verl's own copy)."""
    if is_remote(local_path):
        return save_role(own_save, manager, local_path, global_step, layout=layout)
    return save_role(own_save, manager, str(hdfs_path), global_step, local_path=local_path,
                     max_ckpt_to_keep=max_ckpt_to_keep, layout=layout)


def save_role(own_save: Callable[..., None], manager: Any, uri: str, global_step: int, *,
              local_path: str | None = None, max_ckpt_to_keep: int | None = None,
              layout: str = FSDP_LAYOUT) -> Checkpoint | None:
    """Commit one role's save at ``uri`` (a bucket URI); call on every rank of the
    role's workers. ``own_save`` is verl's ``save_checkpoint``: it writes the files
    into ``local_path`` (with verl's own local retention, ``max_ckpt_to_keep``), or
    into a staging directory when there is none. Returns the part on rank 0."""
    uri = uri.rstrip("/")
    step = step_of_role(uri)
    meta = {"world_size": manager.world_size, "layout": layout,
            "contents": sorted(manager.checkpoint_save_contents),
            PROFILE_KEY: profile.saved(manager).record()}
    options: dict[str, Any] = {"step": global_step if step is None else step, "kind": ROLE_KIND,
               "metadata": meta}
    store = open_store(uri)
    # Saved incrementally, every file is a blob of the area beside the steps.
    area = BlobArea.above(store, 2) if step is not None and blobs.requested(None) else None
    if local_path is None:
        with staging_dir() as stage:
            own_save(manager, str(stage), None, global_step, None)
            committed = multipart.save(store, role_parts(stage, None, area), blobs=area,
                                       **options)
    else:
        started = time.time()
        own_save(manager, local_path, None, global_step, max_ckpt_to_keep)
        committed = multipart.save(store, role_parts(Path(local_path),
                                                     files_under(local_path, started), area),
                                   blobs=area, **options)
    if committed is not None:
        log.info("committed verl role %s (%d files, world size %d)", committed.uri,
                 len(committed.files), manager.world_size)
    return committed


def role_parts(root: Path, select: set[str] | None = None,
               area: BlobArea | None = None) -> list[Any]:
    """A role's files as parts: its ``huggingface/`` folder an HF export committed on
    its own when verl saved the model there (``hf_model``), so ``push`` takes it;
    with ``area``, each file a blob of it."""
    hf = root / HF_DIR
    if not any(_is_weight(p.name) for p in (hf.iterdir() if hf.is_dir() else ())):
        return [LocalFiles(root, select, area)]
    rest = {f for f in (select if select is not None else files_under(root))
            if not f.startswith(f"{HF_DIR}/")}
    inner = None if select is None else {f.removeprefix(f"{HF_DIR}/") for f in select
                                         if f.startswith(f"{HF_DIR}/")}
    return [LocalFiles(root, rest, area), _Export(hf, inner, area)]


def _is_weight(name: str) -> bool:
    return name.endswith(".safetensors") or (name.startswith("pytorch_model")
                                             and name.endswith(".bin"))


@dataclass
class _Export:
    """A :class:`~cloudckpt.training.multipart.Part`: verl's ``huggingface/`` folder,
    committed below the role as an HF export (kind ``hf``)."""

    root: Path
    select: set[str] | None
    blobs: BlobArea | None = None

    def write(self, store: Store, group: Any) -> None:
        upload_dir(self.root, store.child(HF_DIR), group=group, select=self.select,
                   kind=kinds.HF, blobs=self.blobs)

    def commit(self, writer: CheckpointWriter, written: None) -> None:
        writer.add_part(HF_DIR)


#: What holds one checkpoint manager's files: a PPO role part, an SFT step.
MANAGER_KINDS = (ROLE_KIND, SFT_KIND)


def open_role(uri: str, world_size: int | None = None) -> Checkpoint:
    """A committed role part (or SFT step), its manifest's step the one its name says;
    with ``world_size``, refused unless it was saved by as many ranks (verl's per-rank
    files cannot be resharded)."""
    uri = uri.rstrip("/")
    try:
        ckpt = open_checkpoint(uri)
    except IncompleteCheckpointError as exc:
        raise IncompleteCheckpointError(
            f"{uri} is not a committed verl role part ({exc}); resume from a committed "
            "step (resume_mode: auto finds the newest)") from exc
    expect_kind(ckpt, MANAGER_KINDS, "a verl role part or SFT step")
    expect_step(ckpt, step_of_role(uri) if ckpt.manifest.kind == ROLE_KIND
                else step_named(uri))
    if ckpt.metadata.get("layout") == MEGATRON_LAYOUT:
        return ckpt  # verl's Megatron load reshards its dist_ckpt
    if world_size is not None:
        expect_world_size(ckpt.uri, saved_world_size(ckpt), world_size,
                          holds="verl's per-rank model, optimizer and extra state files",
                          otherwise=" (verl's files cannot be resharded)")
    return ckpt


def saved_world_size(ckpt: Checkpoint) -> int:
    """The world size a role part was saved by (its metadata, else its file names)."""
    world = ckpt.metadata.get("world_size")
    if isinstance(world, int) and world > 0:
        return world
    worlds = {w for f in ckpt.files if (w := rank_file_world(f)) is not None}
    if len(worlds) != 1:
        raise CorruptCheckpointError(f"{ckpt.uri}: cannot tell the world size it was saved "
                                     f"by (rank files of sizes {sorted(worlds)})")
    return worlds.pop()


def load_staged(own_load: Callable[..., None], manager: Any, uri: str) -> Checkpoint:
    """Load the role part at ``uri`` with verl's own ``load_checkpoint`` (``own_load``)
    from a copy downloaded once per host into a staging directory, removed afterwards;
    call on every rank. A failure on any rank raises on every rank."""
    ckpt = open_role(uri)
    fresh = coord.checked(lambda: profile.check_load(ckpt.uri, ckpt.metadata,
                                                     manager.checkpoint_load_contents))
    with staging_dir() as stage, _loading_less(manager, fresh):
        download_dir(ckpt, stage)
        coord.each_rank(lambda: own_load(manager, str(stage), None, False))
    log.info("rank %d loaded verl's %s from %s", manager.rank, MEGATRON_LAYOUT, ckpt.uri)
    return ckpt


@contextmanager
def _loading_less(manager: Any, fresh: set[str]) -> Iterator[None]:
    """verl's load with ``load_contents`` leaving out what starts ``fresh`` (a partial
    resume allowed), as its own option would."""
    if not fresh:
        yield
        return
    contents = manager.checkpoint_load_contents
    manager.checkpoint_load_contents = profile.narrowed(contents, fresh)
    try:
        yield
    finally:
        manager.checkpoint_load_contents = contents


def _read_state(ckpt: Checkpoint, key: str, setting: str) -> Any:
    if key not in ckpt.manifest.files:
        raise ConfigError(f"{ckpt.uri} has no {key}: it was saved without it; leave "
                          f"{setting!r} out of checkpoint.load_contents to resume without it")
    with numpy_rng_allowed():
        return safe_torch_load(io.BytesIO(ckpt.read(key)), f"{ckpt.uri}/{key}")


def load_role(module: ModuleType, manager: Any, uri: str) -> Checkpoint:
    """Load this rank's files of the role part at ``uri`` into verl's manager, as its
    ``load_checkpoint`` does (``module`` is verl's ``fsdp_checkpoint_manager``);
    call on every rank. A failure on any rank raises on every rank."""

    loaded: list[Checkpoint] = []
    coord.each_rank(lambda: loaded.append(_load_mine(module, manager, uri)))
    return loaded[0]


def _load_mine(module: ModuleType, manager: Any, uri: str) -> Checkpoint:
    ckpt = open_role(uri, manager.world_size)
    world, rank = manager.world_size, manager.rank
    fresh = profile.check_load(ckpt.uri, ckpt.metadata, manager.checkpoint_load_contents)
    with _loading_less(manager, fresh):
        return _apply_mine(module, manager, ckpt, world, rank)


def _apply_mine(module: ModuleType, manager: Any, ckpt: Checkpoint, world: int,
                rank: int) -> Checkpoint:
    if manager.should_load_model:
        assert manager.model is not None, "model must be provided to load 'model'"
    if manager.should_load_optimizer:
        assert manager.optimizer is not None, "optimizer must be provided to load 'optimizer'"
    # Every file this load applies is read, checked and decoded before any is applied:
    # one missing or corrupt leaves the model, optimizer, scheduler and RNG as they were.
    # (verl's own load holds the model's state and the optimizer's at once too.)
    model = _read_state(ckpt, rank_file("model", world, rank), "model") \
        if manager.should_load_model else None
    optim = _read_state(ckpt, rank_file("optimizer", world, rank), "optimizer") \
        if manager.should_load_optimizer else None
    extra = _read_state(ckpt, rank_file("extra", world, rank), "extra") \
        if manager.should_load_extra else None
    offload = bool(module.is_cuda_available)
    model_cfg = (module.ShardedStateDictConfig(offload_to_cpu=offload)
                 if manager.should_load_model else None)
    optim_cfg = (module.ShardedOptimStateDictConfig(offload_to_cpu=offload)
                 if manager.should_load_optimizer else None)
    with module.get_fsdp_state_ctx(manager.model, module.StateDictType.SHARDED_STATE_DICT,
                                   model_cfg, optim_cfg):
        if model is not None:
            if manager.is_lora_only_state_dict(model):
                result = manager.model.load_state_dict(model, strict=False)
                if result is not None and result.unexpected_keys:
                    raise ConfigError(f"{ckpt.uri}: the LoRA-only checkpoint has keys this "
                                      f"model lacks: {result.unexpected_keys[:5]}; configure "
                                      "the same LoRA adapters as the run that saved it")
            else:
                manager.model.load_state_dict(model)
        if optim is not None:
            manager.optimizer.load_state_dict(manager._backfill_optimizer_state(optim))
    if extra is not None:
        if "rng" in extra:
            manager.load_rng_state(extra["rng"])
        scheduler = extra.get("lr_scheduler")
        if scheduler is not None and manager.lr_scheduler is not None:
            manager.lr_scheduler.load_state_dict(scheduler)
    log.info("rank %d loaded its verl files of %s", rank, ckpt.uri)
    return ckpt
