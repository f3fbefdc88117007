"""Crash workloads through each framework's own save path under activation, and the
fresh-process checks after each SIGKILL (test_framework_torture.py).

Imported once by a forkserver (its preload), which activates cloudckpt's integrations
and imports the frameworks' modules, so each forked trial runs the frameworks' own
code, bound, without paying for the imports:

- ``roll_ops``: ROLL's ``CheckpointManager`` (``type: s3``, the registry bound) uploads
  the actor's and the pipeline's directory of ``checkpoint-N``, step after step;
- ``rlinf_ops``: RLinf's ``ReasoningRunner._save_checkpoint`` (bound) with RLinf's
  FSDP2 strategy on one gloo rank commits ``global_step_N``;
- ``areal_ops``: the ``RecoverHandler`` AReaL's ``sft_trainer`` module names (bound:
  cloudckpt's for a bucket) dumps AReaL's FSDPEngine state of step N.

Each workload resumes from what the last kill left, as a relaunch would, and logs
``start N`` / ``commit N`` (crash_worker's event log) around each save; the state of
step N is a function of N, so a check can tell what it loaded.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("ROLL_LOG_DIR", tempfile.mkdtemp(prefix="roll-logs-"))
sys.path[:] = [p for p in sys.path if "peers/rlinf" not in p.replace(os.sep, "/")]

import torch  # noqa: E402

from cloudckpt import activation  # noqa: E402

activation.activate(["areal", "roll", "rlinf"])

import areal.trainer  # noqa: E402,F401 - binds the trainers' Saver/RecoverHandler
import areal_parts  # noqa: E402
import rlinf.hybrid_engines.fsdp.strategy.base  # noqa: E402,F401 - binds the strategy
import rlinf.runners.reasoning_runner  # noqa: E402,F401 - binds the runner
import rlinf_runner_driver as rd  # noqa: E402
import rlinf_strategy_ranks as rs  # noqa: E402
import roll.utils.checkpoint_manager as roll_cm  # noqa: E402 - binds the registries
from areal.api.cli_args import RecoverConfig  # noqa: E402
from areal.api.io_struct import StepInfo  # noqa: E402
from areal.trainer import sft_trainer  # noqa: E402
from crash_worker import Events, _guard, tensor_for  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from cloudckpt import list_checkpoints  # noqa: E402
from cloudckpt.training.slot import RecoverSlot  # noqa: E402

TRIAL = "exp/trial"  # AReaL's trial directory below fileroot: checkpoints/{user}/...


def _init_gloo() -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(rs._free_port()),
                          RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        dist.init_process_group("gloo", rank=0, world_size=1)


def _committed_steps(root: str, opts: dict[str, Any], prefix: str) -> list[int]:
    return sorted(int(c.name.removeprefix(prefix)) for c in list_checkpoints(root, opts)
                  if c.name.startswith(prefix))


# --------------------------------------------------------------------- ROLL


def roll_config(root: str, opts: dict[str, Any]) -> dict[str, Any]:
    return {"type": "s3", "output_dir": root, "storage_options": opts, "async_upload": False,
            "expected_uploads": 2, "download_dir": tempfile.mkdtemp(prefix="roll-resume-")}


def roll_ops(root: str, opts: dict[str, Any], env: dict[str, str], log: str,
             seed: int) -> None:
    os.environ.update(env)  # the bound framework code takes credentials from there
    events = Events(log)

    def run() -> None:
        manager = roll_cm.CheckpointManager(checkpoint_config=roll_config(root, opts))
        step = max(_committed_steps(root, opts, "checkpoint-"), default=0) + 1
        events.say("ready")
        while True:
            events.say("start", step)
            local = Path(tempfile.mkdtemp())
            actor = local / "actor_train-0" / f"checkpoint-{step}"
            actor.mkdir(parents=True)
            save_file({"w": tensor_for(step)}, str(actor / "model.safetensors"))
            pipeline = local / "pipeline" / f"checkpoint-{step}" / "pipeline"
            pipeline.mkdir(parents=True)
            (pipeline / "worker_state_pipeline.json").write_text(json.dumps({"step": step}))
            manager.upload(ckpt_id=f"checkpoint-{step}", local_state_path=str(actor))
            manager.upload(ckpt_id=f"checkpoint-{step}", local_state_path=str(pipeline.parent))
            events.say("commit", step)  # the second part's upload committed it
            step += 1

    _guard(events, run)


def roll_check(root: str, opts: dict[str, Any], env: dict[str, str], out: str) -> None:
    """ROLL's own resume (``get_latest_ckpt``) of what the kill left."""
    os.environ.update(env)
    latest = roll_cm.get_latest_ckpt(roll_config(root, opts))
    report: dict[str, Any] = {"visible": _committed_steps(root, opts, "checkpoint-"),
                              "latest": None, "problems": []}
    if latest:
        step = json.loads(Path(latest, "pipeline", "worker_state_pipeline.json").read_text())
        report["latest"] = step["step"]
        if not torch.equal(load_file(str(Path(latest, "model.safetensors")))["w"],
                           tensor_for(step["step"])):
            report["problems"].append(f"checkpoint-{step['step']}'s tensor is not its own")
    Path(out).write_text(json.dumps(report))


# -------------------------------------------------------------------- RLinf


def _rlinf_state(step: int) -> tuple:
    """RLinf's FSDP2 strategy, model, optimizer and scheduler of step ``step``."""
    from rlinf.scheduler import Worker

    Worker.torch_platform, Worker.torch_device_type = rs.CpuPlatform(), "cpu"
    rs.WORLD = 1
    parts = rs.build(rs.cfg_for("dcp"), seed=step)
    rs.train(*parts, 0, 1)
    return parts


def rlinf_ops(root: str, opts: dict[str, Any], env: dict[str, str], log: str,
              seed: int) -> None:
    os.environ.update(env)  # the bound framework code takes credentials from there
    events = Events(log)

    def run() -> None:
        _init_gloo()
        step = max(_committed_steps(f"{root}/exp/checkpoints", opts, "global_step_"),
                   default=0) + 1
        events.say("ready")
        while True:
            events.say("start", step)
            runner = rd.runner_for(root, None, rd.ActorGroup(*_rlinf_state(step)))
            runner.global_steps = step
            runner._save_checkpoint()
            events.say("commit", step)
            step += 1

    _guard(events, run)


def rlinf_check(root: str, opts: dict[str, Any], env: dict[str, str], out: str) -> None:
    """RLinf's own ``init_workers`` with ``resume_dir: auto`` into a fresh strategy."""
    os.environ.update(env)
    _init_gloo()
    visible = _committed_steps(f"{root}/exp/checkpoints", opts, "global_step_")
    report: dict[str, Any] = {"visible": visible, "latest": None, "problems": []}
    fresh = _rlinf_state(10_000)
    runner = rd.runner_for(root, "auto", rd.ActorGroup(*fresh))
    runner.init_workers()
    if runner.cfg.runner.resume_dir is not None:
        report["latest"] = runner.global_steps
        want = rd.digest(rs.snapshot(*_rlinf_state(runner.global_steps)[1:]))["model_full"]
        if rd.digest(rs.snapshot(*fresh[1:]))["model_full"] != want:
            report["problems"].append(f"step {runner.global_steps} loaded another model")
    Path(out).write_text(json.dumps(report))


# -------------------------------------------------------------------- AReaL


def _areal_engine(step: int) -> Any:
    torch.manual_seed(step)
    engine = areal_parts.fsdp_engine()
    for p in engine.model.parameters():
        p.data.copy_(torch.randn_like(p))
    return engine


def _areal_handler(root: str, opts: dict[str, Any]) -> Any:
    cfg = RecoverConfig(experiment_name="exp", trial_name="trial", fileroot=root, mode="on",
                        freq_steps=1)
    return sft_trainer.RecoverHandler(cfg, areal_parts.FT_SPEC, storage_options=opts)


def _slot(root: str, opts: dict[str, Any]) -> RecoverSlot:
    import getpass

    return RecoverSlot(f"{root}/checkpoints/{getpass.getuser()}/{TRIAL}", storage_options=opts)


def areal_ops(root: str, opts: dict[str, Any], env: dict[str, str], log: str,
              seed: int) -> None:
    os.environ.update(env)  # the bound framework code takes credentials from there
    events = Events(log)

    def run() -> None:
        _init_gloo()
        handler = _areal_handler(root, opts)
        assert type(handler).__module__.startswith("cloudckpt."), type(handler)
        info = _slot(root, opts).info()
        step = (info["step"] if info else 0) + 1
        spe = areal_parts.FT_SPEC.steps_per_epoch
        events.say("ready")
        while True:
            events.say("start", step)
            handler.dump(dict(default=_areal_engine(step)),
                         StepInfo(epoch=step // spe, epoch_step=step % spe, global_step=step,
                                  steps_per_epoch=spe), None, None, None, None)
            events.say("commit", step)
            step += 1

    _guard(events, run)


def areal_check(root: str, opts: dict[str, Any], env: dict[str, str], out: str) -> None:
    """The bound RecoverHandler's ``load`` into a fresh engine."""
    os.environ.update(env)
    _init_gloo()
    report: dict[str, Any] = {"visible": [], "latest": None, "slot": None, "problems": []}
    engine = _areal_engine(10_000)
    info = _areal_handler(root, opts).load(dict(default=engine), None, None, None, None)
    if info is not None:
        step = info.last_step_info.global_step
        report["latest"] = report["slot"] = step
        want = _areal_engine(step).model.state_dict()
        if any(not torch.equal(t, want[k]) for k, t in engine.model.state_dict().items()):
            report["problems"].append(f"the dump of step {step} loaded another model")
    Path(out).write_text(json.dumps(report))
