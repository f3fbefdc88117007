"""verl 0.9.1's own PPO checkpoint path, run by test_verl.py as ``[cloudckpt run --]
python verl_driver.py PLAN_JSON OUT_JSON``: a real local Ray, verl's own
``RayWorkerGroup`` (CPU resource pool, as verl's CPU tests build one) of
verl_parts.CheckpointWorker (FSDP2 on gloo, verl's ``FSDPCheckpointManager``), and
verl's own ``RayPPOTrainer._save_checkpoint`` / ``_load_checkpoint`` (or, with
``"trainer": "v1"``, those of the v1 ``PPOTrainerSync`` that ``main_ppo`` runs by
default) called on a trainer whose ``__init__`` did not run (it builds rollout servers
and a reward loop, which need an inference engine): only the attributes those two
methods read are set (config, global_steps, the worker groups, use_critic,
train_dataloader; the v1 one's trainer_mode and checkpoint_callback).

The plan: ``{"config": {...trainer keys...}, "critic": bool, "world": int, "trainer": "v1"?,
"phases": [{"save": [steps...]} | {"resume": true}, each with optional "config"
overrides and "world"]}``. Each phase starts from fresh models, optimizers and managers
(step 0's state, in the same worker processes, or new ones for another world size); a
save phase trains one round per step and saves it, a resume phase loads, and one with
both loads, then trains and saves on (a relaunched job). OUT_JSON gets
per phase the digests per rank and the dataloader's next batch, or the error.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import ray

HERE = Path(__file__).resolve().parent


def dataloader(seed: int = 7):
    import torch
    from torchdata.stateful_dataloader import StatefulDataLoader

    g = torch.Generator().manual_seed(seed)
    return StatefulDataLoader(list(range(64)), batch_size=4, shuffle=True, generator=g)


def groups(world: int, critic: bool, ckpt_config: dict) -> dict:
    """verl's worker groups, one per role, each of ``world`` Ray actors."""
    from verl.single_controller.ray.base import (
        RayClassWithInitArgs,
        RayResourcePool,
        RayWorkerGroup,
    )
    from verl_parts import worker_class

    env = {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    cls = ray.remote(worker_class())
    made = {}
    for role in ["actor"] + (["critic"] if critic else []):
        pool = RayResourcePool([world], use_gpu=False, max_colocate_count=1)
        init = RayClassWithInitArgs(cls=cls, checkpoint_config=ckpt_config)
        made[role] = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=init,
                                    name_prefix=f"{role}_w{world}_{os.getpid()}",
                                    worker_env=env)
    return made


def fresh(made: dict) -> dict:
    """Fresh models, optimizers and managers in the groups' workers (step 0's state,
    as a relaunched job has before it resumes): ``{role: (group, pids)}``."""
    return {role: (wg, wg.init_model()) for role, wg in made.items()}


class Callbacks:
    """verl's v1 ``checkpoint_callback``, recording what it is told."""

    def __init__(self) -> None:
        self.seen: list = []

    def on_save(self, trainer, global_step: int, checkpoint_dir: str, async_save: bool = False,
                **kwargs) -> None:
        self.seen.append([global_step, checkpoint_dir])


def trainer(config: dict, made: dict, v1: bool = False):
    from omegaconf import OmegaConf

    if v1:  # main_ppo's default (trainer.use_v1: true), in its sync mode
        from verl.trainer.ppo.v1 import PPOTrainerSync as cls

        t = cls.__new__(cls)
        t.trainer_mode = "sync"
        t.checkpoint_callback = Callbacks()
    else:
        from verl.trainer.ppo.ray_trainer import RayPPOTrainer as cls

        t = cls.__new__(cls)
    t.config = OmegaConf.create(config)
    t.global_steps = 0
    t.actor_rollout_wg = made["actor"][0]
    t.use_critic = "critic" in made
    t.critic_wg = made["critic"][0] if t.use_critic else None
    t.train_dataloader = dataloader()
    return t


def report(t, made: dict, batches: int = 1) -> dict:
    nxt = [next(iter(t.train_dataloader)).tolist()] if batches else []
    callbacks = getattr(t, "checkpoint_callback", None)
    return {"global_steps": t.global_steps, "next": nxt,
            "callbacks": callbacks.seen if callbacks else None,
            "digests": {role: wg.digests() for role, (wg, _) in made.items()},
            "pids": {role: pids for role, (_, pids) in made.items()}}


def main() -> None:
    plan = json.loads(Path(sys.argv[1]).read_text())
    out: dict = {"phases": []}
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=True)
    try:
        ckpt_config = plan.get("checkpoint", {})
        by_world: dict = {}
        for phase in plan["phases"]:
            config = _merged(plan["config"], phase.get("config", {}))
            world = phase.get("world", plan.get("world", 2))
            if world not in by_world:
                by_world[world] = groups(world, plan.get("critic", False), ckpt_config)
            made = fresh(by_world[world])
            t = trainer(config, made, plan.get("trainer") == "v1")
            try:
                out["phases"].append(run_phase(phase, t, made))
            except Exception as exc:  # noqa: BLE001 - the test reads it from OUT_JSON
                out["phases"].append({"error": f"{type(exc).__name__}: {exc}",
                                      "traceback": traceback.format_exc()})
    except Exception as exc:  # the test reads the error from OUT_JSON
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["traceback"] = traceback.format_exc()
    finally:
        Path(sys.argv[2]).write_text(json.dumps(out))
        ray.shutdown()


def run_phase(phase: dict, t, made: dict) -> dict:
    saved: dict = {"saved": []}
    if phase.get("resume"):
        loaded = t._load_checkpoint()
        if "save" not in phase:
            return {"resumed": True, "returned": loaded, **report(t, made)}
        saved["resumed_at"] = t.global_steps  # then trains on, as fit() does
    it = iter(t.train_dataloader)
    for step in phase["save"]:
        next(it)  # one batch per step, as fit() draws them
        for wg, _ in made.values():
            wg.train(1, step)
        t.global_steps = step
        t._save_checkpoint()
        now = report(t, made, 0)
        now["next"] = [_next_batch(t.train_dataloader.state_dict())]
        saved["saved"].append({"step": step, **now})
    return saved


def _merged(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merged(out.get(k, {}), v) if isinstance(v, dict) else v
    return out


def _next_batch(state: dict) -> list:
    """The batch a dataloader restored from ``state`` draws next."""
    d = dataloader()
    d.load_state_dict(state)
    return next(iter(d)).tolist()


if __name__ == "__main__":
    main()
