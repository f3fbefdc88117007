"""What verl's FSDP workers hold, built small enough for CPU: a tiny Qwen2 (config
only, random weights) sharded with FSDP2 on gloo, AdamW, a warm-up LR scheduler, and
verl 0.9.1's own ``FSDPCheckpointManager`` over them; the worker's checkpoint calls
are verl's ``TrainingWorker.save_checkpoint``/``load_checkpoint`` (ONE_TO_ALL, each
calling the manager). Used inside verl's own ``RayWorkerGroup`` (verl_driver.py) and
in plain gloo processes (the crash tests).

``trainer_for`` is verl's ``RayPPOTrainer`` with one such worker in the process, for
the checks that need no Ray. A digest per rank of every tensor of the model shard, the
optimizer state, the LR scheduler and the RNG states is what "bit-exact" is checked on.
"""

from __future__ import annotations

import hashlib
import os
import random
from typing import Any

import numpy as np
import torch


def tiny_model() -> Any:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, tie_word_embeddings=False,
                         architectures=["Qwen2ForCausalLM"])
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config)


class Trainable:
    """One rank's model, optimizer, scheduler and verl's checkpoint manager."""

    def __init__(self, checkpoint_config: dict, lora: bool = False) -> None:
        """``lora``: LoRA adapters (peft) on the attention projections, the rest frozen."""
        import torch.distributed as dist
        from omegaconf import OmegaConf
        from torch.distributed.fsdp import fully_shard
        from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

        if not dist.is_initialized():
            dist.init_process_group("gloo")
        model = tiny_model()
        layers = model.model.layers
        if lora:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8,
                                                     target_modules=["q_proj", "v_proj"]))
        for layer in layers:
            fully_shard(layer)
        fully_shard(model)
        self.model = model
        self.optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                           lr=1e-3)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / 10))
        self.manager = FSDPCheckpointManager(
            model=model, optimizer=self.optimizer, lr_scheduler=self.scheduler,
            processing_class=None, checkpoint_config=OmegaConf.create(checkpoint_config))

    def train(self, steps: int, seed: int) -> None:
        import torch.distributed as dist

        g = torch.Generator().manual_seed(seed * 1000 + dist.get_rank())
        for _ in range(steps):
            ids = torch.randint(0, 96, (2, 12), generator=g)
            loss = self.model(input_ids=ids, labels=ids).loss
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad()
            self.scheduler.step()
        # the RNG states are part of what a resume must bring back
        torch.manual_seed(seed)
        np.random.seed(seed)
        random.seed(seed)

    def digests(self) -> dict[str, str]:
        return {"model": digest(self.model.state_dict()),
                "optimizer": digest(self.optimizer.state_dict()),
                "scheduler": digest(self.scheduler.state_dict()),
                "rng": digest([torch.get_rng_state(), np.random.get_state()[1].tolist(),
                               random.getstate()])}


def digest(obj: Any) -> str:
    h = hashlib.sha256()
    _feed(h, obj)
    return h.hexdigest()[:16]


def _feed(h: Any, obj: Any) -> None:
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        obj = obj.to_local()
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(obj, dict):
        for k in sorted(obj, key=str):
            h.update(str(k).encode())
            _feed(h, obj[k])
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _feed(h, v)
    else:
        h.update(repr(obj).encode())


def worker_class() -> Any:
    """verl's ``Worker`` with a :class:`Trainable` and the checkpoint calls of verl's
    ``TrainingWorker`` (``verl/workers/engine_workers.py``): ONE_TO_ALL, to the engine,
    whose FSDP ``save_checkpoint`` calls the manager with the same arguments."""
    from verl.single_controller.base.decorator import Dispatch, register
    from verl.single_controller.base.worker import Worker

    class CheckpointWorker(Worker):
        def __init__(self, checkpoint_config: dict) -> None:
            super().__init__()
            self.checkpoint_config = checkpoint_config
            self.trainable: Trainable | None = None

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def init_model(self) -> int:
            self.trainable = Trainable(self.checkpoint_config)
            return os.getpid()

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def train(self, steps: int, seed: int) -> None:
            assert self.trainable is not None
            self.trainable.train(steps, seed)

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def digests(self) -> dict[str, str]:
            assert self.trainable is not None
            return self.trainable.digests()

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def save_checkpoint(self, local_path, hdfs_path=None, global_step=0,
                            max_ckpt_to_keep=None):
            assert self.trainable is not None
            return self.trainable.manager.save_checkpoint(
                local_path=local_path, hdfs_path=hdfs_path, global_step=global_step,
                max_ckpt_to_keep=max_ckpt_to_keep)

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=False):
            assert self.trainable is not None
            return self.trainable.manager.load_checkpoint(
                local_path=local_path, hdfs_path=hdfs_path,
                del_local_after_load=del_local_after_load)

    return CheckpointWorker


# ------------------------------------------- verl's trainer, one worker in-process

BATCHES = 4096  # dataloader items (batch 1): no epoch boundary within a torture run


class VerlGroup:
    """The worker group verl's trainer calls (``RayWorkerGroup``, ONE_TO_ALL), here one
    worker in this process: verl's ``TrainingWorker`` checkpoint calls on its manager."""

    world_size = 1

    def __init__(self, trainable: Any) -> None:
        self.trainable = trainable

    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None):
        return self.trainable.manager.save_checkpoint(
            local_path=local_path, hdfs_path=hdfs_path, global_step=global_step,
            max_ckpt_to_keep=max_ckpt_to_keep)

    def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=False):
        return self.trainable.manager.load_checkpoint(
            local_path=local_path, hdfs_path=hdfs_path, del_local_after_load=del_local_after_load)


def trainer_for(root: str, step: int, *, async_save: bool = False, critic: bool = False,
                contents: list[str] | None = None, load: list[str] | None = None,
                lora: bool = False, **trainer: Any) -> Any:
    """verl's trainer (``__init__`` not run: it starts rollout servers) at step ``step``:
    its roles' states and its dataloader's position are functions of ``step``.
    ``trainer`` overrides ``trainer.*`` keys (``default_local_dir`` is ``root``);
    ``contents`` is the checkpoint's ``save_contents``, ``load`` its ``load_contents``;
    ``lora``: LoRA adapters saved alone (``save_lora_only``)."""
    from omegaconf import OmegaConf
    from torchdata.stateful_dataloader import StatefulDataLoader
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    init_gloo()
    t = RayPPOTrainer.__new__(RayPPOTrainer)
    keys = {"default_local_dir": root, "default_hdfs_dir": None, "resume_mode": "auto",
            "resume_from_path": None, "max_actor_ckpt_to_keep": None,
            "max_critic_ckpt_to_keep": None, "del_local_ckpt_after_load": False, **trainer}
    own: dict[str, Any] = {"save_contents": contents} if contents else {}
    if load is not None:
        own["load_contents"] = load
    if lora:
        own["save_lora_only"] = True
    checkpoint = {"async_save": async_save, **own}
    t.config = OmegaConf.create({"trainer": keys,
                                 "actor_rollout_ref": {"actor": {"checkpoint": checkpoint}}})
    t.global_steps = step
    t.roles = {}
    for role, offset in [("actor", 0)] + ([("critic", 500)] if critic else []):
        t.roles[role] = Trainable(own, lora=lora)
        if step:
            t.roles[role].train(1, step + offset)
    t.trainable = t.roles["actor"]
    t.actor_rollout_wg, t.use_critic = VerlGroup(t.trainable), critic
    t.critic_wg = VerlGroup(t.roles["critic"]) if critic else None
    t.train_dataloader = StatefulDataLoader(list(range(BATCHES)), batch_size=1)
    it = iter(t.train_dataloader)
    for _ in range(step % BATCHES):
        next(it)
    return t


def digests_of(t: Any) -> dict[str, Any]:
    """Each role's digests (the RNG last: the same process-wide state for all)."""
    return {role: trainable.digests() for role, trainable in t.roles.items()}


def resumed(fresh: Any, want: Any) -> dict[str, Any]:
    """``fresh``'s own ``_load_checkpoint``, compared with the trainer ``want()`` makes
    (the state an uninterrupted run has at the resumed step)."""
    fresh._load_checkpoint()
    got = digests_of(fresh)  # before `want` reseeds the RNGs
    return {"step": fresh.global_steps, "same": got == digests_of(want()),
            "next": next(iter(fresh.train_dataloader)).tolist()}


def init_gloo() -> None:
    """A one-rank gloo group for this process, if it has none."""
    import socket

    import torch.distributed as dist

    if not dist.is_initialized():
        torch.set_num_threads(1)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0",
                          WORLD_SIZE="1", LOCAL_RANK="0")
        dist.init_process_group("gloo", rank=0, world_size=1)
