"""CheckpointManager: schedule, retention, async errors, resume with fallbacks."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from cloudckpt_testkit import FaultPlan, FaultProxy
from helpers import torn_save

from cloudckpt import (
    MANIFEST_NAME,
    CheckpointManager,
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    ManagerOptions,
    StepInfo,
    StorageError,
    WorldSizeError,
    list_checkpoints,
    open_store,
)
from cloudckpt.movement.checkpoint_copy import copy_checkpoint


class Counter:
    """A stateful component (like a dataloader)."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, state: dict) -> None:
        self.n = state["n"]


def run(mgr: CheckpointManager, steps: range, value_of=float) -> Counter:
    counter = Counter()
    info = StepInfo(steps_per_epoch=4)
    for _ in range(steps.start):
        info = info.next()
    for g in steps:
        counter.n = g
        mgr.save(info, {"w": torch.full((8,), value_of(g))}, per_rank={"data": counter},
                 extra={"note": {"g": g}})
        info = info.next()
    mgr.close()
    return counter


@pytest.fixture(params=["s3", "gcs", "azure"])
def cloud(request):
    """Each object store in turn, over its real endpoint."""
    return request.getfixturevalue(request.param)


def test_saves_when_due_and_keeps_last_n(cloud):
    mgr = CheckpointManager(cloud.root, ManagerOptions(every_steps=2, keep_last=2),
                            storage_options=cloud.options)
    run(mgr, range(0, 10))
    steps = [c.step for c in list_checkpoints(cloud.root, cloud.options)]
    assert steps == [7, 9]
    # Nothing else is left behind: exactly the two checkpoints' prefixes.
    assert open_store(cloud.root, cloud.options).list_prefixes() == ["step-7", "step-9"]


def test_keep_every_and_keep_all(memory):
    run(CheckpointManager(memory.uri("a"), ManagerOptions(every_steps=1, keep_last=1,
                                                          keep_every=4)), range(0, 9))
    assert [c.step for c in list_checkpoints(memory.uri("a"))] == [0, 4, 8]
    run(CheckpointManager(memory.uri("b"), ManagerOptions(every_steps=3)), range(0, 9))
    assert [c.step for c in list_checkpoints(memory.uri("b"))] == [2, 5, 8]


def test_restore_latest_with_state_and_schedule(local):
    opts = ManagerOptions(every_steps=3)
    run(CheckpointManager(local.root, opts, storage_options=local.options), range(0, 7))
    mgr = CheckpointManager(local.root, opts, storage_options=local.options)
    state, counter = {"w": torch.zeros(8)}, Counter()
    info = mgr.restore(state, per_rank={"data": counter})
    assert info == StepInfo(epoch=1, epoch_step=1, global_step=5, steps_per_epoch=4)
    assert torch.equal(state["w"], torch.full((8,), 5.0)) and counter.n == 5
    assert mgr.schedule.steps == 0  # restored: it fired at step 5
    assert CheckpointManager(local.uri("empty"), opts).restore({"w": torch.zeros(8)}) is None


def test_restore_skips_torn_and_falls_back_from_corrupt(cloud, caplog):
    opts = ManagerOptions(every_steps=1)
    run(CheckpointManager(cloud.root, opts, storage_options=cloud.options), range(0, 3))
    # step-3: torn (objects but no manifest); step-2: corrupt shard.
    torn_save(cloud.uri("step-3"), cloud.options, {"model/__0_0.distcp": b"partial"})
    store = open_store(cloud.uri("step-2"), cloud.options)
    shard = next(o.key for o in store.list() if o.key.endswith(".distcp"))
    data = bytearray(store.get(shard))
    data[-40] ^= 0xFF
    store.put(shard, bytes(data))
    state = {"w": torch.zeros(8)}
    with caplog.at_level(logging.WARNING, logger="cloudckpt"):
        info = CheckpointManager(cloud.root, opts, storage_options=cloud.options).restore(state)
    assert info.global_step == 1 and torch.equal(state["w"], torch.full((8,), 1.0))
    text = caplog.text
    assert "skipping" in text and "step-3" in text and "no manifest" in text
    assert "step-2 is corrupt" in text and "falling back" in text
    strict = CheckpointManager(cloud.root, ManagerOptions(every_steps=1, strict=True),
                               storage_options=cloud.options)
    with pytest.raises(CorruptCheckpointError, match="is corrupt"):
        strict.restore({"w": torch.zeros(8)})


def test_restore_from_an_explicit_uri(memory):
    run(CheckpointManager(memory.root, ManagerOptions(every_steps=2)), range(0, 6))
    state = {"w": torch.zeros(8)}
    info = CheckpointManager(memory.root).restore(state, uri=memory.uri("step-1"))
    assert info.global_step == 1 and torch.equal(state["w"], torch.full((8,), 1.0))


@pytest.mark.parametrize("where", ["s3", "local"])
def test_restore_takes_a_relative_uri_below_the_root(where, request, tmp_path, monkeypatch):
    """``uri="step-1"`` is the manager's step-1, wherever the process runs; an absolute
    path or URL of another run's checkpoint is taken as it is."""
    b = request.getfixturevalue(where)
    for run_root in (b.uri("run"), b.uri("other")):
        run(CheckpointManager(run_root, ManagerOptions(every_steps=2),
                              storage_options=b.options), range(0, 6))
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    mgr = CheckpointManager(b.uri("run"), storage_options=b.options)
    for uri, step in [("step-1", 1), ("./step-3", 3), (b.uri("other", "step-5"), 5)]:
        state = {"w": torch.zeros(8)}
        info = mgr.restore(state, uri=uri)
        assert info.global_step == step, uri
        assert torch.equal(state["w"], torch.full((8,), float(step))), uri
    with pytest.raises(CheckpointNotFoundError, match=f"no checkpoint at {b.uri('run', 'step-9')}"):
        mgr.restore({"w": torch.zeros(8)}, uri="step-9")
    with pytest.raises(ConfigError, match=r"'\.\./other/step-1' leads out of .*run: a relative "
                       r"URI names a prefix below the root; pass an absolute path or a URL"):
        mgr.restore({"w": torch.zeros(8)}, uri="../other/step-1")
    assert list(cwd.iterdir()) == []  # nothing was looked for, or left, where it runs


def test_async_save_errors_surface_on_wait(s3, s3_server):
    with FaultProxy(s3_server.endpoint) as proxy:
        opts = {**s3.options, "endpoint_url": proxy.endpoint,
                "retry": {"deadline": 2.0, "initial_backoff": 0.01, "max_backoff": 0.1}}
        mgr = CheckpointManager(s3.root, ManagerOptions(every_steps=1, async_save=True),
                                storage_options=opts)
        info = StepInfo(steps_per_epoch=4)
        assert mgr.save(info, {"w": torch.ones(8)})
        mgr.wait()
        proxy.set_plan(FaultPlan(permanent_status=403))
        assert mgr.save(info.next(), {"w": torch.ones(8)})  # returns: only staging blocked
        with pytest.raises(StorageError, match="access was denied"):
            mgr.wait()
        proxy.set_plan(FaultPlan())
        mgr.close()
    assert [c.step for c in list_checkpoints(s3.root, s3.options)] == [0]


def test_async_save_error_surfaces_on_close(memory, monkeypatch):
    import cloudckpt.training.snapshot as training

    def boom(*a, **k):
        raise StorageError("injected upload failure")

    mgr = CheckpointManager(memory.root, ManagerOptions(every_steps=1, async_save=True))
    monkeypatch.setattr(training, "write", boom)
    mgr.save(StepInfo(), {"w": torch.ones(2)})
    with pytest.raises(StorageError, match="injected"):
        mgr.close()


def test_async_stages_a_copy(memory):
    mgr = CheckpointManager(memory.root, ManagerOptions(every_steps=1, async_save=True))
    w = torch.ones(1000)
    mgr.save(StepInfo(), {"w": w})
    w.add_(5)  # training goes on mutating the live tensor
    mgr.close()
    state = {"w": torch.zeros(1000)}
    CheckpointManager(memory.root).restore(state)
    assert torch.equal(state["w"], torch.ones(1000))


def test_per_rank_state_from_another_world_size_is_refused_before_anything_loads(memory):
    run(CheckpointManager(memory.root, ManagerOptions(every_steps=1)), range(0, 1))
    store = open_store(memory.uri("step-0"))
    doc = json.loads(store.get(MANIFEST_NAME))
    doc["metadata"]["world_size"] = 2
    store.put(MANIFEST_NAME, json.dumps(doc).encode())
    state, counter, rng = {"w": torch.full((8,), -1.0)}, Counter(), torch.get_rng_state()
    with pytest.raises(WorldSizeError, match="of 2 ranks; this job has 1 rank"):
        CheckpointManager(memory.root).restore(state, per_rank={"d": counter})
    # Refused before anything was applied: the tensors, the objects, the RNG as they were.
    assert torch.equal(state["w"], torch.full((8,), -1.0)) and counter.n == 0
    assert torch.equal(torch.get_rng_state(), rng)
    state = {"w": torch.zeros(8)}
    assert CheckpointManager(memory.root).restore(state, rng=False).global_step == 0


def test_a_state_the_checkpoint_lacks_is_refused_before_anything_loads(memory):
    run(CheckpointManager(memory.root, ManagerOptions(every_steps=1)), range(0, 2))
    for where in ({"extra": {"sched": Counter()}}, {"per_rank": {"loader": Counter()}}):
        state = {"w": torch.full((8,), -1.0)}
        with pytest.raises(ConfigError, match="has no saved state named"):
            CheckpointManager(memory.root).restore(state, **where)
        assert torch.equal(state["w"], torch.full((8,), -1.0))


def test_a_checkpoint_copied_under_a_newer_name_is_refused_before_anything_loads(memory):
    """step-1 copied to step-5: its manifest says step 1. The newest (step-5) is refused
    before its tensors load, and the manager falls back to step-1 (strict: raises)."""
    run(CheckpointManager(memory.root, ManagerOptions(every_steps=1)), range(0, 2))
    copy_checkpoint(memory.uri("step-1"), memory.uri("step-5"))
    state = {"w": torch.full((8,), -1.0)}
    with pytest.raises(CorruptCheckpointError, match="named for step 5 but its manifest says"):
        CheckpointManager(memory.root, ManagerOptions(strict=True)).restore(state)
    assert torch.equal(state["w"], torch.full((8,), -1.0))
    with pytest.raises(CorruptCheckpointError, match="named for step 5"):
        CheckpointManager(memory.root).restore(state, uri=memory.uri("step-5"))
    assert torch.equal(state["w"], torch.full((8,), -1.0))
    info = CheckpointManager(memory.root).restore(state)
    assert info.global_step == 1 and torch.equal(state["w"], torch.full((8,), 1.0))
