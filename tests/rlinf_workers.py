"""Rank functions for tests/test_integration_rlinf.py (run by dist_run.run_ranks)."""

from __future__ import annotations

import json

import torch
from helpers import shard_linears


def save_fsdp_actor(rank: int, world: int, output_dir: str, options_json: str,
                    full_path: str) -> list[str]:
    """Each rank: an FSDP2-sharded actor, a few AdamW steps, one RLinf checkpoint at
    step 3; rank 0 also writes the full (unsharded) model state to ``full_path``."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from cloudckpt.integrations import rlinf

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))
    shard_linears(model, world)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=2)
    torch.manual_seed(1 + rank)
    for _ in range(3):
        loss = model(torch.randn(4, 8)).square().mean()
        optim.zero_grad()
        loss.backward()
        optim.step()
        sched.step()
    ck = rlinf.RLinfCheckpointer(rlinf.RunnerConfig(output_dir, "conv", save_interval=3,
                                                    max_steps=3),
                                 storage_options=json.loads(options_json))
    assert ck.should_save(3)
    committed = ck.save(3, rlinf.fsdp_state_dict(model, optim, sched),
                        data_state={"epoch": 0, "pos": 3})
    full, _ = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True))
    if rank == 0:
        assert committed is not None
        torch.save({k: v.detach().clone() for k, v in full.items()}, full_path)
        return committed.files
    assert committed is None
    return []
