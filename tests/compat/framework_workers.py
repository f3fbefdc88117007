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
  cloudckpt's for a bucket) dumps AReaL's FSDPEngine state of step N;
- ``verl_ops``: verl's ``RayPPOTrainer._save_checkpoint`` (bound) with verl's
  ``FSDPCheckpointManager`` (FSDP2, one gloo rank) commits ``global_step_N``; it can
  also kill itself at a chosen point of step K (mid-upload, before the commit, between
  the commit and the tracker).

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

activation.activate(["areal", "roll", "rlinf", "verl"])

import areal.trainer  # noqa: E402,F401 - binds the trainers' Saver/RecoverHandler
import areal_parts  # noqa: E402
import rlinf.hybrid_engines.fsdp.strategy.base  # noqa: E402,F401 - binds the strategy
import rlinf.runners.reasoning_runner  # noqa: E402,F401 - binds the runner
import rlinf_runner_driver as rd  # noqa: E402
import rlinf_strategy_ranks as rs  # noqa: E402
import roll.utils.checkpoint_manager as roll_cm  # noqa: E402 - binds the registries
import verl.trainer.ppo.ray_trainer  # noqa: E402,F401 - binds the trainer
import verl.utils.checkpoint.fsdp_checkpoint_manager  # noqa: E402,F401 - binds the manager
from areal.api.cli_args import RecoverConfig  # noqa: E402
from areal.api.io_struct import StepInfo  # noqa: E402
from areal.trainer import sft_trainer  # noqa: E402
from crash_worker import Events, _guard, tensor_for  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from verl_parts import BATCHES, digests_of, init_gloo, resumed, trainer_for  # noqa: E402

from cloudckpt import list_checkpoints  # noqa: E402
from cloudckpt.training.slot import RecoverSlot  # noqa: E402

TRIAL = "exp/trial"  # AReaL's trial directory below fileroot: checkpoints/{user}/...


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
        init_gloo()
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
    init_gloo()
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
        init_gloo()
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
    init_gloo()
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


# --------------------------------------------------------------------- verl

def _kill_at(point: str, step: int, current: list[int]) -> None:
    """SIGKILL this process at ``point`` of step ``step``: ``upload`` (after the first
    file of the actor's part went up), ``commit`` (every file up, before the step's
    commit) or ``tracker`` (after the commit, before the tracker)."""
    import signal

    from cloudckpt.core.checkpoint import CheckpointWriter
    from cloudckpt.integrations.verl import trainer as vt
    from cloudckpt.training import staging

    def die() -> None:
        if current[0] == step:
            os.kill(os.getpid(), signal.SIGKILL)

    if point == "upload":
        own_send = staging._send

        def send(store, root, rel):
            info = own_send(store, root, rel)
            die()
            return info
        staging._send = send
    elif point == "commit":
        own_commit = CheckpointWriter.commit

        def commit(self, *a, **kw):
            if self.kind == "verl":
                die()
            return own_commit(self, *a, **kw)
        CheckpointWriter.commit = commit
    elif point == "tracker":
        own_tracker = vt.write_tracker

        def tracker(*a, **kw):
            die()
            return own_tracker(*a, **kw)
        vt.write_tracker = tracker


def verl_ops(root: str, opts: dict[str, Any], env: dict[str, str], log: str, seed: int,
             kill: str | None = None, kill_step: int = 0, async_save: bool = False) -> None:
    os.environ.update(env)  # the bound framework code takes credentials from there
    events = Events(log)
    current = [0]
    if kill:
        _kill_at(kill, kill_step, current)

    def run() -> None:
        step = max(_committed_steps(root, opts, "global_step_"), default=0) + 1
        events.say("ready")
        while True:
            current[0] = step
            events.say("start", step)
            trainer_for(root, step, async_save=async_save)._save_checkpoint()
            events.say("commit", step)
            step += 1

    _guard(events, run)


def verl_check(root: str, opts: dict[str, Any], env: dict[str, str], out: str) -> None:
    """verl's own ``_load_checkpoint`` (bound; ``resume_mode: auto``) into a fresh
    trainer; the tracker as it stands."""
    from cloudckpt.storage import open_store

    os.environ.update(env)
    fresh = trainer_for(root, 0)
    fresh.global_steps = 0
    report: dict[str, Any] = {"visible": _committed_steps(root, opts, "global_step_"),
                              "latest": None, "problems": [], "tracker": None}
    store = open_store(root, opts)
    if store.exists("latest_checkpointed_iteration.txt"):
        report["tracker"] = int(store.get("latest_checkpointed_iteration.txt"))
    fresh._load_checkpoint()
    if fresh.global_steps:
        step = report["latest"] = fresh.global_steps
        loaded = digests_of(fresh)  # before `want` reseeds the RNGs
        want = trainer_for(root, step)
        if loaded != digests_of(want):
            report["problems"].append(f"step {step} loaded another model, optimizer or RNG")
        drawn = next(iter(fresh.train_dataloader)).tolist()
        if drawn != [step % BATCHES]:  # batches of 1, in order: step N drew N of them
            report["problems"].append(f"step {step}'s dataloader draws {drawn} next")
    if report["tracker"] is not None and report["tracker"] not in report["visible"]:
        report["problems"].append(f"the tracker names step {report['tracker']}, which is "
                                  "not committed")
    Path(out).write_text(json.dumps(report))


def verl_run(out: str, env: dict[str, str], root: str, steps: list[int],
             trainer: dict[str, Any], critic: bool = False) -> None:
    """verl's ``_save_checkpoint`` at each of ``steps``, then its ``_load_checkpoint`` in a
    fresh trainer (``resume_mode: auto``), against the last step's state."""
    os.environ.update(env)
    for step in steps:
        trainer_for(root, step, critic=critic, **trainer)._save_checkpoint()
    report = resumed(trainer_for(root, 0, critic=critic, **trainer),
                     lambda: trainer_for(root, steps[-1], critic=critic, **trainer))
    trainer_class = verl.trainer.ppo.ray_trainer.RayPPOTrainer
    report["bound"] = hasattr(trainer_class._save_checkpoint, "__wrapped__")
    Path(out).write_text(json.dumps(report))


def verl_roundtrip(root: str, opts: dict[str, Any], env: dict[str, str], out: str,
                   local: str) -> None:
    """Both directions between verl's own local layout and the bucket:

    - verl's own ``_save_checkpoint`` writes step 5 on local disk; ``cloudckpt verl
      upload`` commits it under ``root``; the bound ``_load_checkpoint`` resumes it;
    - the bound trainer commits step 6 in the bucket; ``cloudckpt verl download``
      brings it into a local ``default_local_dir``; verl's own ``find_latest_ckpt_path``
      finds it and verl's own ``_load_checkpoint`` (the manager's ``torch.load``)
      resumes it.
    """
    from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path

    from cloudckpt.cli import main

    os.environ.update(env)
    report: dict[str, Any] = {}

    def resume_at(at: str, step: int) -> dict[str, Any]:
        return resumed(trainer_for(at, 0), lambda: trainer_for(at, step))

    written = Path(local, "written")
    trainer_for(str(written), 5)._save_checkpoint()  # verl's own code: a local path
    report["local_tracker"] = (written / "latest_checkpointed_iteration.txt").read_text()
    report["upload_rc"] = main(["verl", "upload", str(written / "global_step_5"), root])
    report["up"] = resume_at(root, 5)

    trainer_for(root, 6)._save_checkpoint()
    fetched = Path(local, "fetched")
    report["download_rc"] = main(["verl", "download", f"{root}/global_step_6", str(fetched)])
    report["found"] = find_latest_ckpt_path(str(fetched))
    report["down"] = resume_at(str(fetched), 6)
    Path(out).write_text(json.dumps(report))


class _Payload:
    """Pickles to a call that creates ``path`` when unpickled: code, not data."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def verl_hostile(root: str, opts: dict[str, Any], env: dict[str, str], out: str,
                 local: str) -> None:
    """A verl step whose extra state carries pickled code (a well-formed ``torch.save``
    file, uploaded with ``cloudckpt verl upload``): the bound resume refuses it, and the
    code never runs."""
    from cloudckpt.cli import main

    os.environ.update(env)
    written = Path(local, "written")
    trainer_for(str(written), 3)._save_checkpoint()  # verl's own code: a local path
    marker = Path(local, "pwned")
    extra = written / "global_step_3" / "actor" / "extra_state_world_size_1_rank_0.pt"
    torch.save({"lr_scheduler": None, "rng": _Payload(str(marker))}, extra)
    report: dict[str, Any] = {"upload_rc": main(["verl", "upload", str(extra.parents[1]),
                                                 root])}
    try:
        trainer_for(root, 0)._load_checkpoint()
        report["error"] = None
    except Exception as exc:  # noqa: BLE001 - the test reads what was raised
        report["error"] = f"{type(exc).__name__}: {exc}"
    report["ran"] = marker.exists()
    Path(out).write_text(json.dumps(report))


def verl_refused(root: str, env: dict[str, str], out: str) -> None:
    """Two steps verl's bound ``_load_checkpoint`` refuses, each before it loads a
    thing: one without the critic part a trainer with a critic resumes (the actor's
    files are fine), one saved without optimizer states (``save_contents``) that a
    trainer loading them resumes (the model file is fine). Each case reports the error,
    and whether every role's model, optimizer, scheduler and RNG, the step and the
    dataloader stayed as they were."""
    os.environ.update(env)
    trainer_for(f"{root}/no-critic", 2)._save_checkpoint()
    trainer_for(f"{root}/no-optim", 2, contents=["model", "extra"])._save_checkpoint()
    report = {}
    for case, critic in (("no-critic", True), ("no-optim", False)):
        fresh = trainer_for(f"{root}/{case}", 0, critic=critic)
        before = digests_of(fresh)
        try:
            fresh._load_checkpoint()
            error = None
        except Exception as exc:  # noqa: BLE001 - the test reads what was raised
            error = f"{type(exc).__name__}: {exc}"
        report[case] = {"error": error, "same": digests_of(fresh) == before,
                        "step": fresh.global_steps,
                        "next": next(iter(fresh.train_dataloader)).tolist()}
    Path(out).write_text(json.dumps(report))


def verl_profiles(root: str, env: dict[str, str], out: str) -> None:
    """Save profiles from verl's own options: a step saved without the optimizer
    (``save_contents: [model, extra]``), one LoRA-only (``save_lora_only``), and their
    records; the first resumed by a trainer whose ``load_contents`` is verl's default
    (refused before anything loads), the same with $CLOUDCKPT_ALLOW_PARTIAL_RESUME=1,
    and by one whose ``load_contents`` leaves the optimizer out (verl's own way); the
    LoRA step resumed onto the base model, as verl's own load does."""
    import logging

    from cloudckpt import open_checkpoint

    os.environ.update(env)
    os.environ.pop("CLOUDCKPT_ALLOW_PARTIAL_RESUME", None)
    warnings: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                warnings.append(record.getMessage())

    logging.getLogger().addHandler(Keep())
    weights, lora = f"{root}/weights", f"{root}/lora"
    trainer_for(weights, 2, contents=["model", "extra"])._save_checkpoint()
    trainer_for(lora, 2, lora=True)._save_checkpoint()
    report: dict[str, Any] = {"records": {
        name: open_checkpoint(f"{uri}/global_step_2/actor").metadata["profile"]
        for name, uri in (("weights", weights), ("lora", lora))}}
    report["lora_files"] = sorted(open_checkpoint(f"{lora}/global_step_2/actor").files)

    def resume(case: str, uri: str, allow: bool = False, **options: Any) -> None:
        if allow:
            os.environ["CLOUDCKPT_ALLOW_PARTIAL_RESUME"] = "1"
        fresh = trainer_for(uri, 0, **options)
        before = digests_of(fresh)["actor"]
        del warnings[:]
        try:
            fresh._load_checkpoint()
            error = None
        except Exception as exc:  # noqa: BLE001 - the test reads what was raised
            error = f"{type(exc).__name__}: {exc}"
        finally:
            os.environ.pop("CLOUDCKPT_ALLOW_PARTIAL_RESUME", None)
        got = digests_of(fresh)["actor"]  # before `want` reseeds the RNGs
        want = digests_of(trainer_for(uri, 2, **options))["actor"]
        report[case] = {"error": error, "step": fresh.global_steps, "warnings": list(warnings),
                        "unchanged": sorted(k for k in got if got[k] == before[k]),
                        "as_saved": sorted(k for k in got if got[k] == want[k])}

    resume("refused", weights)
    resume("allowed", weights, allow=True)
    resume("load_contents", weights, load=["model", "extra"])
    resume("lora", lora, lora=True)
    Path(out).write_text(json.dumps(report))


def verl_hf(root: str, env: dict[str, str], out: str) -> None:
    """Step 1 saved with ``hf_model`` in ``save_contents`` (verl gathers the model into
    ``actor/huggingface/``), step 2 without; what each role's part holds."""
    from cloudckpt import open_checkpoint

    os.environ.update(env)
    trainer_for(root, 1, contents=["model", "optimizer", "extra", "hf_model"])._save_checkpoint()
    trainer_for(root, 2)._save_checkpoint()
    report = {}
    for step in (1, 2):
        files = open_checkpoint(f"{root}/global_step_{step}").files
        report[step] = sorted(f for f in files if "/huggingface/" in f)
    Path(out).write_text(json.dumps(report))
