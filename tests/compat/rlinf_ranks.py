"""Rank functions for tests/compat/test_rlinf_compat.py (run by dist_run.run_ranks).

RLinf's FSDP actor needs CUDA/NPU and a Ray cluster; the smallest stand-in that
runs RLinf's own checkpoint code unchanged is FSDP2 (``fully_shard``) on the CPU
with gloo: RLinf's ``Checkpoint`` only calls ``get_state_dict``/``set_state_dict``
and DCP, which work on CPU DTensors exactly as on GPU ones. The saver and loader
calls below are RLinf's ``FSDPStrategyBase.save_checkpoint``/``load_checkpoint``
(``reference/base.py``) call shapes, made on RLinf's own ``Checkpoint`` class.
"""

from __future__ import annotations

import json
import os
import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

STEPS_BEFORE, STEPS_AFTER = 3, 2


def build(world: int, seed: int) -> tuple[Any, Any, Any]:
    """An FSDP2-sharded actor, AdamW and a StepLR, as RLinf's FSDP actor has."""
    from helpers import shard_linears

    # Every generator seeded alike on every rank: RLinf saves the RNG under the same
    # keys on every rank, so DCP keeps one copy and every rank gets that one back.
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(32, 3))
    if world > 1:
        shard_linears(model, world)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)
    return model, optim, sched


def train(model: Any, optim: Any, sched: Any, steps: int) -> None:
    """Inputs and dropout draw from the global RNG (same seed on every rank), so a
    resume that restores model, optimizer, scheduler or RNG wrongly diverges."""
    for _ in range(steps):
        x = torch.randn(4, 8) + float(np.random.rand()) + random.random()
        loss = model(x).square().mean()
        optim.zero_grad()
        loss.backward()
        optim.step()
        sched.step()


def outcome(model: Any, optim: Any, sched: Any) -> dict[str, Any]:
    """What must be bit-exact after a resume and the same further steps."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True))
    return {"model": {k: v.detach().clone() for k, v in msd.items()},
            "optim": osd, "sched": sched.state_dict(),
            "draws": (torch.rand(3), np.random.rand(2), random.random())}


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def rlinf_training_state(model: Any, optim: Any, sched: Any) -> Any:
    """RLinf's own ``Checkpoint`` with the arguments base.py gives it."""
    from rlinf.hybrid_engines.fsdp.strategy.checkpoint import Checkpoint
    from rlinf.hybrid_engines.fsdp.utils import FSDPVersion
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return Checkpoint(model, optim, sched, StateDictOptions(full_state_dict=False,
                                                            cpu_offload=True),
                      fsdp_version=FSDPVersion.FSDP2)


def rlinf_save(model: Any, optim: Any, sched: Any, step_dir: str, data_state: Any) -> None:
    """RLinf's save of one step: actor DCP, actor full weights (rank 0), then the
    runner's data/data.pt (rank 0)."""
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    actor = os.path.join(step_dir, "actor")
    dcp.save({"fsdp_checkpoint": rlinf_training_state(model, optim, sched)},
             checkpoint_id=os.path.join(actor, "dcp_checkpoint"))
    full = get_model_state_dict(model=model, options=StateDictOptions(full_state_dict=True,
                                                                      cpu_offload=True))
    if _rank() == 0:
        os.makedirs(os.path.join(actor, "model_state_dict"), exist_ok=True)
        torch.save(full, os.path.join(actor, "model_state_dict", "full_weights.pt"))
        os.makedirs(os.path.join(step_dir, "data"), exist_ok=True)
        torch.save(data_state, os.path.join(step_dir, "data", "data.pt"))
    _barrier()


def rlinf_load(model: Any, optim: Any, sched: Any, actor_dir: str) -> None:
    """RLinf's load of the actor: the DCP directory under ``actor/``."""
    from torch.distributed import checkpoint as dcp

    dcp.load({"fsdp_checkpoint": rlinf_training_state(model, optim, sched)},
             checkpoint_id=os.path.join(actor_dir, "dcp_checkpoint"))


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def cloudckpt_to_rlinf(rank: int, world: int, out_dir: str, options_json: str, local: str,
                       full_path: str) -> dict[str, Any]:
    """cloudckpt saves step 3 to the bucket; ``cloudckpt download``; RLinf's own
    Checkpoint loads it into a fresh actor; both continue 2 steps: bit-exact."""
    from cloudckpt.cli import main as cli
    from cloudckpt.integrations import rlinf

    opts = json.loads(options_json)
    model, optim, sched = build(world, seed=0)
    train(model, optim, sched, STEPS_BEFORE)
    ck = rlinf.RLinfCheckpointer(rlinf.RunnerConfig(out_dir, "compat", save_interval=3),
                                 storage_options=opts)
    committed = ck.save(STEPS_BEFORE, rlinf.fsdp_state_dict(model, optim, sched),
                        data_state={"epoch": 0, "pos": 3})
    saved = outcome(model, optim, sched)  # draws after the save: RNG state as saved
    if rank == 0:
        torch.save(saved["model"], full_path)
    train(model, optim, sched, STEPS_AFTER)
    expected = outcome(model, optim, sched)
    if rank == 0:
        assert committed is not None
        flags = [f"-o{k}={v}" for k, v in opts.items() if isinstance(v, str)]
        assert cli(["download", committed.uri, local, *flags]) == 0
    _barrier()

    model2, optim2, sched2 = build(world, seed=99)  # other weights, other RNG
    rlinf_load(model2, optim2, sched2, os.path.join(local, "actor"))
    resumed_draws = outcome(model2, optim2, sched2)["draws"]
    train(model2, optim2, sched2, STEPS_AFTER)
    got = outcome(model2, optim2, sched2)
    return {"rng": same(resumed_draws, saved["draws"]), "model": same(got["model"],
            expected["model"]), "optim": same(got["optim"], expected["optim"]),
            "sched": same(got["sched"], expected["sched"]),
            "draws": same(got["draws"], expected["draws"]),
            "files": committed.files if committed is not None else None}


def rlinf_to_cloudckpt(rank: int, world: int, local_step: str, out_dir: str,
                       options_json: str) -> dict[str, Any]:
    """RLinf's own saver writes step 3 locally; rank 0 runs the one upload command;
    cloudckpt resumes (``resume_dir: auto``) into a fresh actor: bit-exact."""
    from cloudckpt.cli import main as cli
    from cloudckpt.integrations import rlinf

    opts = json.loads(options_json)
    model, optim, sched = build(world, seed=0)
    train(model, optim, sched, STEPS_BEFORE)
    rlinf_save(model, optim, sched, local_step, {"epoch": 0, "pos": 3})
    saved_draws = outcome(model, optim, sched)["draws"]
    train(model, optim, sched, STEPS_AFTER)
    expected = outcome(model, optim, sched)
    root = rlinf.checkpoints_root(out_dir, "compat")
    if rank == 0:
        flags = ["--storage-options", options_json]
        assert cli(["rlinf", "upload", local_step, root, *flags]) == 0
    _barrier()

    model2, optim2, sched2 = build(world, seed=99)
    ck = rlinf.RLinfCheckpointer(rlinf.RunnerConfig(out_dir, "compat", save_interval=3,
                                                    resume_dir="auto"),
                                 storage_options=opts)
    uri = ck.resume_uri()
    state = rlinf.fsdp_state_dict(model2, optim2, sched2)
    resumed = ck.load(uri, state)
    rlinf.load_fsdp_state_dict(model2, optim2, sched2, state)
    resumed_draws = outcome(model2, optim2, sched2)["draws"]
    train(model2, optim2, sched2, STEPS_AFTER)
    got = outcome(model2, optim2, sched2)
    return {"uri": uri, "step": resumed.step, "data": resumed.data_state,
            "rng": same(resumed_draws, saved_draws), "model": same(got["model"],
            expected["model"]), "optim": same(got["optim"], expected["optim"]),
            "sched": same(got["sched"], expected["sched"]),
            "draws": same(got["draws"], expected["draws"])}
