"""Train a tiny model with checkpoints in a bucket; resume after a crash, bit-exactly.

Single process:
    python examples/train_resume.py --root s3://bucket/run --steps 24
Two ranks (gloo, FSDP2-sharded model):
    python -m torch.distributed.run --nproc_per_node 2 examples/train_resume.py --root ...

Run it again after a crash (``--crash-at-step 9`` kills it on purpose) and it
resumes from the newest committed checkpoint under ``--root``: same losses,
same final parameters as a run that never stopped. Per-step losses go to
stdout as ``step N loss <float.hex()>`` so runs compare exactly.

With a node-local tier in front of the bucket (local saves every 2 steps, every
3rd of them drained to the bucket, no direct bucket saves):
    python examples/train_resume.py --root s3://bucket/run --every 0 \
        --local-dir /dev/shm/ckpt --local-every 2 --drain-every 3
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from cloudckpt import CheckpointManager, LocalTier, ManagerOptions, Preemption, StepInfo

CONFIG = {"d_in": 16, "hidden": 64, "d_out": 4, "dropout": 0.1}


class SyntheticLoader:
    """A stateful dataloader over synthetic data: each rank its own slice, a new
    shuffle every epoch. ``state_dict``/``load_state_dict`` like torchdata's."""

    def __init__(self, n: int, batch: int, rank: int, world: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(n, CONFIG["d_in"], generator=g)
        w = torch.randn(CONFIG["d_in"], CONFIG["d_out"], generator=g)
        self.x, self.y = x[rank::world], (x @ w).tanh()[rank::world]
        self.batch, self.seed = batch, seed
        self.epoch, self.pos = 0, 0

    def __len__(self) -> int:
        return len(self.x) // self.batch

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.pos >= len(self):
            self.epoch, self.pos = self.epoch + 1, 0
        perm = torch.randperm(len(self.x), generator=torch.Generator().manual_seed(
            self.seed * 1000 + self.epoch))
        idx = perm[self.pos * self.batch:(self.pos + 1) * self.batch]
        self.pos += 1
        return self.x[idx], self.y[idx]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])


def build_model(world: int) -> torch.nn.Module:
    torch.manual_seed(1234)
    model = torch.nn.Sequential(
        torch.nn.Linear(CONFIG["d_in"], CONFIG["hidden"]), torch.nn.GELU(),
        torch.nn.Dropout(CONFIG["dropout"]),  # uses the RNG: resume must restore it
        torch.nn.Linear(CONFIG["hidden"], CONFIG["d_out"]))
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", required=True, help="checkpoint root URI, e.g. s3://bucket/run")
    p.add_argument("--storage-options", default="{}", help="JSON storage options")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--every", type=int, default=4,
                   help="checkpoint to the bucket every N steps (0: only by draining)")
    p.add_argument("--keep-last", type=int, default=2)
    p.add_argument("--async-save", action="store_true")
    p.add_argument("--crash-at-step", type=int, default=None,
                   help="SIGKILL this process right after this step's update")
    p.add_argument("--crash-mid-save", type=int, default=None,
                   help="SIGKILL during this step's checkpoint, before it commits")
    p.add_argument("--local-dir", default=None, help="a node-local tier in this directory")
    p.add_argument("--local-every", type=int, default=2, help="a local save every N steps")
    p.add_argument("--drain-every", type=int, default=None,
                   help="drain every Nth local save to the bucket")
    p.add_argument("--crash-mid-drain", type=int, default=None,
                   help="SIGKILL during the drain of this step, before it commits")
    p.add_argument("--replicas", type=int, default=0,
                   help="copy each local save to this many partner ranks on other nodes")
    p.add_argument("--crash-mid-replication", type=int, default=None,
                   help="SIGKILL a rank while it receives a partner's copy of this step")
    p.add_argument("--crash-replication-point", choices=("write", "commit"), default="write",
                   help="where: after the first bytes of the copy, or just before its commit")
    p.add_argument("--crash-replication-rank", type=int, default=None,
                   help="only this rank crashes (default: every rank receiving one)")
    p.add_argument("--preemption-budget", type=float, default=None,
                   help="on SIGTERM, save once within this many seconds, then end")
    p.add_argument("--step-seconds", type=float, default=0.0,
                   help="sleep this long in each step (a slower model)")
    p.add_argument("--out", default=None, help="write the final parameters here (torch.save)")
    args = p.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rc = run(args, world)
    if world > 1:
        end_process_group()
    return rc


def end_process_group() -> None:
    """Tear the process groups down once the run's objects are freed and every rank is
    past its last collective. FSDP2's modules hold their last collectives' gloo work
    in reference cycles, which only the garbage collector frees: left to interpreter
    shutdown, that work is freed on gloo's threads, which then abort the process
    (SIGABRT, "terminate called without an active exception", after a clean run)."""
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def run(args: argparse.Namespace, world: int) -> int:
    """Train (resuming if the root holds a checkpoint) to ``args.steps``."""
    rank = dist.get_rank() if world > 1 else 0
    torch.set_num_threads(1)
    if args.crash_mid_save is not None:
        _arm_mid_save_crash(args.crash_mid_save)
    if args.crash_mid_drain is not None:
        _arm_mid_drain_crash(args.crash_mid_drain)
    if args.crash_mid_replication is not None and args.crash_replication_rank in (None, rank):
        _arm_mid_replication_crash(args.crash_mid_replication, args.crash_replication_point)

    model = build_model(world)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=5, gamma=0.7)
    loader = SyntheticLoader(n=256, batch=8, rank=rank, world=world)
    preemption = (Preemption(budget=args.preemption_budget)
                  if args.preemption_budget is not None else None)
    local = (LocalTier(args.local_dir, every_steps=args.local_every, drain_every=args.drain_every,
                       replicas=args.replicas) if args.local_dir else None)
    mgr = CheckpointManager(args.root, ManagerOptions(every_steps=args.every or None,
                                                      keep_last=args.keep_last,
                                                      async_save=args.async_save, local=local,
                                                      preemption=preemption),
                            storage_options=json.loads(args.storage_options))

    def app_state() -> dict:
        msd, osd = get_state_dict(model, optim)
        return {"model": msd, "optim": osd}

    state = app_state()
    info = mgr.restore(state, extra={"sched": sched}, per_rank={"data": loader})
    if info is not None:
        set_state_dict(model, optim, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        start = info.next()
        if rank == 0:
            print(f"resumed at step {start.global_step}", flush=True)
    else:
        start = StepInfo(steps_per_epoch=len(loader))

    step = start
    while step.global_step < args.steps:
        x, y = loader.next()
        loss = torch.nn.functional.mse_loss(model(x), y)
        optim.zero_grad()
        loss.backward()
        optim.step()
        sched.step()
        if rank == 0:
            print(f"step {step.global_step} loss {loss.item().hex()}", flush=True)
        time.sleep(args.step_seconds)
        if step.global_step == args.crash_at_step:
            os.kill(os.getpid(), signal.SIGKILL)
        if mgr.save(step, app_state(), extra={"sched": sched}, per_rank={"data": loader}):
            if rank == 0:
                print(f"saving step {step.global_step}", flush=True)
        step = step.next()
    mgr.close()

    full, _ = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True))
    if rank == 0:
        if args.out:
            torch.save({k: v.detach().clone() for k, v in full.items()}, args.out)
        print("done", flush=True)
    return 0


def _arm_mid_save_crash(at_step: int) -> None:
    """Kill the process after a checkpoint's DCP part is written but before its
    root manifest commits: the worst moment for a crash."""
    from cloudckpt.training import multipart

    real = multipart.commit

    def commit_then_die(writer, parts, written):
        if writer.step == at_step:
            print(f"crashing mid-save of step {writer.step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return real(writer, parts, written)

    multipart.commit = commit_then_die


def _arm_mid_drain_crash(at_step: int) -> None:
    """Kill the process once every rank has sent its files of a drain to the bucket,
    before the drained checkpoint commits there."""
    from cloudckpt.training import tiers

    real = tiers.Drained.commit

    def commit_then_die(self, writer, written):
        if writer.step == at_step:
            print(f"crashing mid-drain of step {writer.step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, writer, written)

    tiers.Drained.commit = commit_then_die


def _arm_mid_replication_crash(at_step: int, point: str) -> None:
    """Kill the process while it receives a partner's copy of a local step: after
    its first bytes are written, or once all are, before the copy commits."""
    from cloudckpt.training import replicas

    cls = replicas.CopySink
    real = getattr(cls, point if point == "write" else "close")

    def die_then(self, *args):
        if self.manifest.step == at_step:
            print(f"crashing mid-replication of step {at_step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, *args)

    setattr(cls, point if point == "write" else "close", die_then)


if __name__ == "__main__":
    sys.exit(main())
