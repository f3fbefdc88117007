"""RLinf 0.3.0's own ``ReasoningRunner`` checkpoint path, run by test_rlinf_strategy.py
as ``[cloudckpt run --] python rlinf_runner_driver.py --output-dir D --out DIR``, in one
process (a 1-rank gloo group), one phase after the other:

- save: RLinf's ``_save_checkpoint`` at global step 2, its actor group a stand-in that
  calls RLinf's own FSDP2 strategy (the runner's workers are Ray groups of FSDPActor,
  whose model manager does not import with transformers 5) with a model trained 2 steps,
  its dataloader 3 batches in;
- resume: a fresh runner with ``resume_dir: auto`` through RLinf's own ``init_workers``
  (and so ``init_actor_critic_workers``' resume branch), a fresh strategy.

Each phase's report (DIR/save.json, DIR/resume.json) has the global step, a digest of
every tensor of model, optimizer, scheduler and RNG (rlinf_strategy_ranks.snapshot),
and the dataloader's next batch.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path[:] = [p for p in sys.path if "peers/rlinf" not in p.replace(os.sep, "/")]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from rlinf_strategy_ranks import CpuPlatform, _free_port, build, cfg_for, snapshot, train  # noqa: E402
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402


class Done:
    def wait(self) -> None:
        return None


class ActorGroup:
    """What the runner calls on its actor worker group; each call runs RLinf's strategy."""

    def __init__(self, strategy, model, optimizer, scheduler) -> None:
        self.parts = (model, optimizer, scheduler)
        self.strategy = strategy

    def init_worker(self) -> Done:
        return Done()

    def save_checkpoint(self, save_base_path: str, step: int) -> Done:
        self.strategy.save_checkpoint(*self.parts, save_base_path)
        return Done()

    def load_checkpoint(self, load_base_path: str) -> Done:
        self.strategy.load_checkpoint(*self.parts, load_base_path)
        return Done()


def digest(obj) -> object:
    if isinstance(obj, torch.Tensor):
        return hashlib.sha256(obj.contiguous().numpy().tobytes()).hexdigest()
    if isinstance(obj, dict):
        return {str(k): digest(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [digest(v) for v in obj]
    return repr(obj)


def runner_for(output_dir: str, resume_dir, actor: ActorGroup):
    from omegaconf import OmegaConf
    from rlinf.runners.reasoning_runner import ReasoningRunner

    runner = ReasoningRunner.__new__(ReasoningRunner)  # its __init__ builds Ray groups
    # RLinf's default, ${output_dir}/${experiment_name}; spelt out locally for a bucket.
    log_path = f"{output_dir}/exp" if "://" not in output_dir else tempfile.mkdtemp()
    runner.cfg = OmegaConf.create({
        "runner": {"output_dir": output_dir, "experiment_name": "exp",
                   "resume_dir": resume_dir, "logger": {"log_path": log_path}},
        "actor": {"training_backend": "fsdp"}, "critic": {"training_backend": "fsdp"}})
    runner.actor, runner.critic, runner.reward, runner.rollout = actor, None, None, actor
    runner.has_dedicated_actor_inference = runner.has_dedicated_critic_inference = False
    runner.use_pre_process_policy = False
    generator = torch.Generator().manual_seed(7)
    runner.train_dataloader = StatefulDataLoader(list(range(40)), batch_size=4, shuffle=True,
                                                 generator=generator)
    runner.global_steps = 0
    return runner


def phase(name: str, output_dir: str):
    cfg = cfg_for("dcp")
    if name == "save":
        parts = build(cfg, seed=0)
        train(*parts, 0, 2)
        runner = runner_for(output_dir, None, ActorGroup(*parts))
        batches = iter(runner.train_dataloader)
        for _ in range(3):
            next(batches)
        runner.global_steps = 2
        runner._save_checkpoint()
    else:
        parts = build(cfg, seed=123)
        train(*parts, 50, 1)
        runner = runner_for(output_dir, "auto", ActorGroup(*parts))
        runner.init_workers()
        batches = iter(runner.train_dataloader)
    return {"global_steps": runner.global_steps, "resume_dir": runner.cfg.runner.resume_dir,
            "state": digest(snapshot(*parts[1:])), "next_batch": next(batches).tolist()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--output-dir", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("gloo", rank=0, world_size=1)
    from rlinf.scheduler import Worker

    Worker.torch_platform, Worker.torch_device_type = CpuPlatform(), "cpu"
    import rlinf_strategy_ranks

    rlinf_strategy_ranks.WORLD = 1
    for name in ("save", "resume"):
        Path(args.out, f"{name}.json").write_text(json.dumps(phase(name, args.output_dir)))
    gc.collect()  # FSDP2's gloo work freed now, not at shutdown (examples/train_resume.py)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
