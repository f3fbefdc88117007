"""ROLL's stand-ins, shared by the in-process tests and the Ray driver
(roll_ray_driver.py): one actor rank's trainable state, ROLL's FSDP2 DCP save and load
of it, and the local directories ROLL's actor and pipeline upload (see
test_roll_compat.py's docstring for what each stands for)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict


class Worker:
    """One actor rank's trainable state, in the shape ROLL's FSDP2 strategy saves."""

    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=2)

    def train(self, steps: int) -> None:
        for _ in range(steps):
            self.model(torch.randn(4, 8)).pow(2).mean().backward()
            self.optimizer.step()
            self.optimizer.zero_grad()
            self.scheduler.step()

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {f"model.{k}": v for k, v in self.model.state_dict().items()}
        for i, st in self.optimizer.state_dict()["state"].items():
            out.update({f"optim.{i}.{k}": v for k, v in st.items()})
        return out


def roll_dcp_save(worker: Worker, ckpt_dir: Path) -> None:
    """fsdp2_strategy._save_checkpoint_with_dcp, its state dict unchanged (CPU RNG only)."""
    state = {**worker.model.state_dict(), "optimizer": worker.optimizer,
             "scheduler": worker.scheduler,
             "rng_state": {"cpu": torch.get_rng_state(), "numpy": np.random.get_state(),
                           "random": random.getstate()}}
    dcp.save(state_dict=state, checkpoint_id=str(ckpt_dir / "dcp"))


def roll_dcp_load(worker: Worker, ckpt_dir: Path) -> None:
    """fsdp2_strategy._load_checkpoint_with_dcp. A fresh torch optimizer has no state
    for DCP to load into; ROLL's is initialised by its engine, here by torch's helper."""
    get_optimizer_state_dict(worker.model, worker.optimizer)
    state = {**worker.model.state_dict(), "optimizer": worker.optimizer,
             "scheduler": worker.scheduler, "rng_state": {}}
    dcp.load(state_dict=state, checkpoint_id=str(ckpt_dir / "dcp"))


def stage_actor(root: Path, ckpt_id: str, worker: Worker) -> Path:
    """An actor rank's local dir: the HF export (rank 0) and its DCP shard."""
    d = root / "actor_train-0" / ckpt_id
    d.mkdir(parents=True)
    roll_dcp_save(worker, d)
    save_file({k: v.contiguous() for k, v in worker.model.state_dict().items()},
              str(d / "model.safetensors"))
    (d / "config.json").write_text('{"model_type": "tiny"}')
    return d


class ShardedWorker:
    """One rank of ROLL's actor on a gloo group (the default process group), the model
    sharded with FSDP2 as ROLL's fsdp2 strategy shards it. Its data at each step is a
    function of the step and the rank only, so a resumed run trains as one that never
    stopped."""

    def __init__(self) -> None:
        from torch.distributed.fsdp import fully_shard

        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=2)

    def train(self, step: int) -> None:
        import torch.distributed as dist

        g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
        self.model(torch.randn(4, 8, generator=g)).pow(2).mean().backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.scheduler.step()

    def tensors(self) -> dict[str, torch.Tensor]:
        """This rank's shards of the model and the optimizer state, and the scheduler's."""
        from torch.distributed.tensor import DTensor

        def local(t: torch.Tensor) -> torch.Tensor:
            return t.to_local() if isinstance(t, DTensor) else t

        out = {f"model.{k}": local(v) for k, v in self.model.state_dict().items()}
        for i, st in self.optimizer.state_dict()["state"].items():
            out.update({f"optim.{i}.{k}": local(v) for k, v in st.items()})
        out["scheduler.last_epoch"] = torch.tensor(self.scheduler.last_epoch)
        return out


def stage_rank(root: Path, ckpt_id: str, worker: ShardedWorker, rank: int,
               cluster: str = "actor_train") -> Path:
    """A rank's local dir (``{cluster}-{rank}/{ckpt_id}``): its DCP shard (rank 0 also
    DCP's ``.metadata``) and, on the actor's rank 0, the gathered HF export; another
    cluster's files (a critic's) lie in a folder named for it. Every rank calls it."""
    d = root / f"{cluster}-{rank}" / ckpt_id
    d.mkdir(parents=True, exist_ok=True)  # a relaunch saves a killed step again
    roll_dcp_save(worker, d / cluster_folder(cluster))
    full = {k: v.full_tensor() for k, v in worker.model.state_dict().items()}  # collective
    if rank == 0 and cluster == "actor_train":
        save_file({k: v.contiguous() for k, v in full.items()}, str(d / "model.safetensors"))
        (d / "config.json").write_text('{"model_type": "tiny"}')
    return d


def cluster_folder(cluster: str) -> str:
    """Where a cluster's files lie in a checkpoint: the actor's at its root, any other
    cluster's in a folder of its name (``critic/dcp/...``)."""
    return "" if cluster == "actor_train" else cluster


def stage_pipeline(root: Path, ckpt_id: str, step: int) -> Path:
    """The pipeline's dir (base_pipeline.py:117-121): WorkerState JSON and its RNG file."""
    d = root / "pipeline" / ckpt_id
    (d / "pipeline").mkdir(parents=True, exist_ok=True)  # as WorkerState.save_to_json
    state = {"kv": {"dataloader": {"pos": step}}, "log_history": [{"system/step": step}],
             "step": step}
    (d / "pipeline" / "worker_state_pipeline.json").write_text(
        json.dumps(state, indent=2, sort_keys=True))
    torch.save({"cpu": torch.get_rng_state()}, d / "pipeline" / "rng_state_pipeline.pth")
    return d


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and a
    for k in a:
        assert torch.equal(a[k], b[k]), k
