"""Slot writers for the slot tests, run as separate processes.

race ROOT TRIALS NAME BARRIER_DIR
    For each trial i, save into slot ROOT/slot-i, but wait before the pointer
    swap until the other racer has also written its generation, so both swap
    against the same pointer version. Prints "trial i won|lost".
torture SLOT VALUE STAGE
    Save a state holding VALUE, announcing STAGE on stdout when it is reached
    and then stalling there so the parent can SIGKILL it at exactly that point.
    Stages: start, committed (generation committed, pointer not swapped),
    pre-swap, post-swap (pointer swapped, old generation not deleted),
    deleting (old generation's manifest deleted, its objects not yet).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

from cloudckpt import CommitConflictError, RecoverSlot, StepInfo
from cloudckpt.core import slots as slot_mod
from cloudckpt.training import snapshot as training_mod

OPTIONS = json.loads(os.environ.get("CKPT_OPTIONS", "{}"))


def say(msg: str) -> None:
    print(msg, flush=True)


def state(value: float) -> dict:
    return {"w": torch.full((256,), value), "b": torch.arange(16) * value}


def race(root: str, trials: int, name: str, barrier: str) -> None:
    bar = Path(barrier)
    real_swap = RecoverSlot._swap

    def swap_after_barrier(self, *a, **k):
        trial = self.uri.rsplit("slot-", 1)[1]
        (bar / f"{trial}.{name}").touch()
        deadline = time.monotonic() + 60
        while len(list(bar.glob(f"{trial}.*"))) < 2:
            if time.monotonic() > deadline:
                raise TimeoutError("the other racer never arrived")
            time.sleep(0.005)
        return real_swap(self, *a, **k)

    RecoverSlot._swap = swap_after_barrier
    value = 1.0 if name == "A" else 2.0
    for i in range(trials):
        slot = RecoverSlot(f"{root}/slot-{i}", storage_options=OPTIONS)
        try:
            slot.save(state(value), step_info=StepInfo(global_step=i), extra={"who": name})
            say(f"trial {i} won")
        except CommitConflictError:
            say(f"trial {i} lost")


def torture(uri: str, value: float, stage: str) -> None:
    def stall(here: str) -> None:
        if here == stage:
            say(here)
            time.sleep(120)

    real_write, real_drop = training_mod.write, slot_mod.delete_checkpoint

    def write(*a, **k):
        out = real_write(*a, **k)
        stall("committed")
        return out

    def drop(store, *a, **k):
        from cloudckpt.core.manifest import MANIFEST_NAME

        store.delete([MANIFEST_NAME])
        stall("deleting")
        return real_drop(store, *a, **k) if store.list() else 0

    slot = RecoverSlot(uri, storage_options=OPTIONS)
    cls = type(slot.store)
    real_cas, real_create = cls.put_if_match, cls.put_if_absent

    def conditional(real):
        def put(self, key, data, *version):
            if key != slot_mod.POINTER:
                return real(self, key, data, *version)
            stall("pre-swap")
            out = real(self, key, data, *version)
            stall("post-swap")
            return out
        return put

    training_mod.write = write
    slot_mod.delete_checkpoint = drop
    cls.put_if_match = conditional(real_cas)
    cls.put_if_absent = conditional(real_create)
    say("start")
    slot.save(state(value), extra={"value": value})
    say("done")


if __name__ == "__main__":
    if sys.argv[1] == "race":
        race(sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5])
    else:
        torture(sys.argv[2], float(sys.argv[3]), sys.argv[4])
