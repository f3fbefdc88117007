"""Training state pieces: StepInfo, RNG, safe small-state serialisation, policies."""

from __future__ import annotations

import io
import os
import random

import numpy as np
import pytest
import torch

from cloudckpt import CorruptCheckpointError, StepInfo
from cloudckpt.core.retention import select_for_deletion
from cloudckpt.runtime.state import dumps_state, get_rng_state, loads_state, set_rng_state
from cloudckpt.training.manager import ManagerOptions
from cloudckpt.training.schedule import SaveSchedule


def test_step_info_next_wraps_epochs():
    s = StepInfo(epoch=0, epoch_step=0, global_step=0, steps_per_epoch=3)
    seen = []
    for _ in range(7):
        seen.append((s.epoch, s.epoch_step, s.global_step))
        s = s.next()
    assert seen == [(0, 0, 0), (0, 1, 1), (0, 2, 2), (1, 0, 3), (1, 1, 4), (1, 2, 5), (2, 0, 6)]
    assert StepInfo.from_dict(s.to_dict()) == s
    with pytest.raises(CorruptCheckpointError):
        StepInfo.from_dict({"epoch": 1})


def test_rng_state_round_trip_through_bytes():
    state = loads_state(dumps_state(get_rng_state()))
    first = (random.random(), np.random.rand(), torch.rand(3).tolist())
    set_rng_state(state)
    assert (random.random(), np.random.rand(), torch.rand(3).tolist()) == first


def test_plain_states_are_json_and_tensors_load_weights_only():
    assert dumps_state({"a": [1, 2.5, "x"]}).startswith(b"J")
    blob = dumps_state({"t": torch.arange(3), "n": (1, 2)})
    assert blob.startswith(b"T")
    back = loads_state(blob)
    assert torch.equal(back["t"], torch.arange(3)) and back["n"] == (1, 2)


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_pickled_code_in_a_state_is_refused():
    import pickle

    buf = io.BytesIO()
    pickle.dump({"x": _Evil()}, buf)
    with pytest.raises(CorruptCheckpointError, match="cannot be loaded safely"):
        loads_state(b"T" + buf.getvalue(), source="state/rank-00000.bin")


def test_schedule_fires_on_any_counter_and_resets_only_that_one():
    s = SaveSchedule(every_steps=3, every_epochs=1)
    fired = [s.check(steps=1, epochs=int(i == 4)) for i in range(7)]
    # steps counter fires at calls 2 and 5; the epoch counter at call 4
    assert fired == [False, False, True, False, True, True, False]
    t = SaveSchedule(every_steps=3)
    t.check()
    t.check()
    restored = SaveSchedule(every_steps=3)
    restored.load_state_dict(t.state_dict())
    assert restored.check() is True  # the third step, counting across the restart


def test_schedule_by_seconds(monkeypatch):
    import cloudckpt.training.manager as m

    now = [1000.0]
    monkeypatch.setattr(m.time, "monotonic", lambda: now[0])
    s = SaveSchedule(every_seconds=60)
    assert s.check() is False
    now[0] += 61
    assert s.check() is True
    now[0] += 30
    assert s.check() is False


def test_retention_policy():
    steps = [10, 20, 30, 40, 50, 60]
    assert select_for_deletion(steps, keep_last=None, keep_every=None) == []
    assert select_for_deletion(steps, keep_last=2, keep_every=None) == [10, 20, 30, 40]
    assert select_for_deletion(steps, keep_last=2, keep_every=20) == [10, 30]


def test_options_are_validated():
    with pytest.raises(ValueError, match="every_steps"):
        ManagerOptions(every_steps=0)
    with pytest.raises(ValueError, match="name_format"):
        ManagerOptions(name_format="ckpt")
