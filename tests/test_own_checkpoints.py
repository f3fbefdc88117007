"""A manager restores from and deletes only its own checkpoints: training checkpoints
named by its ``name_format``. A user's other checkpoints in the same run root are
neither counted, nor deleted, nor called corrupt (moto over HTTP)."""

from __future__ import annotations

import logging

import torch

from cloudckpt import (
    CheckpointManager,
    CheckpointWriter,
    ManagerOptions,
    StepInfo,
    list_checkpoints,
)
from cloudckpt.core.retention import Managed


def _user_checkpoint(uri: str, options: dict, step: int) -> None:
    with CheckpointWriter(uri, step=step, storage_options=options) as w:
        w.put("weights.bin", b"the user's own bytes" * 10)


def _train(mgr: CheckpointManager, steps: range) -> None:
    info = StepInfo()
    for _ in range(steps.start):
        info = info.next()
    for g in steps:
        mgr.save(info, {"w": torch.full((8,), float(g))})
        info = info.next()
    mgr.close()


def test_retention_keeps_and_counts_only_the_managers_own_checkpoints(s3):
    _user_checkpoint(s3.uri("weights-step-2"), s3.options, 2)
    _user_checkpoint(s3.uri("best-model"), s3.options, 10)
    mgr = CheckpointManager(s3.root, ManagerOptions(every_steps=1, keep_last=2),
                            storage_options=s3.options)
    _train(mgr, range(5))
    names = sorted(c.name for c in list_checkpoints(s3.root, s3.options))
    # Two training checkpoints kept beside the user's two, which are untouched.
    assert names == ["best-model", "step-3", "step-4", "weights-step-2"]


def test_restore_passes_over_other_kinds_of_checkpoints_without_a_word(s3, caplog):
    mgr = CheckpointManager(s3.root, ManagerOptions(every_steps=1), storage_options=s3.options)
    _train(mgr, range(3))
    for i in range(5):  # newer steps than the manager's, and other kinds
        _user_checkpoint(s3.uri(f"best-model-{i}"), s3.options, 100 + i)
    _user_checkpoint(s3.uri("step-50"), s3.options, 50)  # our naming, not our kind
    state = {"w": torch.zeros(8)}
    with caplog.at_level(logging.WARNING, logger="cloudckpt"):
        info = CheckpointManager(s3.root, storage_options=s3.options).restore(state)
    assert info is not None and info.global_step == 2
    assert torch.equal(state["w"], torch.full((8,), 2.0))
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def test_a_root_holding_only_other_checkpoints_is_a_fresh_start(s3):
    _user_checkpoint(s3.uri("best-model"), s3.options, 10)
    mgr = CheckpointManager(s3.root, storage_options=s3.options)
    assert mgr.restore({"w": torch.zeros(8)}) is None
    assert mgr.latest() is None


def test_managed_names_follow_the_name_format():
    own = Managed.from_format("training", "ckpt_{step}.v1")
    assert own.number("ckpt_12.v1") == 12
    assert own.number("ckpt_12.v10") is None
    assert own.number("ckptX12.v1") is None
    assert own.number("ckpt_.v1") is None
