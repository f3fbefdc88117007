"""RLinf's runner on a bucket: what ``ReasoningRunner`` does around its workers' saves
(``rlinf/runners/reasoning_runner.py``) when ``runner.output_dir`` is a bucket URI.

A step is one committed checkpoint ``{output_dir}/{experiment_name}/checkpoints/
global_step_N`` (kind ``rlinf``): the driver claims it, RLinf's workers commit their
parts below it (``actor/``, ``critic/``: :mod:`.strategy`), then the driver adds them
and ``data/data.pt`` and commits. A crash before that leaves no step, so ``resume_dir:
auto`` (the newest committed step of ``output_dir``) never resumes a torn one.
"""

from __future__ import annotations

import logging
from typing import Any

from cloudckpt.core.checkpoint import Checkpoint
from cloudckpt.errors import ConfigError
from cloudckpt.integrations.rlinf.checkpointer import read_data_state
from cloudckpt.integrations.rlinf.layout import (
    ACTOR,
    CRITIC,
    DATA_PATH,
    KEY_PREFIX,
    KIND,
    checkpoints_root,
    step_name,
)
from cloudckpt.integrations.rlinf.resume import open_rlinf_checkpoint, resolve_resume_dir
from cloudckpt.serialization.torchload import torch_bytes
from cloudckpt.storage import is_remote, open_store
from cloudckpt.training import multipart

log = logging.getLogger(__name__)


def save_step(runner: Any) -> Checkpoint:
    """``ReasoningRunner._save_checkpoint`` for a bucket: the same worker calls, in
    RLinf's order, inside one committed step."""
    r = runner.cfg.runner
    step = int(runner.global_steps)
    store = open_store(f"{checkpoints_root(r.output_dir, r.experiment_name)}/{step_name(step)}")
    workers = [(ACTOR, runner.actor)]
    if getattr(runner, "critic", None):
        workers.append((CRITIC, runner.critic))
    meta = {"parts": [name for name, _ in workers], "layout": "rlinf-fsdp",
            "key_prefix": KEY_PREFIX}

    def saver(worker: Any) -> Any:  # every rank of the group commits its part
        return lambda uri: worker.save_checkpoint(uri, step).wait()

    committed = multipart.drive(
        store, [(name, saver(worker)) for name, worker in workers],
        {DATA_PATH: lambda: torch_bytes(runner.train_dataloader.state_dict())},
        step=step, kind=KIND, metadata=meta)
    log.info("RLinf step %d committed at %s", step, committed.uri)
    return committed


def resolve(runner: Any) -> None:
    """``runner.resume_dir`` as ``init_workers`` then reads it: ``auto`` becomes the
    newest committed step of the bucket (or None), a bucket URI a committed step."""
    r = runner.cfg.runner
    root = checkpoints_root(r.output_dir, r.experiment_name)
    if r.resume_dir is None and is_remote(r.output_dir):
        refuse_fresh_start(root)
    if not (r.resume_dir == "auto" or is_remote(r.resume_dir)):
        return
    r.resume_dir = resolve_resume_dir(r.resume_dir, root)
    log.info("resume_dir resolved in %s: %s", root, r.resume_dir or "nothing committed, "
             "a fresh start")


def refuse_fresh_start(root: str) -> None:
    """A run without ``resume_dir`` over a bucket that holds committed steps would train
    from step 0 and fail at its first save, on a step name already committed (steps are
    immutable): refused before any training, with the key that resumes. Checked where
    the entry script's ``output_redirector`` gets the config, before RLinf's runner
    starts its loggers (an exception after wandb's start hangs the process at exit, in
    ``MetricLogger.__del__``), and again in ``init_workers`` for other entry points."""
    newest = resolve_resume_dir("auto", root)
    if newest is not None:
        raise ConfigError(
            f"{root} holds committed RLinf steps (the newest {newest}) and "
            "runner.resume_dir is null, so this run would start over and collide with them "
            "at its first save. Relaunch with runner.resume_dir=auto to resume the newest, "
            "or give the run a new runner.experiment_name (or output_dir), or delete the "
            f"old steps (cloudckpt rm {root}/<step>)")


def load_data(runner: Any) -> None:
    """The ``data/data.pt`` of a bucket step, into the runner's dataloader (RLinf's own
    loader checks a local path and skips a URI)."""
    r = runner.cfg.runner
    if not is_remote(r.resume_dir):
        return
    ckpt = open_rlinf_checkpoint(r.resume_dir)
    if DATA_PATH not in ckpt.manifest.files:
        log.warning("%s holds no %s: the dataloader starts from scratch", ckpt.uri, DATA_PATH)
        return
    runner.train_dataloader.load_state_dict(read_data_state(ckpt))
    log.info("dataloader state loaded from %s/%s", ckpt.uri, DATA_PATH)
