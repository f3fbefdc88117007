"""An AReaL-shaped training loop with its checkpoints in a bucket.

It follows AReaL's call flow: ``recover_handler.load(...)`` at start, then each step
``saver.save(...)`` (HF export when due) and ``recover_handler.dump(...)`` (recover
checkpoint when due), with the ``saver:``/``recover:`` sections of ``config.yaml``.

    python examples/areal/train.py --config examples/areal/config.yaml \\
        --storage-options '{"endpoint_url": "http://127.0.0.1:9000"}'
    python examples/areal/train.py --demo     # embedded S3: crash, relaunch, resume

A run killed at any point and started again resumes from the last committed dump,
bit-exactly: per-step losses go to stdout as ``step N loss <float.hex()>``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import warnings
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # examples/train_resume.py

from train_resume import CONFIG, SyntheticLoader, build_model  # noqa: E402

from cloudckpt import StepInfo  # noqa: E402
from cloudckpt.integrations.areal import (
    Engine,
    FreqCtl,
    RecoverHandler,
    Saver,
    load_yaml,
    run_with_retries,
)

HERE = Path(__file__).resolve().parent
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


class StatsLogger:
    """The part of AReaL's StatsLogger that recover saves: the last committed step."""

    def __init__(self) -> None:
        self.last_commit_step = 0

    def commit(self, global_step: int) -> None:
        self.last_commit_step = global_step

    def state_dict(self) -> dict:
        return {"last_commit_step": self.last_commit_step}

    def load_state_dict(self, state: dict) -> None:
        self.last_commit_step = int(state["last_commit_step"])


class Evaluator:
    """AReaL's Evaluator shape: a frequency controller whose state is recover info."""

    def __init__(self, freq_steps: int | None) -> None:
        self.freq_ctl = FreqCtl(None, freq_steps, None)

    def evaluate(self, fn, step: StepInfo, steps_per_epoch: int) -> None:
        if self.freq_ctl.check(epochs=int(step.epoch_step == steps_per_epoch - 1), steps=1):
            fn()

    def state_dict(self) -> dict:
        return self.freq_ctl.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.freq_ctl.load_state_dict(state)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(HERE / "config.yaml"))
    p.add_argument("--fileroot", default=None, help="override the saver's and recover's fileroot")
    p.add_argument("--trial-name", default=None, help="override trial_name")
    p.add_argument("--storage-options", default="{}", help="JSON storage options")
    p.add_argument("--steps", type=int, default=14, help="total training steps")
    p.add_argument("--samples", type=int, default=48, help="dataset size (8 per batch)")
    p.add_argument("--crash-at-step", type=int, default=None,
                   help="SIGKILL this process right after this step's update")
    p.add_argument("--crash-once-marker", default=None,
                   help="with --crash-at-step: crash only if this file does not exist yet")
    p.add_argument("--out", default=None, help="write the final parameters here")
    p.add_argument("--demo", action="store_true",
                   help="start an embedded S3, crash a run once, relaunch it, resume")
    return p.parse_args(argv)


def train(args: argparse.Namespace) -> int:
    saver_cfg, recover_cfg = load_yaml(args.config)
    overrides = {k: v for k, v in (("fileroot", args.fileroot),
                                   ("trial_name", args.trial_name)) if v}
    saver_cfg, recover_cfg = replace(saver_cfg, **overrides), replace(recover_cfg, **overrides)
    options = json.loads(args.storage_options)
    torch.set_num_threads(1)

    model = build_model(1)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=5, gamma=0.7)
    loader = SyntheticLoader(n=args.samples, batch=8, rank=0, world=1)
    engine = Engine(model, optim, sched, hf_config=CONFIG)
    steps_per_epoch = len(loader)
    saver = Saver(saver_cfg, steps_per_epoch, storage_options=options)
    recover = RecoverHandler(recover_cfg, steps_per_epoch, storage_options=options)
    evaluator, stats_logger = Evaluator(freq_steps=4), StatsLogger()
    evaluated: list[int] = []

    info = recover.load(engine, saver, evaluator, stats_logger, loader)
    if info is not None:
        step = info.last_step_info.next()
        print(f"resumed at step {step.global_step}", flush=True)
    else:
        step = StepInfo(steps_per_epoch=steps_per_epoch)

    while step.global_step < args.steps:
        x, y = loader.next()
        loss = torch.nn.functional.mse_loss(model(x), y)
        optim.zero_grad()
        loss.backward()
        optim.step()
        sched.step()
        print(f"step {step.global_step} loss {loss.item().hex()}", flush=True)
        if step.global_step == args.crash_at_step:
            marker = Path(args.crash_once_marker) if args.crash_once_marker else None
            if marker is None or not marker.exists():
                if marker is not None:
                    marker.touch()
                print(f"crashing at step {step.global_step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
        evaluator.evaluate(lambda s=step: evaluated.append(s.global_step), step, steps_per_epoch)
        exported = saver.last_export
        saver.save(engine, step.epoch, step.epoch_step, step.global_step)
        if saver.last_export != exported:
            print(f"exported step {step.global_step}", flush=True)
        recover.dump(engine, step, saver, evaluator, stats_logger, loader)
        if recover.last_step_info == step:
            print(f"dumped step {step.global_step}", flush=True)
        stats_logger.commit(step.global_step)
        step = step.next()

    if args.out:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, args.out)
    print("done", flush=True)
    return 0


def demo(args: argparse.Namespace) -> int:
    """Embedded S3: the first launch is killed at step 8, the launcher relaunches it,
    the relaunch resumes from the bucket and finishes."""
    import tempfile

    from cloudckpt_testkit import MotoServer

    from cloudckpt import open_store

    saver_cfg, _ = load_yaml(args.config)
    bucket = saver_cfg.fileroot.removeprefix("s3://").split("/", 1)[0]
    with MotoServer() as server, tempfile.TemporaryDirectory() as tmp:
        server.create_bucket(bucket)
        cmd = [sys.executable, __file__, "--config", args.config, "--storage-options",
               json.dumps(server.storage_options()), "--steps", str(args.steps),
               "--crash-at-step", "8", "--crash-once-marker", str(Path(tmp) / "crashed")]
        run_with_retries(cmd, retries=2, delay_s=1.0)
        root = f"{saver_cfg.fileroot.rstrip('/')}/checkpoints"
        shown = set()
        for obj in open_store(root, server.storage_options()).list():
            key = re.sub(r"/(gen-[0-9a-f-]+)/.*", r"/\1/...", obj.key)
            if key not in shown:
                shown.add(key)
                print(f"{root}/{key}")
    return 0


if __name__ == "__main__":
    ns = parse_args()
    sys.exit(demo(ns) if ns.demo else train(ns))
