"""verl's own PPO checkpointing on a bucket, with nothing of verl edited.

verl's ``RayPPOTrainer._save_checkpoint`` and ``_load_checkpoint`` run as written; the
trainer's ``fit`` loop is reduced to what checkpointing sees (one update of a tiny
FSDP2 actor per step, a save every ``save_freq`` steps, ``resume_mode`` on start), and
its worker group is one worker in this process calling verl's own
``FSDPCheckpointManager`` (verl's Ray workers and rollout servers need GPUs). Launched
under ``cloudckpt run``, its config's bucket ``default_local_dir`` just works:

    cloudckpt run -- python examples/verl/train.py --config examples/verl/config.yaml
    python examples/verl/train.py --demo     # embedded S3: crash, relaunch, resume

Needs verl 0.9.1 (``make compat`` installs it). Per-step losses go to stdout as
``step N loss <float.hex()>``; a run killed at any point and started again resumes
from the newest committed step, bit-exactly.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent


class OneWorker:
    """What the trainer calls on ``actor_rollout_wg`` (verl's ``RayWorkerGroup``,
    ONE_TO_ALL): here one worker, in this process, calling verl's manager as verl's
    ``TrainingWorker`` does."""

    world_size = 1

    def __init__(self, manager: Any) -> None:
        self.manager = manager

    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None):
        self.manager.save_checkpoint(local_path=local_path, hdfs_path=hdfs_path,
                                     global_step=global_step, max_ckpt_to_keep=max_ckpt_to_keep)

    def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=False):
        self.manager.load_checkpoint(local_path=local_path, hdfs_path=hdfs_path,
                                     del_local_after_load=del_local_after_load)


def build(config: Any) -> tuple[Any, Any, Any]:
    """A tiny Qwen2 actor sharded with FSDP2, its optimizer, and verl's trainer."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torchdata.stateful_dataloader import StatefulDataLoader
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, architectures=["Qwen2ForCausalLM"]))
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    manager = FSDPCheckpointManager(model=model, optimizer=optimizer,
                                    checkpoint_config=config.actor_rollout_ref.actor.checkpoint)
    trainer = RayPPOTrainer.__new__(RayPPOTrainer)  # its __init__ starts rollout servers
    trainer.config, trainer.global_steps = config, 0
    trainer.actor_rollout_wg = OneWorker(manager)
    trainer.use_critic, trainer.critic_wg = False, None
    trainer.train_dataloader = StatefulDataLoader(list(range(512)), batch_size=4, shuffle=True,
                                                  generator=torch.Generator().manual_seed(1))
    return model, optimizer, trainer


def train(args: argparse.Namespace) -> int:
    from omegaconf import OmegaConf

    config = OmegaConf.load(args.config)
    model, optimizer, trainer = build(config)
    trainer._load_checkpoint()  # verl's own call: resume_mode decides
    print(f"starting at step {trainer.global_steps + 1}", flush=True)
    batches = iter(trainer.train_dataloader)
    t = config.trainer
    while trainer.global_steps < t.total_training_steps:
        trainer.global_steps += 1
        batch = next(batches)
        ids = (batch.unsqueeze(1) + torch.arange(12)) % 96
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        print(f"step {trainer.global_steps} loss {loss.item().hex()}", flush=True)
        last = trainer.global_steps == t.total_training_steps
        if trainer.global_steps % t.save_freq == 0 or last:
            trainer._save_checkpoint()  # verl's own call
        if trainer.global_steps == args.crash_at_step:
            os.kill(os.getpid(), signal.SIGKILL)  # a crash, mid-run
    print("done", flush=True)
    return 0


def demo(args: argparse.Namespace) -> int:
    """Embedded S3: a first launch killed at step 6, a relaunch resuming from step 4 in
    the bucket; the losses of steps 5-12 match a run that was never killed."""
    from cloudckpt_testkit import MotoServer
    from omegaconf import OmegaConf

    root = OmegaConf.load(args.config).trainer.default_local_dir
    with MotoServer() as server:
        server.create_bucket(root.removeprefix("s3://").split("/", 1)[0])
        env = {**os.environ, **server.env()}
        launch = [sys.executable, "-m", "cloudckpt", "run", "--", sys.executable, __file__,
                  "--config", args.config]
        first = subprocess.run([*launch, "--crash-at-step", "6"], env=env, text=True,
                               capture_output=True)
        print(first.stdout, end="")
        print(f"(killed: exit {first.returncode})")
        second = subprocess.run(launch, env=env, text=True, capture_output=True, check=True)
        print(second.stdout, end="")
        listing = subprocess.run([sys.executable, "-m", "cloudckpt", "ls", root], env=env,
                                 text=True, capture_output=True, check=True)
        print(listing.stdout, end="")
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(HERE / "config.yaml"))
    p.add_argument("--crash-at-step", type=int, default=0,
                   help="SIGKILL this process right after that step (a crash)")
    p.add_argument("--demo", action="store_true",
                   help="start an embedded S3, crash a run once, relaunch it, resume")
    return p.parse_args(argv)


if __name__ == "__main__":
    ns = parse_args()
    sys.exit(demo(ns) if ns.demo else train(ns))
