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

With ``--save STEPS`` (comma-separated) it trains instead, as RLinf's runner does: its
actor group is ``--world`` gloo ranks, each a process of its own running RLinf's FSDP2
strategy (RLinf's are Ray actors), driven by the runner in this process. ``init_workers``
runs with ``resume_dir: auto`` (a fresh start where nothing is saved), then each step
draws a batch, trains every rank on it and calls ``_save_checkpoint``. DIR/run.json has
the step resumed at and, per saved step, every rank's digests and the next batch.
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
import torch.multiprocessing as mp  # noqa: E402
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


def runner_for(output_dir: str, resume_dir, actor):
    from omegaconf import OmegaConf

    # RLinf's default, ${output_dir}/${experiment_name}; spelt out locally for a bucket.
    log_path = f"{output_dir}/exp" if "://" not in output_dir else tempfile.mkdtemp()
    return runner_with(OmegaConf.create({
        "runner": {"output_dir": output_dir, "experiment_name": "exp",
                   "resume_dir": resume_dir, "logger": {"log_path": log_path}},
        "actor": {"training_backend": "fsdp"}, "critic": {"training_backend": "fsdp"}}),
        actor)


def runner_with(cfg, actor):
    """RLinf's ``ReasoningRunner`` with config ``cfg``, its workers ``actor`` (rollout too)."""
    from rlinf.runners.reasoning_runner import ReasoningRunner

    runner = ReasoningRunner.__new__(ReasoningRunner)  # its __init__ builds Ray groups
    runner.cfg = cfg
    runner.actor, runner.critic, runner.reward, runner.rollout = actor, None, None, actor
    runner.has_dedicated_actor_inference = runner.has_dedicated_critic_inference = False
    runner.use_pre_process_policy = False
    runner.train_dataloader = dataloader()
    runner.global_steps = 0
    return runner


def dataloader() -> StatefulDataLoader:
    generator = torch.Generator().manual_seed(7)
    return StatefulDataLoader(list(range(40)), batch_size=4, shuffle=True, generator=generator)


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


# ------------------------------------------------- the runner over a group of ranks


class RankGroup:
    """The runner's actor worker group: ``world`` gloo ranks, each a spawned process
    running RLinf's FSDP2 strategy on its shard; every call runs on all of them."""

    def __init__(self, world: int) -> None:
        ctx = mp.get_context("spawn")
        port = _free_port()
        self.conns = []
        for rank in range(world):
            mine, theirs = ctx.Pipe()
            ctx.Process(target=_rank_loop, args=(rank, world, port, theirs), daemon=True).start()
            self.conns.append(mine)

    def call(self, *request) -> list:
        for conn in self.conns:
            conn.send(request)
        replies = [conn.recv() for conn in self.conns]
        failed = [r["error"] for r in replies if "error" in r]
        if failed:
            raise RuntimeError(f"a rank failed: {failed[0]}")
        return [r["result"] for r in replies]

    def init_worker(self) -> Done:
        return Done()

    def save_checkpoint(self, save_base_path: str, step: int) -> Done:
        self.call("save", save_base_path)
        return Done()

    def load_checkpoint(self, load_base_path: str) -> Done:
        self.call("load", load_base_path)
        return Done()

    def close(self) -> None:
        self.call("exit")


def _rank_loop(rank: int, world: int, port: int, conn) -> None:
    """One rank: RLinf's strategy built as its FSDP worker builds it, then the calls."""
    import traceback

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from rlinf.scheduler import Worker

    Worker.torch_platform, Worker.torch_device_type = CpuPlatform(), "cpu"
    import rlinf_strategy_ranks

    rlinf_strategy_ranks.WORLD = world
    parts = build(cfg_for("dcp"), seed=0)
    try:
        while True:
            op, *args = conn.recv()
            try:
                result = None
                if op == "exit":
                    conn.send({"result": None})
                    return
                if op == "train":  # this rank's data: a function of the batch and rank
                    step, batch = args
                    train(*parts, 100 * step + sum(batch), 1)
                elif op == "save":
                    parts[0].save_checkpoint(*parts[1:], args[0])
                elif op == "load":
                    parts[0].load_checkpoint(*parts[1:], args[0])
                elif op == "digests":
                    result = digest(snapshot(*parts[1:]))
                conn.send({"result": result})
            except Exception as exc:  # noqa: BLE001 - the runner raises it
                conn.send({"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"})
    finally:
        gc.collect()  # FSDP2's gloo work freed now, not at shutdown
        dist.destroy_process_group()


def _next_batch(runner) -> list:
    """The batch the runner's dataloader draws next, without drawing it."""
    fresh = dataloader()
    fresh.load_state_dict(runner.train_dataloader.state_dict())
    return next(iter(fresh)).tolist()


def train_and_save(output_dir: str, steps: list[int], world: int) -> dict:
    group = RankGroup(world)
    try:
        runner = runner_for(output_dir, "auto", group)
        runner.init_workers()
        report: dict = {"resumed_at": runner.global_steps, "saved": []}
        batches = iter(runner.train_dataloader)
        for step in steps:
            batch = next(batches).tolist()
            group.call("train", step, batch)
            runner.global_steps = step
            runner._save_checkpoint()
            report["saved"].append({"step": step, "digests": group.call("digests"),
                                    "next": _next_batch(runner)})
        return report
    finally:
        group.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--output-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--save", help="train and save these steps (comma-separated) on a "
                                   "group of --world ranks, after init_workers")
    ap.add_argument("--world", type=int, default=2)
    args = ap.parse_args()
    if args.save:
        steps = [int(s) for s in args.save.split(",")]
        report = train_and_save(args.output_dir, steps, args.world)
        Path(args.out, "run.json").write_text(json.dumps(report))
        return
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
