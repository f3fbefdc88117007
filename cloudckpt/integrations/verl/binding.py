"""What activation binds into verl, each for a bucket URI only (a local run goes
through verl's own code, unchanged):

- ``FSDPCheckpointManager.save_checkpoint`` / ``load_checkpoint`` (its workers'
  checkpoint I/O) commit and load a role part (:mod:`.workers`);
- ``MegatronCheckpointManager.save_checkpoint`` / ``load_checkpoint`` likewise, by
  local staging: verl's own save and load run on a local directory, which is
  uploaded and committed, or downloaded (:func:`.workers.load_staged`);
- ``RayPPOTrainer._save_checkpoint`` commits the step (the roles, ``data.pt``), then
  writes the tracker and applies retention; ``_load_checkpoint`` resumes a committed
  step (:mod:`.trainer`); the v1 ``PPOTrainer`` (``main_ppo``'s default) the same;
- the SFT trainer's ``CheckpointHandler.save_checkpoint`` / ``load_checkpoint`` do the
  same for its steps, on every rank (:mod:`.sft`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType
from typing import Any

from cloudckpt.errors import ConfigError
from cloudckpt.storage import is_remote


def bind_fsdp_manager(module: ModuleType) -> tuple[str, ...]:
    """Wrap ``verl.utils.checkpoint.fsdp_checkpoint_manager.FSDPCheckpointManager``."""

    def save(own_save: Any, manager: Any, *args: Any) -> None:
        from cloudckpt.integrations.verl.layout import FSDP_LAYOUT
        from cloudckpt.integrations.verl.workers import save_manager

        save_manager(own_save, manager, *args, layout=FSDP_LAYOUT)

    def load(own_load: Any, manager: Any, uri: str) -> None:
        from cloudckpt.integrations.verl.workers import load_role

        load_role(module, manager, uri)  # nothing is stored locally to delete

    return _wrap_manager(module.FSDPCheckpointManager, save, load)


def bind_megatron_manager(module: ModuleType) -> tuple[str, ...]:
    """Wrap ``verl.utils.checkpoint.megatron_checkpoint_manager.MegatronCheckpointManager``
    (its own save and load run on local staging directories)."""

    def save(own_save: Any, manager: Any, *args: Any) -> None:
        from cloudckpt.integrations.verl.layout import MEGATRON_LAYOUT
        from cloudckpt.integrations.verl.workers import save_manager

        if getattr(manager.checkpoint_config, "async_save", False):
            raise ConfigError(
                "verl's Megatron async_save cannot save to a bucket with cloudckpt: its "
                "files are uploaded once written, so set actor_rollout_ref.actor.checkpoint."
                "async_save: false (and the critic's), or keep the checkpoint dirs local")
        save_manager(own_save, manager, *args, layout=MEGATRON_LAYOUT)

    def load(own_load: Any, manager: Any, uri: str) -> None:
        from cloudckpt.integrations.verl.workers import load_staged

        load_staged(own_load, manager, uri)  # the staging copy is removed afterwards

    return _wrap_manager(module.MegatronCheckpointManager, save, load)


def _wrap_manager(cls: type[Any], save: Callable[..., None], load: Callable[..., None]
                  ) -> tuple[str, ...]:
    """Route a verl checkpoint manager's ``save_checkpoint`` / ``load_checkpoint`` to
    ``save(own_save, manager, local_path, hdfs_path, global_step, max_ckpt_to_keep)`` /
    ``load(own_load, manager, uri)`` when a path is a bucket URI; verl's own otherwise."""
    own_save, own_load = cls.save_checkpoint, cls.load_checkpoint

    @functools.wraps(own_save)
    def save_checkpoint(self: Any, local_path: str, hdfs_path: str | None = None,
                        global_step: int = 0, max_ckpt_to_keep: int | None = None) -> None:
        if local_path is None or not (is_remote(local_path) or is_remote(hdfs_path)):
            return own_save(self, local_path, hdfs_path, global_step, max_ckpt_to_keep)
        save(own_save, self, local_path, hdfs_path, global_step, max_ckpt_to_keep)
        return None

    @functools.wraps(own_load)
    def load_checkpoint(self: Any, local_path: str, hdfs_path: str | None = None,
                        del_local_after_load: bool = False) -> None:
        if not is_remote(local_path):
            return own_load(self, local_path, hdfs_path, del_local_after_load)
        load(own_load, self, local_path)
        return None

    cls.save_checkpoint = save_checkpoint
    cls.load_checkpoint = load_checkpoint
    return (f"{cls.__name__}.save_checkpoint", f"{cls.__name__}.load_checkpoint")


def bind_ppo_trainer(module: ModuleType) -> tuple[str, ...]:
    """Wrap ``verl.trainer.ppo.ray_trainer.RayPPOTrainer``'s save and load."""
    cls = module.RayPPOTrainer
    own_save, own_load = cls._save_checkpoint, cls._load_checkpoint
    critic_dir = str(module.Role.Critic)  # verl's own name of the critic's directory

    @functools.wraps(own_save)
    def _save_checkpoint(self: Any) -> None:
        from cloudckpt.integrations.verl.trainer import bucket_root, save_step

        if bucket_root(self.config.trainer) is None:
            return own_save(self)
        save_step(self, critic_dir)
        return None

    @functools.wraps(own_load)
    def _load_checkpoint(self: Any) -> Any:
        from cloudckpt.integrations.verl.trainer import load

        return load(self, critic_dir, own_load)

    cls._save_checkpoint = _save_checkpoint
    cls._load_checkpoint = _load_checkpoint
    return ("RayPPOTrainer._save_checkpoint", "RayPPOTrainer._load_checkpoint")


def bind_ppo_trainer_v1(module: ModuleType) -> tuple[str, ...]:
    """Wrap ``verl.trainer.ppo.v1.trainer_base.PPOTrainer``'s save and load: the
    trainer ``main_ppo`` runs by default (``trainer.use_v1: true``). Its steps are the
    same as ``RayPPOTrainer``'s; after each commit, verl's ``checkpoint_callback`` is
    told the step's URI."""
    cls = module.PPOTrainer
    own_save, own_load = cls._save_checkpoint, cls._load_checkpoint
    critic_dir = str(module.Role.Critic)

    @functools.wraps(own_save)
    def _save_checkpoint(self: Any) -> None:
        from cloudckpt.integrations.verl.trainer import bucket_root, save_step, sync_only

        if bucket_root(self.config.trainer) is None:
            return own_save(self)
        sync_only(self)
        committed = save_step(self, critic_dir)
        self.checkpoint_callback.on_save(trainer=self, global_step=self.global_steps,
                                         checkpoint_dir=committed.uri, async_save=False)
        return None

    @functools.wraps(own_load)
    def _load_checkpoint(self: Any) -> Any:
        from cloudckpt.integrations.verl.trainer import load

        self.global_steps = 0  # as verl's own, before it looks for a step
        return load(self, critic_dir, own_load)

    cls._save_checkpoint = _save_checkpoint
    cls._load_checkpoint = _load_checkpoint
    return ("PPOTrainer._save_checkpoint", "PPOTrainer._load_checkpoint")


def bind_sft_handler(module: ModuleType) -> tuple[str, ...]:
    """Wrap ``verl.utils.checkpoint.checkpoint_handler.CheckpointHandler``."""
    cls = module.CheckpointHandler
    own_save, own_load = cls.save_checkpoint, cls.load_checkpoint

    @functools.wraps(own_save)
    def save_checkpoint(self: Any, step: int) -> None:
        from cloudckpt.integrations.verl.sft import handler_root, save_step

        if handler_root(self) is None:
            return own_save(self, step)
        save_step(self, step)
        return None

    @functools.wraps(own_load)
    def load_checkpoint(self: Any) -> Any:
        from cloudckpt.integrations.verl.sft import load

        return load(self, own_load)

    cls.save_checkpoint = save_checkpoint
    cls.load_checkpoint = load_checkpoint
    return ("CheckpointHandler.save_checkpoint", "CheckpointHandler.load_checkpoint")
