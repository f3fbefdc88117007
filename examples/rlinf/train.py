"""A tiny RLinf-style training loop whose checkpoints live in a bucket.

Single process:
    python examples/rlinf/train.py --config examples/rlinf/config.yaml \
        runner.output_dir=s3://bucket/rlinf-logs --storage-options '{...}'
Two ranks (gloo, FSDP2-sharded actor):
    python -m torch.distributed.run --nproc_per_node 2 examples/rlinf/train.py ...

It follows RLinf's runner: one actor update per global step (counted from 1),
``max_steps: -1`` meaning ``max_epochs * len(dataloader)`` steps, a checkpoint when
RLinf's ``save_interval`` rule says so (the last step always), and on start
``runner.resume_dir`` (``auto``: the newest committed ``global_step_N``). The
checkpoint is RLinf's own format: RLinf's loader reads a downloaded step.
Kill it at any moment and run it again: it continues bit-exactly. Per-step
losses go to stdout as ``step N loss <float.hex()>``. Trailing ``key=value``
arguments override the config, as with Hydra.

Against the embedded S3 server (moto), start one in another shell (Ctrl-C stops it):
    python -c "import json, time; from cloudckpt_testkit import MotoServer
    with MotoServer() as s:
        s.create_bucket('my-bucket'); print(json.dumps(s.storage_options()), flush=True)
        time.sleep(1e9)"
and pass the JSON it prints as ``--storage-options``.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import re
import signal
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from cloudckpt.integrations import rlinf

HERE = Path(__file__).parent


def load_config(path: str, overrides: list[str]) -> dict[str, Any]:
    """YAML plus Hydra-style ``a.b=value`` overrides and ``${a.b}`` interpolation
    (OmegaConf does this in RLinf; this keeps the example dependency-free)."""
    cfg = yaml.safe_load(Path(path).read_text())
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"override {item!r} must look like key=value")
        node = cfg
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = yaml.safe_load(value) if value else None

    def lookup(dotted: str) -> Any:
        node: Any = cfg
        for p in dotted.split("."):
            node = node[p]
        return node

    def resolve(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: resolve(v) for k, v in node.items()}
        if isinstance(node, str):
            return re.sub(r"\$\{([^}]+)\}", lambda m: str(resolve(lookup(m.group(1)))), node)
        return node

    return resolve(cfg)


class SyntheticLoader:
    """Stands in for RLinf's StatefulDataLoader: ``state_dict``/``load_state_dict``."""

    def __init__(self, cfg: dict, d_in: int, d_out: int, rank: int, world: int) -> None:
        g = torch.Generator().manual_seed(cfg["seed"])
        x = torch.randn(cfg["num_samples"], d_in, generator=g)
        w = torch.randn(d_in, d_out, generator=g)
        self.x, self.y = x[rank::world], (x @ w).tanh()[rank::world]
        self.batch, self.seed = cfg["batch_size"], cfg["seed"]
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


def build_actor(cfg: dict, world: int) -> torch.nn.Module:
    torch.manual_seed(1234)
    model = torch.nn.Sequential(
        torch.nn.Linear(cfg["d_in"], cfg["hidden"]), torch.nn.GELU(),
        torch.nn.Dropout(cfg["dropout"]),  # draws from the RNG: resume must restore it
        torch.nn.Linear(cfg["hidden"], cfg["d_out"]))
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
    p.add_argument("--config", default=str(HERE / "config.yaml"))
    p.add_argument("--storage-options", default="{}", help="JSON storage options")
    p.add_argument("--crash-at-step", type=int, default=None,
                   help="SIGKILL this process right after this step's update")
    p.add_argument("--crash-mid-save", type=int, default=None,
                   help="SIGKILL while saving this step: parts written, root manifest not")
    p.add_argument("--out", default=None, help="write the final parameters here (torch.save)")
    p.add_argument("overrides", nargs="*", help="Hydra-style key=value overrides")
    args = p.parse_intermixed_args()
    cfg = load_config(args.config, args.overrides)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rc = run(args, cfg, world)
    if world > 1:  # once the run's FSDP2 modules are freed (see examples/train_resume.py)
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
    return rc


def run(args: argparse.Namespace, cfg: dict[str, Any], world: int) -> int:
    rank = dist.get_rank() if world > 1 else 0
    torch.set_num_threads(1)
    if args.crash_mid_save is not None:
        _arm_mid_save_crash(args.crash_mid_save)

    mcfg = cfg["actor"]["model"]
    actor = build_actor(mcfg, world)
    optim = torch.optim.AdamW(actor.parameters(), lr=cfg["actor"]["optim"]["lr"],
                              weight_decay=cfg["actor"]["optim"]["weight_decay"])
    sched = torch.optim.lr_scheduler.StepLR(optim, **cfg["actor"]["lr_sched"])
    loader = SyntheticLoader(cfg["data"], mcfg["d_in"], mcfg["d_out"], rank, world)
    # steps_per_epoch: with runner.max_steps -1, RLinf runs max_epochs * len(dataloader)
    # steps and saves the last one; the checkpointer needs the length to know it.
    ckpt = rlinf.RLinfCheckpointer.from_config(
        cfg, steps_per_epoch=len(loader), storage_options=json.loads(args.storage_options))
    max_steps = ckpt.max_steps

    global_step = 0
    resume = ckpt.resume_uri()
    if resume is not None:
        state = rlinf.fsdp_state_dict(actor, optim, sched)
        resumed = ckpt.load(resume, state)
        rlinf.load_fsdp_state_dict(actor, optim, sched, state)
        loader.load_state_dict(resumed.data_state)
        global_step = resumed.step
        if rank == 0:
            print(f"resumed at step {global_step} from {resume}", flush=True)

    while global_step < max_steps:
        x, y = loader.next()  # "rollout" + actor update
        loss = torch.nn.functional.mse_loss(actor(x), y)
        optim.zero_grad()
        loss.backward()
        optim.step()
        sched.step()
        global_step += 1
        if rank == 0:
            print(f"step {global_step} loss {loss.item().hex()}", flush=True)
        if global_step == args.crash_at_step:
            os.kill(os.getpid(), signal.SIGKILL)
        if ckpt.should_save(global_step):
            ckpt.save(global_step, rlinf.fsdp_state_dict(actor, optim, sched),
                      data_state=loader.state_dict())
            if rank == 0:
                print(f"saved {ckpt.step_uri(global_step)}", flush=True)

    full, _ = get_state_dict(actor, optim, options=StateDictOptions(full_state_dict=True))
    if rank == 0:
        if args.out:
            torch.save({k: v.detach().clone() for k, v in full.items()}, args.out)
        print("done", flush=True)
    return 0


def _arm_mid_save_crash(at_step: int) -> None:
    """Die after every part of a step (actor DCP, data.pt) is written, just before
    the root manifest: RLinf's old completeness rule would accept this step."""
    real = rlinf.CheckpointWriter.commit

    def commit_then_die(self: Any) -> Any:
        if self.step == at_step and self.kind == rlinf.KIND:
            print(f"crashing mid-save of step {at_step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self)

    rlinf.CheckpointWriter.commit = commit_then_die  # type: ignore[method-assign]


if __name__ == "__main__":
    sys.exit(main())
