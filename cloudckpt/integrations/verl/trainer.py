"""verl's PPO trainer on a bucket: what ``RayPPOTrainer._save_checkpoint`` and
``_load_checkpoint`` do (``verl/trainer/ppo/ray_trainer.py``) when the run's root is a
bucket URI: ``trainer.default_local_dir`` itself, or ``trainer.default_hdfs_dir``
beside a local ``default_local_dir``.

A step is one committed checkpoint ``{root}/global_step_N`` (kind ``verl``): the driver
claims it, verl's workers commit their roles below it (``actor/``, ``critic/``:
:mod:`.workers`), then the driver adds them and ``data.pt`` and commits. Only then is
``latest_checkpointed_iteration.txt`` written (async or not), and then verl's
retention runs over whole committed steps. A crash before the commit leaves no step,
so ``resume_mode: auto`` never resumes a torn one.
"""

from __future__ import annotations

import io
import logging
import os
from collections.abc import Callable
from typing import Any

from cloudckpt.core.checkpoint import Checkpoint
from cloudckpt.core.retention import Managed, apply_retention
from cloudckpt.errors import ConfigError
from cloudckpt.integrations.verl import profile
from cloudckpt.integrations.verl.layout import (
    ACTOR,
    DATA,
    DEFAULT_CONTENTS,
    KIND,
    STEP_RE,
    TRACKER,
    parse_step,
    step_name,
)
from cloudckpt.integrations.verl.paths import refuse_unplaced
from cloudckpt.integrations.verl.resume import open_step, run_root
from cloudckpt.integrations.verl.resume import resolve as _resolve
from cloudckpt.integrations.verl.workers import open_role
from cloudckpt.serialization.torchload import numpy_rng_allowed, safe_torch_load, torch_bytes
from cloudckpt.storage import Store, is_remote, open_store
from cloudckpt.training import multipart

log = logging.getLogger(__name__)


def bucket_root(trainer_config: Any) -> str | None:
    """The run's bucket root (:func:`~.resume.run_root` of its ``trainer`` config)."""
    return run_root(trainer_config.get("default_local_dir"),
                    trainer_config.get("default_hdfs_dir"))


def _count(trainer_config: Any, key: str) -> Any:
    """verl's count for one role (``max_actor_ckpt_to_keep``, ``max_critic_...``), 1
    under its deprecated ``remove_previous_ckpt_in_save``."""
    if trainer_config.get("remove_previous_ckpt_in_save", False):
        return 1
    return trainer_config.get(key, None)


def keep_last(trainer_config: Any, use_critic: bool) -> int | None:
    """How many newest committed steps verl's counts keep: a step stays while either
    ``max_actor_ckpt_to_keep`` or ``max_critic_ckpt_to_keep`` keeps it (None: all)."""
    counts = [_count(trainer_config, "max_actor_ckpt_to_keep")]
    if use_critic:
        counts.append(_count(trainer_config, "max_critic_ckpt_to_keep"))
    if any(kept(c) is None for c in counts):
        return None  # a role that keeps everything keeps every step
    return max(counts)


def kept(count: Any) -> int | None:
    """How many steps one of verl's ``max_*_ckpt_to_keep`` keeps (None: all, as verl
    reads a missing, zero or negative count)."""
    return count if isinstance(count, int) and count > 0 else None


def _roles(trainer: Any, critic_dir: str) -> list[tuple[str, Any]]:
    roles = [(ACTOR, trainer.actor_rollout_wg)]
    if trainer.use_critic:
        roles.append((critic_dir, trainer.critic_wg))
    return roles


def save_step(trainer: Any, critic_dir: str) -> Checkpoint:
    """``_save_checkpoint`` for a bucket root: verl's worker calls, in verl's order,
    inside one committed step; then the tracker, then retention."""
    config = trainer.config.trainer
    root = bucket_root(config)
    assert root is not None
    step = int(trainer.global_steps)
    root_store = open_store(root)
    store = root_store.child(step_name(step))
    roles = _roles(trainer, critic_dir)
    local = None if is_remote(config.default_local_dir) else \
        os.path.join(config.default_local_dir, step_name(step))
    meta = {"roles": [name for name, _ in roles]}

    def saver(name: str, group: Any) -> Any:  # every worker of the role commits its part
        if local is None:
            return lambda uri: group.save_checkpoint(uri, None, step, max_ckpt_to_keep=None)
        # verl's local copy stays complete, with its own local retention
        return lambda uri: group.save_checkpoint(
            os.path.join(local, name), uri, step,
            max_ckpt_to_keep=_local_keep(config, name, critic_dir))

    def data() -> bytes:
        blob = torch_bytes(trainer.train_dataloader.state_dict())
        if local is not None:
            os.makedirs(local, exist_ok=True)
            with open(os.path.join(local, DATA), "wb") as f:
                f.write(blob)
        return blob

    committed = multipart.drive(store, [(name, saver(name, group)) for name, group in roles],
                                {DATA: data}, step=step, kind=KIND, metadata=meta)
    log.info("verl step %d committed at %s", step, committed.uri)
    write_tracker(root_store, step, None if local is None else config.default_local_dir)
    keep = keep_last(config, trainer.use_critic)
    apply_retention(root_store, keep, number=Managed(KIND, STEP_RE),
                    keep=step_name(step))
    return committed


def sync_only(trainer: Any) -> None:
    """verl's v1 trainer keeps its TransferQueue's state in local files beside the step
    in its asynchronous modes: refused on a bucket, naming the setting."""
    mode = getattr(trainer, "trainer_mode", "sync")
    if mode != "sync":
        raise ConfigError(f"verl's trainer.v1.trainer_mode: {mode} saves its TransferQueue "
                          "state as local files in each step, which cloudckpt does not commit: "
                          "set trainer.v1.trainer_mode=sync for a bucket "
                          "trainer.default_local_dir, or keep it local")


def _local_keep(config: Any, role: str, critic_dir: str) -> Any:
    """verl's count for a role's local copies (``default_local_dir``)."""
    return _count(config, "max_critic_ckpt_to_keep" if role == critic_dir
                  else "max_actor_ckpt_to_keep")


def write_tracker(root: Store, step: int, local_root: str | None) -> None:
    """verl's tracker, after the commit: never ahead of a committed step."""
    root.put(TRACKER, str(step).encode())
    if local_root is not None:  # verl's own, for its local copy (tmp + rename)
        path = os.path.join(local_root, TRACKER)
        with open(path + ".tmp", "w") as f:
            f.write(str(step))
        os.replace(path + ".tmp", path)


def resolve(trainer: Any) -> str | None:
    """The committed step ``trainer.resume_mode`` resumes (None: a fresh start)."""
    config = trainer.config.trainer
    return _resolve(config.resume_mode, config.get("resume_from_path"), bucket_root(config))


def load_step(trainer: Any, critic_dir: str, step_uri: str) -> None:
    """``_load_checkpoint`` from a committed step: each role's workers' own files, then
    ``data.pt`` into the dataloader (as verl does), then the step number. Every role
    part is checked (kind, step, world size, its save profile against the role's
    ``load_contents``: :mod:`.profile`) and ``data.pt`` read before any is loaded."""
    config = trainer.config.trainer
    ckpt = open_step(step_uri)
    step = parse_step(ckpt.uri)
    roles = [(open_role(ckpt.store.child(name).uri, getattr(group, "world_size", None)), group)
             for name, group in _roles(trainer, critic_dir)]
    for (name, _), (role, _) in zip(_roles(trainer, critic_dir), roles, strict=True):
        contents, key = _load_contents(trainer.config, name == critic_dir)
        profile.check_load(role.uri, role.metadata, contents, key)
    data = _data_state(trainer, ckpt, step)
    log.info("resuming verl step %d from %s", step, ckpt.uri)
    for role, group in roles:
        group.load_checkpoint(role.uri, del_local_after_load=config.del_local_ckpt_after_load)
    if data is not None:
        trainer.train_dataloader.load_state_dict(data)
    trainer.global_steps = step


def _load_contents(config: Any, critic: bool) -> tuple[list[str], str]:
    """A role's ``checkpoint.load_contents`` (verl's default where unset) and its key."""
    path = ("critic", "checkpoint") if critic else ("actor_rollout_ref", "actor", "checkpoint")
    node = config
    for key in path:
        node = node.get(key) if node is not None else None
    contents = node.get("load_contents") if node is not None else None
    return (list(DEFAULT_CONTENTS) if contents is None else [str(c) for c in contents],
            ".".join((*path, "load_contents")))


def _data_state(trainer: Any, ckpt: Checkpoint, step: int) -> Any:
    """``data.pt`` read and decoded, or None where verl's dataloader starts afresh."""
    if DATA not in ckpt.manifest.files:
        log.warning("%s holds no %s: the dataloader starts from scratch", ckpt.uri, DATA)
        return None
    per_epoch = len(trainer.train_dataloader)
    if per_epoch > 0 and step % per_epoch == 0:
        log.info("step %d is at an epoch boundary: the dataloader starts the next epoch "
                 "from scratch, as verl does", step)
        return None
    with numpy_rng_allowed():
        return safe_torch_load(io.BytesIO(ckpt.read(DATA)), f"{ckpt.uri}/{DATA}")


def load(trainer: Any, critic_dir: str, own_load: Callable[[Any], Any]) -> Any:
    """``_load_checkpoint``: from the bucket where the run's root or the resumed path
    is one, else verl's own. First, as the trainer starts, a bucket URI at a key verl
    writes with local file calls is refused (:mod:`.paths`)."""
    refuse_unplaced(trainer.config)
    config = trainer.config.trainer
    if bucket_root(config) is None and not (config.resume_mode == "resume_path"
                                            and is_remote(config.get("resume_from_path"))):
        return own_load(trainer)
    sync_only(trainer)
    uri = resolve(trainer)
    if uri is None:
        return 0
    load_step(trainer, critic_dir, uri)
    return None
