"""Recover slots: one generation at rest, CAS switch, crash and race torture."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import finish

from cloudckpt import CheckpointNotFoundError, CommitConflictError, RecoverSlot, StepInfo
from cloudckpt.core.checkpoint import open_checkpoint

CHILD = str(Path(__file__).parent / "slot_child.py")


def state(value: float) -> dict:
    return {"w": torch.full((256,), value), "b": torch.arange(16) * value}


def load_value(slot: RecoverSlot) -> float:
    target = {"w": torch.zeros(256), "b": torch.zeros(16, dtype=torch.int64)}
    restored = slot.load(target, rng=False)
    value = float(target["w"][0])
    assert torch.equal(target["w"], torch.full((256,), value))
    assert torch.equal(target["b"], (torch.arange(16) * value).to(torch.int64))
    return value, restored


def test_save_load_keeps_one_generation(backend):
    slot = RecoverSlot(backend.uri("recover"), storage_options=backend.options)
    assert not slot.exists() and slot.info() is None
    with pytest.raises(CheckpointNotFoundError, match="empty"):
        slot.load(state(0))
    for k in range(1, 5):
        gen = slot.save(state(float(k)), step_info=StepInfo(global_step=k), extra={"k": k})
        assert slot.generations() == [gen]
    value, restored = load_value(slot)
    assert value == 4.0 and restored.shared == {"k": 4}
    assert restored.step_info.global_step == 4 and slot.info()["step"] == 4
    open_checkpoint(slot.store.child(slot.info()["generation"])).verify(deep=True)


def test_losing_writer_gets_conflict_and_removes_its_generation(backend):
    uri = backend.uri("recover")
    RecoverSlot(uri, storage_options=backend.options).save(state(1.0))
    other = RecoverSlot(uri, storage_options=backend.options)

    class Interleaved(RecoverSlot):
        def _swap(self, *a, **k):
            other.save(state(2.0))  # another writer wins while this one is writing
            return super()._swap(*a, **k)

    loser = Interleaved(uri, storage_options=backend.options)
    with pytest.raises(CommitConflictError, match="another writer saved"):
        loser.save(state(3.0))
    assert load_value(RecoverSlot(uri, storage_options=backend.options))[0] == 2.0
    assert len(loser.generations()) == 1


def _env(backend) -> dict:
    return {**os.environ, **backend.env, "CKPT_OPTIONS": backend.options_json(),
            "PYTHONPATH": str(Path(__file__).parent.parent), "PYTHONWARNINGS": "ignore"}


def test_two_processes_racing_on_one_slot(s3, tmp_path):
    trials = 20
    for i in range(1, trials, 2):  # half the slots start with a generation (If-Match races)
        RecoverSlot(s3.uri(f"slot-{i}"), storage_options=s3.options).save(state(9.0))
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    procs = {name: subprocess.Popen([sys.executable, CHILD, "race", s3.root, str(trials), name,
                                     str(barrier)], stdout=subprocess.PIPE, text=True,
                                    env=_env(s3)) for name in "AB"}
    outs = {name: p.communicate(timeout=600)[0] for name, p in procs.items()}
    assert all(p.returncode == 0 for p in procs.values()), outs
    for i in range(trials):
        results = {name: f"trial {i} won" in out for name, out in outs.items()}
        assert sum(results.values()) == 1, (i, outs)  # exactly one winner
        slot = RecoverSlot(s3.uri(f"slot-{i}"), storage_options=s3.options)
        winner = "A" if results["A"] else "B"
        value, restored = load_value(slot)
        assert value == (1.0 if winner == "A" else 2.0) and restored.shared == {"who": winner}
        assert len(slot.generations()) == 1  # the loser removed its generation


STAGES = ["start", "committed", "pre-swap", "post-swap", "deleting"]


# Twenty child processes, each importing torch: minutes on a busy machine.
@pytest.mark.timeout(1200)
def test_sigkill_at_every_stage_of_a_slot_save(s3):
    rng = random.Random(1234)
    uri = s3.uri("recover")
    RecoverSlot(uri, storage_options=s3.options).save(state(1.0))
    current, trials, outcomes = 1.0, 20, {"old": 0, "new": 0}  # 4 kills per stage
    for trial in range(trials):
        stage = STAGES[trial % len(STAGES)]
        new = float(trial + 2)
        proc = subprocess.Popen([sys.executable, CHILD, "torture", uri, str(new), stage],
                                stdout=subprocess.PIPE, text=True, env=_env(s3))
        for line in proc.stdout:
            if line.strip() == stage:
                if stage == "start":  # somewhere while the generation is being written
                    time.sleep(rng.uniform(0.0, 0.4))
                proc.send_signal(signal.SIGKILL)
                break
        finish(proc, what=f"the slot save killed at {stage!r}")
        slot = RecoverSlot(uri, storage_options=s3.options)  # a fresh reader
        value, restored = load_value(slot)
        open_checkpoint(restored.checkpoint.store).verify(deep=True)
        assert value in (current, new), (trial, stage, value)
        if stage in ("post-swap", "deleting"):
            assert value == new, (trial, stage)
        if stage in ("committed", "pre-swap"):
            assert value == current, (trial, stage)
        outcomes["new" if value == new else "old"] += 1
        current = value
    assert outcomes["new"] >= 8 and outcomes["old"] >= 8, outcomes
