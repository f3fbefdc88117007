"""The scale simulation at 16 ranks: the bounds of docs/scale.md, as counts.

Sixteen ranks as threads save a Llama-2-70B-shaped sharded state (placeholders for
the bytes) twice through the CheckpointManager and resume it, against a store that
counts every request (benchmarks/scale_sim.py).
"""

from __future__ import annotations

import importlib.util
import math
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
        # data files, one per item group, plus the rank's records and its own state
        # file: PUTs only
        assert {q.kind for q in mine} == {"PUT"}
        assert sorted(q.key.rsplit("/", 1)[-1] for q in mine if q.key not in save.data_keys) \
            == [f"__{r}_records", f"rank-{r:05d}.bin"]
        reads = [q for q in resume.requests if q.rank == r]
        assert {q.kind for q in reads} == {"GET"}  # no LIST, no HEAD
        assert not any(q.key.endswith(("cloudckpt-manifest.json", ".metadata", "shared.bin",
                                       "cloudckpt-dcp-index.json")) for q in reads)
        # its own records, once, and no other rank's
        assert [q.key.rsplit("/", 1)[-1] for q in reads if q.key.endswith("_records")] == \
            [f"__{r}_records"]


def test_manifest_and_index_are_read_once_per_job(result):
    resume = result.phases["resume"]
    assert result.indexed  # the format cloudckpt.dcp.save writes by default
    for name in ("model/cloudckpt-manifest.json", "model/cloudckpt-dcp-index.json",
                 "step-200/cloudckpt-manifest.json"):
        gets = [q for q in resume.requests if q.kind == "GET" and q.key.endswith(name)]
        assert len(gets) == 1 and gets[0].rank == 0, (name, gets)
    # the stock .metadata written beside the index (a small job) is not read at all
    assert not [q for q in resume.requests if q.key.endswith("model/.metadata")]
    assert result.sizes[".metadata"] > 0
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


# ------------------------------------------------------------- sampled ranks


def _requests_by_rank(phase, ranks):
    return {r: Counter(q.kind for q in phase.requests if q.rank == r) for r in ranks}


def _manifest(sim, result, where):
    import json

    from cloudckpt.storage import open_store

    store = open_store(f"count://{sim.BUCKET}/{result.prefixes['root'].split('/')[0]}/run")
    return json.loads(store.get(f"step-200/{where}cloudckpt-manifest.json"))


def test_a_sampled_run_counts_what_the_full_run_counts(sim, result):
    """Three of 16 ranks run, the others' collectives modelled: every running rank
    (the coordinator among them) sends the requests it sends in the full run, the
    checkpoint's .metadata and manifests list the same objects at the same sizes, and
    the data every rank would move at full size is the same."""
    from cloudckpt.dcp.metadata import load_metadata

    sampled = sim.simulate(16, sample=3, name="s16")
    assert sampled.running == (0, 8, 15)
    assert sim.check_bounds(sampled) == []
    for name, phase in result.phases.items():
        # every request of the ranks that ran, data and the rest, kind by kind
        assert _requests_by_rank(sampled.phases[name], sampled.running) == \
            _requests_by_rank(phase, sampled.running), name
        assert not [q for q in sampled.phases[name].requests
                    if q.rank not in sampled.running]
        # the absent ranks' full-size data, modelled from their plans
        rename = {r: [(k.replace("s16/", "n16/", 1), n) for k, n in objs]
                  for r, objs in sampled.phases[name].data.items()}
        assert rename == phase.data, name
    assert sampled.sizes[".metadata"] == result.sizes[".metadata"]
    assert (sampled.items, sampled.objects, sampled.key_spread) == \
        (result.items, result.objects, result.key_spread)
    assert sampled.peaks["write"][0] == result.peaks["write"][0]
    assert sampled.peaks["read"][0] == result.peaks["read"][0]
    full_md, sampled_md = (load_metadata(sim.open_store(
        f"count://{sim.BUCKET}/{p}/run/step-200/model").get(".metadata")) for p in ("n16", "s16"))
    assert sampled_md.state_dict_metadata == full_md.state_dict_metadata
    assert sampled_md.storage_data == full_md.storage_data
    # The DCP manifest: every data file with its size and CRC32C (.metadata's bytes name
    # the checkpoint's URI). The root manifest: every object at its size (an absent
    # rank's state file has a running rank's CRC32C).
    full_dcp, sampled_dcp = _manifest(sim, result, "model/"), _manifest(sim, sampled, "model/")
    assert full_dcp["files"].pop(".metadata")["size"] == \
        sampled_dcp["files"].pop(".metadata")["size"]
    assert sampled_dcp["files"] == full_dcp["files"]
    timed = ("state/shared.bin", "model/cloudckpt-manifest.json")  # hold timestamps
    full_root, sampled_root = _manifest(sim, result, ""), _manifest(sim, sampled, "")
    assert sampled_root["files"].keys() == full_root["files"].keys()
    assert {k: v["size"] for k, v in sampled_root["files"].items() if k not in timed} \
        == {k: v["size"] for k, v in full_root["files"].items() if k not in timed}
    # the manifests' sizes differ only by their timestamps' and timings' digits
    for name in ("DCP manifest", "root manifest"):
        assert abs(sampled.sizes[name] - result.sizes[name]) <= 8, name


def test_the_sampled_run_checks_its_model_against_the_ranks_that_ran(sim, monkeypatch):
    """A model that computes a running rank's contribution otherwise than that rank
    did stops the simulation: the figures it would give are not the job's."""
    real = sim.AbsentRanks
    monkeypatch.setattr(sim, "AbsentRanks",
                        lambda world, layout, running: real(world, "per-param", running))
    with pytest.raises(sim.ModelMismatch, match="rank 8"):
        sim.simulate(16, sample=3, name="m16")


def test_a_payload_nobody_modelled_fails_loudly():
    import torch.distributed as dist
    from cloudckpt_testkit.threadranks import RankModel, SampledWorld, sample_ranks

    world = SampledWorld(64, sample_ranks(64, 3), RankModel(), timeout=60)

    def body(rank):
        out: list = []
        dist.all_gather_object(out, None)  # a check that passed everywhere: modelled
        assert out == [None] * 64
        dist.all_gather_object(out, {"rank": rank})
        return out

    with world.patched(), pytest.raises(NotImplementedError, match="no model of rank 1's"):
        world.run(body)


def test_phantoms_are_listed_sized_deleted_and_read_only_when_modelled():
    from cloudckpt_testkit.counting import phantom, phantoms, recorder

    from cloudckpt.errors import StorageError
    from cloudckpt.storage import open_store

    store = open_store("count://phantom-test/ck")
    store.put("real.bin", b"abc")
    phantom(store, "sub/absent.bin", 5, lambda: b"hello")
    phantom(store, "state/rank-00009.bin", 7)
    assert phantoms(store) == 2
    recorder("phantom-test").take()
    assert {o.key: o.size for o in store.list()} == {
        "real.bin": 3, "sub/absent.bin": 5, "state/rank-00009.bin": 7}
    assert store.list_prefixes() == ["state", "sub"]
    assert store.info("sub/absent.bin").size == 5
    assert store.get("sub/absent.bin") == b"hello"
    with pytest.raises(StorageError, match="PhantomReadError.*nothing models its bytes"):
        store.get("state/rank-00009.bin")
    assert [q.kind for q in recorder("phantom-test").take()] == ["LIST", "LIST", "HEAD", "GET"]
    store.delete([o.key for o in store.list()])
    assert store.list() == [] and phantoms(store) == 0


def test_the_modelled_restore_time_is_the_slowest_ranks_bytes_after_the_coordinator(sim,
                                                                                     result):
    """At 1 GB/s a rank, 16 ranks restoring the 828 GB state (parameters and Adam's
    moments, float32) take a sixteenth of it each: about 52 s of data, after the
    coordinator's serial reads and planning."""
    model = sim.restore_model(result, 1e9)
    total = 3 * 4 * sum(math.prod(s) for s in sim.param_shapes("flat", 16).values())
    assert total / 16 / 1e9 == pytest.approx(model["data_s"], rel=0.01)
    assert 0 < model["metadata_s"] < 1 and model["coordinator_cpu_s"] > 0
    assert model["total_s"] == pytest.approx(
        model["metadata_s"] + model["coordinator_cpu_s"] + model["data_s"], abs=0.02)
    assert sim.restore_model(result, 0.5e9)["data_s"] == pytest.approx(2 * model["data_s"],
                                                                        rel=0.01)


def test_a_resharding_load_reads_the_records_of_the_saved_ranks_it_overlaps(sim):
    """16 saved ranks, loaded by a fresh world of 8 (3 of them run): each rank reads the
    records of the two saved ranks its rows came from, nothing of the others', and the
    bounds hold for it as for a resume: the rows line up, so it needs every record of
    both, and the metadata it reads is exactly those records."""
    res = sim.simulate(16, layout="per-param", sample=3, name="r16", reshard=8)
    assert sim.check_bounds(res) == []
    phase = res.phases["reshard"]
    ran = sorted({q.rank for q in phase.requests})
    assert ran == [0, 4, 7]
    for r in ran:
        read = sorted(q.key.rsplit("/", 1)[-1] for q in phase.requests
                      if q.rank == r and q.key.endswith("_records"))
        assert read == sorted([f"__{2 * r}_records", f"__{2 * r + 1}_records"]), (r, read)
    assert sim.metadata_read_ratio(res, phase) == 1.0
    assert all(phase.records_needed[r] == res.records[f"__{2 * r}_records"]
               + res.records[f"__{2 * r + 1}_records"] for r in ran)


def test_absent_ranks_of_a_class_are_made_from_its_first_and_checked(sim, monkeypatch):
    """At 64 ranks eleven absent ranks own no whole item and hold alike rows: one class.
    Their records are made from the first one's and their data derived from its records
    after the run, each checked against the slow way for a few ranks; a derivation
    that got a rank's records wrong stops the run. (The job is made to count as a
    large one: a small one's records travel whole in the outcomes, made in full.)"""
    from cloudckpt.dcp import ranksave

    monkeypatch.setattr(ranksave, "SMALL_JOB_CHUNKS", 0)
    made = []
    real_full = sim.AbsentRanks._full_outcome

    def full(self, rank, stand_in):
        made.append(rank)
        return real_full(self, rank, stand_in)

    monkeypatch.setattr(sim.AbsentRanks, "_full_outcome", full)
    res = sim.simulate(64, sample=3, name="c64")
    assert sim.check_bounds(res) == []
    absent = [r for r in range(64) if r not in res.running]
    assert len(set(made)) < len(absent)  # some were derived
    real_head = sim._records_head
    monkeypatch.setattr(sim, "_records_head",  # a derived rank given another's head
                        lambda rank, *a: real_head(rank if rank in made else rank + 1, *a))
    with pytest.raises(sim.ModelMismatch, match="made from rank"):
        sim.simulate(64, sample=3, name="w64")
