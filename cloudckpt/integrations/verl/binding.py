"""What activation binds into verl, each for a bucket URI only (a local run goes
through verl's own code, unchanged):

- ``FSDPCheckpointManager.save_checkpoint`` / ``load_checkpoint`` (its workers'
  checkpoint I/O) commit and load a role part (:mod:`.workers`);
- ``RayPPOTrainer._save_checkpoint`` commits the step (the roles, ``data.pt``), then
  writes the tracker and applies retention; ``_load_checkpoint`` resumes a committed
  step (:mod:`.trainer`).
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

from cloudckpt.storage import is_remote


def bind_fsdp_manager(module: ModuleType) -> tuple[str, ...]:
    """Wrap ``verl.utils.checkpoint.fsdp_checkpoint_manager.FSDPCheckpointManager``."""
    cls = module.FSDPCheckpointManager
    own_save, own_load = cls.save_checkpoint, cls.load_checkpoint

    @functools.wraps(own_save)
    def save_checkpoint(self: Any, local_path: str, hdfs_path: str | None = None,
                        global_step: int = 0, max_ckpt_to_keep: int | None = None) -> None:
        if local_path is None or not (is_remote(local_path) or is_remote(hdfs_path)):
            return own_save(self, local_path, hdfs_path, global_step, max_ckpt_to_keep)
        from cloudckpt.integrations.verl.workers import save_role

        if is_remote(local_path):
            save_role(own_save, self, local_path, global_step)
        else:
            save_role(own_save, self, str(hdfs_path), global_step, local_path=local_path,
                      max_ckpt_to_keep=max_ckpt_to_keep)
        return None

    @functools.wraps(own_load)
    def load_checkpoint(self: Any, local_path: str, hdfs_path: str | None = None,
                        del_local_after_load: bool = False) -> None:
        if not is_remote(local_path):
            return own_load(self, local_path, hdfs_path, del_local_after_load)
        from cloudckpt.integrations.verl.workers import load_role

        load_role(module, self, local_path)  # nothing is stored locally to delete
        return None

    cls.save_checkpoint = save_checkpoint
    cls.load_checkpoint = load_checkpoint
    return ("FSDPCheckpointManager.save_checkpoint", "FSDPCheckpointManager.load_checkpoint")


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
