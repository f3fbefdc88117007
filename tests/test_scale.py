"""The scale simulation at 16 ranks: the bounds of docs/scale.md, as counts.

Sixteen ranks as threads save a Llama-2-70B-shaped sharded state (placeholders for
the bytes) twice through the CheckpointManager and resume it, against a store that
counts every request (benchmarks/scale_sim.py).
"""

from __future__ import annotations

import importlib.util
import sys
from collections import Counter
from pathlib import Path

import pytest

from cloudckpt.core.checkpoint import open_checkpoint
from cloudckpt.dcp.writer import auto_spread

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "scale_sim.py"


@pytest.fixture(scope="module")
def sim():
    spec = importlib.util.spec_from_file_location("scale_sim", _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["scale_sim"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def result(sim):
    return sim.simulate(16)


def test_every_bound_holds_at_16_ranks(sim, result):
    assert sim.check_bounds(result) == []


def test_other_ranks_send_only_their_own_objects(result):
    save, resume = result.phases["save"], result.phases["resume"]
    for r in range(1, 16):
        mine = [q for q in save.requests if q.rank == r]
        # data files, one per item group, plus the rank's own state file: PUTs only
        assert {q.kind for q in mine} == {"PUT"}
        assert sum(q.key not in save.data_keys for q in mine) == 1
        reads = [q for q in resume.requests if q.rank == r]
        assert {q.kind for q in reads} == {"GET"}  # no LIST, no HEAD
        assert not any(q.key.endswith(("cloudckpt-manifest.json", ".metadata", "shared.bin"))
                       for q in reads)


def test_manifest_and_metadata_are_read_once_per_job(result):
    resume = result.phases["resume"]
    for name in ("model/cloudckpt-manifest.json", "model/.metadata",
                 "step-200/cloudckpt-manifest.json"):
        gets = [q for q in resume.requests if q.kind == "GET" and q.key.endswith(name)]
        assert len(gets) == 1 and gets[0].rank == 0, (name, gets)
    # the root, then the checkpoint's objects and their sizes (checked before any load)
    assert [(q.rank, q.key) for q in resume.requests if q.kind == "LIST"] == [
        (0, result.prefixes["root"]), (0, result.prefixes["root"] + "step-200/")]


def test_coordinator_requests_do_not_grow_with_ranks(sim, result):
    small = sim.simulate(4)
    control = Counter(q.kind for q in result.phases["save"].requests
                      if q.rank == 0 and q.key not in result.phases["save"].data_keys)
    control4 = Counter(q.kind for q in small.phases["save"].requests
                       if q.rank == 0 and q.key not in small.phases["save"].data_keys)
    assert control == control4
    assert sum(control.values()) <= sim.COORDINATOR_SAVE_MAX


def test_shortcut_planner_plans_what_dcp_plans(sim):
    """The simulation's resume planner reads the same chunks as DCP's own."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner

    world = 4
    planners = [DefaultSavePlanner() for _ in range(world)]
    for r, planner in enumerate(planners):
        planner.set_up_planner(sim.rank_state(r, world), is_coordinator=r == 0)
    _, metadata = planners[0].create_global_plan([p.create_local_plan() for p in planners])
    for r in range(world):
        ours, theirs = sim.ShardLoadPlanner(), DefaultLoadPlanner()
        for p in (ours, theirs):
            p.set_up_planner(sim.rank_state(r, world), metadata, is_coordinator=r == 0)
        key = lambda i: (i.storage_index.fqn, tuple(i.storage_index.offset or ()),  # noqa: E731
                         tuple(i.dest_offsets), tuple(i.storage_offsets), tuple(i.lengths))
        assert sorted(map(key, ours.create_local_plan().items)) == \
            sorted(map(key, theirs.create_local_plan().items))


def test_key_spread_is_chosen_by_world_size(result):
    assert [auto_spread(n) for n in (1, 8, 9, 16, 64, 256, 1024)] == [0, 0, 2, 2, 8, 32, 128]
    assert result.key_spread == 2  # 16 ranks: two sub-prefixes
    spread = {k.rsplit("/", 2)[-2] for k in result.phases["save"].data_keys}
    assert spread == {"00", "01"}


def test_files_spread_over_sub_prefixes_at_32_ranks_and_load_back():
    """32 thread ranks save a small state: the files go under four sub-prefixes, the
    manifest says so, and every rank loads its values back without a listing."""
    import torch
    from cloudckpt_testkit.counting import recorder
    from cloudckpt_testkit.threadranks import ThreadWorld

    import cloudckpt.dcp as cdcp
    from cloudckpt.storage import open_store

    store = open_store("count://spread-test/run/step-1")
    world = ThreadWorld(32)
    with world.patched():
        world.run(lambda r: cdcp.save({f"w{r}": torch.full((4,), float(r))}, store))
        recorder("spread-test").take()
        loaded = world.run(lambda r: _load(cdcp, store, r))
    assert loaded == [[float(r)] * 4 for r in range(32)]
    requests = recorder("spread-test").take()
    assert not [q for q in requests if q.kind == "LIST"]
    ckpt = open_checkpoint(store)
    assert ckpt.metadata["dcp"]["key_spread"] == 4
    data = [f for f in ckpt.files if f.endswith(".distcp")]
    assert len(data) == 32 and {f.split("/")[0] for f in data} == {"00", "01", "02", "03"}


def _load(cdcp, store, rank):
    import torch

    state = {f"w{rank}": torch.zeros(4)}
    cdcp.load(state, store, planner=_partial())
    return state[f"w{rank}"].tolist()


def _partial():
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    return DefaultLoadPlanner(allow_partial_load=True)


def test_a_failing_thread_rank_does_not_hang_the_others():
    """A rank that raises before a collective breaks the world's barrier: the others
    stop waiting at once, and run() raises the failing rank's error, not the echo."""
    import time

    import torch.distributed as dist
    from cloudckpt_testkit.threadranks import ThreadWorld

    world = ThreadWorld(4, timeout=60)

    def body(rank: int) -> int:
        if rank == 2:
            raise ValueError("rank 2 failed")
        out: list = []
        dist.all_gather_object(out, rank)
        return len(out)

    start = time.monotonic()
    with world.patched(), pytest.raises(ValueError, match="rank 2 failed"):
        world.run(body)
    assert time.monotonic() - start < 10
    with world.patched():  # the world is usable again, and collectives are real
        assert world.run(lambda r: dist.get_rank() + 10 * dist.get_world_size()) == [
            40, 41, 42, 43]
        gathered = world.run(lambda r: _gather(dist, r))
    assert gathered == [[0, 1, 2, 3]] * 4
    assert not dist.is_initialized()  # patched only inside the block


def _gather(dist, rank):
    out: list = []
    dist.all_gather_object(out, rank)
    return out


def test_counting_store_counts_pages_and_batches():
    """A listing is one LIST per 1,000 keys and a delete one DELETE per 1,000 keys,
    as S3 counts them; each request carries the rank that sent it."""
    from cloudckpt_testkit.counting import recorder
    from cloudckpt_testkit.threadranks import ThreadWorld

    from cloudckpt.storage import open_store

    store = open_store("count://pages-test/p")
    store.put_many({f"o{i}": b"x" for i in range(2500)})
    recorder("pages-test").take()
    assert len(store.list()) == 2500
    store.delete([f"o{i}" for i in range(2500)])
    kinds = [q.kind for q in recorder("pages-test").take()]
    assert kinds.count("LIST") == 3 and kinds.count("DELETE") == 3
    world = ThreadWorld(3)
    with world.patched():
        world.run(lambda r: store.put_many({f"r{r}-{i}": b"y" for i in range(4)}))
    by_rank = Counter(q.rank for q in recorder("pages-test").take())
    assert by_rank == {0: 4, 1: 4, 2: 4}  # pool threads carry the rank along
