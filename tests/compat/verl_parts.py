"""What verl's FSDP workers hold, built small enough for CPU: a tiny Qwen2 (config
only, random weights) sharded with FSDP2 on gloo, AdamW, a warm-up LR scheduler, and
verl 0.9.1's own ``FSDPCheckpointManager`` over them; the worker's checkpoint calls
are verl's ``TrainingWorker.save_checkpoint``/``load_checkpoint`` (ONE_TO_ALL, each
calling the manager). Used inside verl's own ``RayWorkerGroup`` (verl_driver.py) and
in plain gloo processes (the crash tests).

A digest per rank of every tensor of the model shard, the optimizer state, the LR
scheduler and the RNG states is what "bit-exact" is checked on.
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

    def __init__(self, checkpoint_config: dict) -> None:
        import torch.distributed as dist
        from omegaconf import OmegaConf
        from torch.distributed.fsdp import fully_shard
        from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

        if not dist.is_initialized():
            dist.init_process_group("gloo")
        model = tiny_model()
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
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
