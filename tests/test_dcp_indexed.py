"""The indexed DCP save: metadata that grows with tensors, not ranks, planned once.

Real gloo ranks save FSDP2 states; what they wrote is checked object by object and
loaded back with torch's own ``FileSystemReader`` (the ``.metadata`` a small job gets).
"""

from __future__ import annotations

import json

import pytest
import torch
from dist_run import run_ranks
from torch.distributed.checkpoint import FileSystemReader

import cloudckpt.dcp as cloud_dcp
from cloudckpt.core.checkpoint import open_checkpoint
from cloudckpt.core.manifest import MANIFEST_NAME
from cloudckpt.dcp import ranksave
from cloudckpt.dcp.records import INDEX_NAME, Index, RankRecords, records_name
from cloudckpt.dcp.rules import Rule
from cloudckpt.storage import open_store


def _index(uri: str, options: dict) -> Index:
    ckpt = open_checkpoint(uri, options)
    assert ckpt.manifest.metadata["dcp"] == {"format": "indexed",
                                             "key_spread": json.loads(
                                                 ckpt.store.get(INDEX_NAME))["key_spread"]}
    return Index.decode(ckpt.store.get(INDEX_NAME))


@pytest.mark.parametrize("world", [2, 4])
def test_gloo_ranks_write_records_and_an_index_then_plan_once(local, tmp_path, world):
    uri, ref = local.uri(f"w{world}"), str(tmp_path / "ref.pt")
    out = run_ranks("dcp_indexed_workers.save_twice_then_change", world, uri,
                    local.options_json(), ref)
    assert out[0]["kinds"] == ["DTensor"]  # the model really was sharded
    for r in range(world):
        # the first save built the plan, the second reused it, the third (a key
        # more) built another; torch never planned globally
        assert out[r]["after"] == [{"built": 1, "reused": 0, "classic": 0},
                                   {"built": 1, "reused": 1, "classic": 0},
                                   {"built": 2, "reused": 1, "classic": 0}]
        assert out[r]["global_plans"] == 0
    for name in ("a", "b", "c"):
        ckpt = open_checkpoint(f"{uri}/{name}", local.options)
        records = sorted(f for f in ckpt.files if f.endswith("_records"))
        assert records == sorted(records_name(r, 0) for r in range(world))
        index = _index(f"{uri}/{name}", local.options)
        assert index.world_size == world
        rules = {t.fqn: t.rule for t in index.tensors}
        assert rules["model.0.weight"] == Rule.chunked(0, world)
        assert any(t.rule == Rule.whole() for t in index.tensors)  # optimizer steps
        for r in range(world):
            recs = RankRecords.decode(ckpt.store.get(records_name(r, 0)),
                                      source="r", rank=r, index=index)
            assert len(recs.records) == sum(t.rule.kind == "chunked" for t in index.tensors)
    # stock torch loads what a small job wrote, resharded
    assert run_ranks("dcp_indexed_workers.load_stock_and_compare", 2 if world == 4 else 4,
                     f"{uri}/a", ref) == {r: True for r in range(2 if world == 4 else 4)}


def test_index_does_not_grow_with_ranks(local, tmp_path):
    sizes = {}
    for world in (2, 4):
        uri = local.uri(f"g{world}")
        run_ranks("dcp_indexed_workers.save_twice_then_change", world, uri,
                  local.options_json(), str(tmp_path / "ref.pt"))
        store = open_store(f"{uri}/a", local.options)
        sizes[world] = (len(store.get(INDEX_NAME)), len(store.get(".metadata")))
    # the index describes each tensor once (a few bytes differ: offsets' digits);
    # the stock .metadata lists every rank's chunks
    assert abs(sizes[4][0] - sizes[2][0]) <= sizes[2][0] // 50, sizes
    assert sizes[4][1] > sizes[2][1] * 1.3, sizes


def test_irregular_states_take_the_classic_path_and_round_trip(s3):
    uri = s3.uri("irregular")
    out = run_ranks("dcp_indexed_workers.irregular_save_and_load", 2, uri, s3.options_json())
    assert out == {r: {"stats": {"built": 0, "reused": 0, "classic": 1}, "equal": True}
                   for r in range(2)}
    ckpt = open_checkpoint(uri, s3.options)
    assert "format" not in ckpt.manifest.metadata["dcp"]
    assert not ckpt.store.exists(INDEX_NAME)


def test_a_failing_rank_raises_on_every_rank_and_commits_nothing(s3):
    uri = s3.uri("fail")
    out = run_ranks("dcp_indexed_workers.save_with_failing_rank", 2, uri, s3.options_json(),
                    pg_timeout=60, timeout=180)
    assert all(v.startswith("raised ") and "disk on fire on rank 1" in v
               for v in out.values()), out
    assert "rank 1:" in out[0]
    assert not open_store(uri, s3.options).exists(MANIFEST_NAME)


def test_one_process_indexed_save_loads_with_stock_reader(local, caplog):
    state = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(2, dtype=torch.bfloat16),
             "nested": {"step": 3, "t": torch.tensor([1, 2, 3])}}
    uri = local.uri("one")
    built = ranksave.STATS.plans_built
    cloud_dcp.save(state, uri, storage_options=local.options, indexed=True)
    cloud_dcp.save(state, local.uri("two"), storage_options=local.options, indexed=True)
    assert ranksave.STATS.plans_built == built + 1
    index = _index(uri, local.options)
    assert all(t.rule == Rule.whole() and t.location is not None for t in index.tensors)
    assert [b.fqn for b in index.byte_items] == ["nested.step"]
    target = {"w": torch.zeros(3, 4), "b": torch.zeros(2, dtype=torch.bfloat16),
              "nested": {"step": 0, "t": torch.zeros(3, dtype=torch.int64)}}
    import torch.distributed.checkpoint as dcp

    dcp.load(target, storage_reader=FileSystemReader(uri), no_dist=True)
    assert target["nested"]["step"] == 3
    for a, b in ((target["w"], state["w"]), (target["b"], state["b"]),
                 (target["nested"]["t"], state["nested"]["t"])):
        assert torch.equal(a, b)


def test_incremental_saves_keep_the_classic_format(memory, caplog):
    classic = ranksave.STATS.classic
    with caplog.at_level("INFO", logger="cloudckpt.dcp.ranksave"):
        cloud_dcp.save({"w": torch.ones(3)}, memory.uri("run", "step-1"), incremental=True,
                       indexed=True)
    assert ranksave.STATS.classic == classic + 1
    ckpt = open_checkpoint(memory.uri("run", "step-1"))
    assert "format" not in ckpt.manifest.metadata["dcp"]


def test_a_downloaded_large_job_loads_with_stock_reader_at_8_ranks(s3, tmp_path, capsys):
    from cloudckpt.cli import main

    uri, ref, dest = s3.uri("big"), str(tmp_path / "ref.pt"), tmp_path / "dl"
    assert run_ranks("dcp_indexed_workers.save_large_job", 8, uri, s3.options_json(), ref,
                     timeout=600) == {r: True for r in range(8)}
    ckpt = open_checkpoint(uri, s3.options)
    assert ".metadata" not in ckpt.files  # a large job's save writes none
    opts = ["-o", f"endpoint_url={s3.options['endpoint_url']}", "-o",
            f"key={s3.options['key']}", "-o", f"secret={s3.options['secret']}"]
    assert main([*opts, "download", uri, str(dest)]) == 0
    assert "for torch's own readers" in capsys.readouterr().out
    assert (dest / ".metadata").exists()
    assert run_ranks("dcp_indexed_workers.load_stock_and_compare", 8, str(dest), ref,
                     timeout=600) == {r: True for r in range(8)}
    # `cloudckpt dcp stock` writes the same metadata from the bucket
    out = tmp_path / "stock" / ".metadata"
    assert main([*opts, "dcp", "stock", uri, "--output", str(out)]) == 0
    ours, downloaded = (FileSystemReader(str(p)).read_metadata() for p in (out.parent, dest))
    assert ours.state_dict_metadata == downloaded.state_dict_metadata
    assert ours.storage_data == downloaded.storage_data
    chunks = ours.state_dict_metadata["model.0.weight"].chunks
    assert len(chunks) == 8  # every rank's chunk, from every rank's records


def test_async_indexed_save_commits_in_the_background(local):
    state = {"w": torch.arange(6.0), "b": torch.ones(2, 2)}
    uri = local.uri("async")
    future = cloud_dcp.async_save(state, uri, storage_options=local.options, indexed=True)
    committed = future.result()
    assert committed is not None and INDEX_NAME in committed.files
    index = _index(uri, local.options)
    assert [t.fqn for t in index.tensors] == ["b", "w"]
    target = {"w": torch.zeros(6), "b": torch.zeros(2, 2)}
    import torch.distributed.checkpoint as dcp

    dcp.load(target, storage_reader=FileSystemReader(uri), no_dist=True)
    assert all(torch.equal(target[k], v) for k, v in state.items())


def test_thread_ranks_exchange_no_plans_and_write_whole_items_once(memory):
    """32 thread ranks: one all-reduce, one gather to the coordinator and two broadcasts
    (the claim, the commit), no all-gather; each value every rank holds is written once,
    by its owner rank, spread over the ranks."""
    import torch.distributed as dist
    from cloudckpt_testkit.threadranks import ThreadWorld

    world = ThreadWorld(32)
    calls: dict[str, int] = {}

    def counted(name, fn):  # type: ignore[no-untyped-def]
        def call(*a, **k):  # type: ignore[no-untyped-def]
            if dist.get_rank() == 0:
                calls[name] = calls.get(name, 0) + 1
            return fn(*a, **k)
        return call

    for name in ("all_gather_object", "gather_object", "broadcast_object_list", "all_reduce"):
        setattr(world, name, counted(name, getattr(world, name)))
    state = {f"layer{i}.w": torch.full((3,), float(i)) for i in range(16)}
    uri = memory.uri("threads")
    with world.patched():
        world.run(lambda r: cloud_dcp.save(state, uri, indexed=True, checked=True))
    assert calls == {"all_reduce": 1, "gather_object": 1, "broadcast_object_list": 2}
    index = _index(uri, {})
    assert index.world_size == 32 and len(index.tensors) == 16
    owners = {t.location.file.split("_")[2] for t in index.tensors if t.location}
    assert len(owners) > 4  # spread over the ranks, not all on the coordinator
    ckpt = open_checkpoint(uri)
    assert sum(f.endswith("_records") for f in ckpt.files) == 32
