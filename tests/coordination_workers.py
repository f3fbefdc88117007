"""Rank functions for tests/test_coordination.py: one rank's storage fails at one
coordinated step; every rank must raise the same cloudckpt error, promptly."""

from __future__ import annotations

import time
from typing import Any

#: (name, failing rank, what of its requests fail: (HTTP method, target fragment))
SCENARIOS: list[tuple[str, int, tuple[str, str]]] = [
    ("claim", 0, ("PUT", ".cloudckpt-writer.json")),
    ("shard", 0, ("PUT", ".distcp")),
    ("shard", 1, ("PUT", ".distcp")),
    ("rank state", 1, ("PUT", "state/rank-")),
    ("commit", 0, ("PUT", "cloudckpt-manifest.json")),
    ("retention", 0, ("POST", "delete")),
    ("slot swap", 0, ("PUT", "slot-pointer.json")),
    ("async commit", 0, ("PUT", "cloudckpt-manifest.json")),
    ("rlinf save", 0, ("PUT", "cloudckpt-manifest.json")),
    ("areal dump", 0, ("PUT", "slot-pointer.json")),
]


def fail_one_step(rank: int, world: int, endpoint: str, root: str, deadline: float) -> list:
    """Run every scenario in turn; return, per scenario, what this rank saw: (name,
    failing rank, the error class it raised or None, seconds, whether the previous
    checkpoint is still the latest and loads, faults injected into its requests)."""
    import torch
    import torch.distributed as dist
    from cloudckpt_testkit import FaultPlan, FaultProxy

    from cloudckpt import CheckpointManager, ManagerOptions, RecoverSlot, StepInfo
    from cloudckpt.core.listing import latest_checkpoint
    from cloudckpt.integrations import areal, rlinf

    direct = {"endpoint_url": endpoint, "key": "testing", "secret": "testing",
              "retry": {"deadline": deadline, "initial_backoff": 0.05, "max_backoff": 0.5}}
    out = []
    with FaultProxy(endpoint) as proxy:
        for i, (name, bad_rank, (method, match)) in enumerate(SCENARIOS):
            opts = {**direct, "endpoint_url": proxy.endpoint} if rank == bad_rank else direct
            base = f"{root}/{i:02d}-{name.replace(' ', '-')}-w{world}"
            state = {f"w-rank{rank}": torch.full((4096,), float(rank))}
            step = StepInfo(global_step=1)
            if name in ("slot swap",):
                target: Any = RecoverSlot(f"{base}/slot", storage_options=opts)
                target.save(state, rng=False)  # a good first generation

                def attempt(target: Any = target, state: Any = state) -> Any:
                    return target.save(state, rng=False)
            elif name == "rlinf save":
                target = rlinf.RLinfCheckpointer(rlinf.RunnerConfig(base, "exp"),
                                                 storage_options=opts)
                target.save(1, {"fsdp_checkpoint": {"model": state}})

                def attempt(target: Any = target, state: Any = state) -> Any:
                    return target.save(2, {"fsdp_checkpoint": {"model": state}})
            elif name == "areal dump":
                cfg = areal.RecoverConfig(experiment_name="exp", trial_name="t", fileroot=base,
                                          freq_steps=1, mode="on", user="u")
                target = areal.RecoverHandler(cfg, 10, storage_options=opts)
                model = torch.nn.Linear(4, 4)
                nothing = (None, None, None, None)  # saver, evaluator, stats, dataloader
                target.dump(model, StepInfo(0, 0, 0, 10), *nothing)

                def attempt(target: Any = target, model: Any = model,
                            nothing: Any = nothing) -> Any:
                    return target.dump(model, StepInfo(0, 1, 1, 10), *nothing)
            else:
                keep = ManagerOptions(every_steps=1, keep_last=1,
                                      async_save=name == "async commit")
                target = CheckpointManager(base, keep, storage_options=opts)
                target.save(StepInfo(), state, rng=False)  # a good first checkpoint
                target.wait()

                def attempt(target: Any = target, state: Any = state,
                            step: Any = step) -> Any:
                    target.save(step, state, rng=False, force=True)
                    target.wait()
            dist.barrier()
            proxy.set_plan(FaultPlan(permanent_status=403, match=match, methods=(method,)))
            faults = proxy.faults.get("permanent", 0)
            t0 = time.monotonic()
            try:
                attempt()
                raised = None
            except Exception as exc:  # noqa: BLE001 - what each rank raises is the result
                raised = type(exc).__name__
            took = time.monotonic() - t0
            proxy.set_plan(FaultPlan())
            dist.barrier()
            if name == "slot swap":
                back = {f"w-rank{rank}": torch.zeros(4096)}
                RecoverSlot(f"{base}/slot", storage_options=direct).load(back, rng=False)
                latest_ok = bool(torch.equal(back[f"w-rank{rank}"], state[f"w-rank{rank}"]))
            elif name == "areal dump":
                got = areal.RecoverHandler(cfg, 10, storage_options=direct).load(
                    torch.nn.Linear(4, 4), *nothing)
                latest_ok = got is not None and got.last_step_info.global_step == 0
            elif name == "rlinf save":
                latest_ok = latest_checkpoint(target.store, direct).step == 1
            else:
                ckpt = latest_checkpoint(base, direct)
                ckpt.verify(deep=True)
                latest_ok = ckpt.step == (1 if name == "retention" else 0)
                if hasattr(target, "close"):
                    target.close()
            out.append((name, bad_rank, raised, round(took, 2), latest_ok,
                        proxy.faults.get("permanent", 0) - faults))
            dist.barrier()
    return out

