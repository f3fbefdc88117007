"""Loading indexed DCP checkpoints rank by rank: real gloo ranks against moto, each rank
behind a proxy of its own, so what each rank reads is counted."""

from __future__ import annotations

import pytest
import torch
from dist_run import run_ranks

from cloudckpt import open_checkpoint, open_store
from cloudckpt.dcp.indexread import is_indexed
from cloudckpt.dcp.records import INDEX_NAME, records_name
from cloudckpt.errors import StateMismatchError
from cloudckpt.names import MANIFEST_NAME

#: Rows of dim 0 of the sharded parameters of dcp_workers.build (and so of Adam's state).
_ROWS = (64, 12, 8)


def _overlapping(load_rank: int, load_world: int, save_world: int) -> set[int]:
    """The saved ranks whose FSDP2 shard (torch.chunk of dim 0) overlaps rank
    ``load_rank``'s shard at ``load_world`` ranks, for any parameter of the model."""
    out = set()
    for rows in _ROWS:
        saved = torch.arange(rows).chunk(save_world)
        mine = torch.arange(rows).chunk(load_world)
        if load_rank >= len(mine):
            continue
        wanted = set(mine[load_rank].tolist())
        out |= {s for s, part in enumerate(saved) if wanted & set(part.tolist())}
    return out


def _keys(gets: list[str], uri: str) -> list[str]:
    """GET targets (path-style) as keys relative to the checkpoint at ``uri``."""
    prefix = "/" + uri.split("://", 1)[1].rstrip("/") + "/"
    assert all(g.startswith(prefix) for g in gets if not g.startswith("LIST")), gets
    return [g.removeprefix(prefix) for g in gets]


def _records_read(keys: list[str]) -> set[int]:
    return {int(k.rsplit("/", 1)[-1].split("_")[2]) for k in keys if k.endswith("_records")}


def test_overlapping_is_what_torch_chunk_says():
    assert _overlapping(0, 2, 4) == {0, 1} and _overlapping(1, 2, 4) == {2, 3}
    assert _overlapping(1, 3, 4) == {1, 2}  # 64 rows: 22 a rank against 16 a rank
    assert _overlapping(3, 4, 2) == {1}


@pytest.mark.parametrize(("save_world", "load_worlds"), [(4, (4, 2, 3)), (2, (4,))])
def test_each_rank_reads_only_the_records_its_shards_overlap(s3, tmp_path, save_world,
                                                             load_worlds):
    """Saved indexed (no stock .metadata) at ``save_world`` FSDP2 ranks, loaded at each of
    ``load_worlds``: bit-exact on every rank; rank 0 alone reads the manifest and the
    index, once; every rank reads the records of exactly the saved ranks its shards
    overlap (on the same layout, its own only), then data files; nothing is listed."""
    opts, uri, ref = s3.options_json(), s3.uri(f"w{save_world}"), str(tmp_path / "ref.pt")
    doc = run_ranks("rankload_workers.save_indexed", save_world, uri, opts, ref, False)[0]
    assert doc["format"] == "indexed"
    ckpt = open_checkpoint(uri, s3.options)
    assert is_indexed(ckpt) and ".metadata" not in ckpt.files
    assert {records_name(r, 0) for r in range(save_world)} <= set(ckpt.files)
    for world in load_worlds:
        results = run_ranks("rankload_workers.load_counted", world, uri, opts, ref)
        for rank, (same, gets) in results.items():
            assert same, (world, rank)
            keys = _keys(gets, uri)
            assert not [k for k in keys if k.startswith("LIST")], keys
            assert _records_read(keys) == _overlapping(rank, world, save_world), (world, rank)
            if world == save_world:
                assert _records_read(keys) == {rank}
            # each records file once; nothing but the manifest and index besides data
            assert len([k for k in keys if k.endswith("_records")]) == len(_records_read(keys))
            # rank 0 alone: the manifest and the index (.metadata, which an indexed
            # checkpoint may lack, is not asked for)
            shared = [k for k in keys if k in (MANIFEST_NAME, INDEX_NAME, ".metadata")]
            assert sorted(shared) == (sorted([MANIFEST_NAME, INDEX_NAME])
                                      if rank == 0 else []), (rank, keys)
            assert all(k.endswith((".distcp", "_records")) for k in keys
                       if k not in shared), keys


def test_torch_load_with_our_reader_assembles_the_metadata_from_every_rank(s3, tmp_path):
    """torch's own dcp.load with a CloudStorageReader (share_metadata) on an indexed
    checkpoint without .metadata: rank 0 reads the index and every rank's records, the
    others none, and the state loads bit-exact at another world size."""
    opts, uri, ref = s3.options_json(), s3.uri("dropin"), str(tmp_path / "ref.pt")
    run_ranks("rankload_workers.save_indexed", 4, uri, opts, ref, False)
    assert ".metadata" not in open_checkpoint(uri, s3.options).files
    results = run_ranks("rankload_workers.load_counted", 2, uri, opts, ref, "dropin")
    for rank, (same, gets) in results.items():
        assert same, rank
        keys = _keys(gets, uri)
        assert _records_read(keys) == ({0, 1, 2, 3} if rank == 0 else set()), (rank, keys)
        assert (INDEX_NAME in keys) == (rank == 0)


def test_a_single_process_loads_an_indexed_checkpoint_of_4_ranks(s3, tmp_path):
    """No process group, no FSDP: the one process needs every chunk, reads every rank's
    records, and gets the full state, through cloudckpt.dcp.load and (with the small
    job's stock .metadata beside the index) through torch's dcp.load with our reader."""
    from dcp_workers import load_single_process
    from rankload_workers import load_single_cloudckpt

    opts, uri, ref = s3.options_json(), s3.uri("single"), str(tmp_path / "ref.pt")
    run_ranks("rankload_workers.save_indexed", 4, uri, opts, ref, True)
    assert ".metadata" in open_checkpoint(uri, s3.options).files  # a small job
    assert load_single_cloudckpt(uri, opts, ref)
    assert load_single_process(uri, opts, ref)


@pytest.mark.parametrize("problem", ["corrupt", "missing"])
def test_a_bad_records_file_is_named_on_every_rank(s3, tmp_path, problem):
    """Rank 1's records flipped (or deleted): at the same layout only rank 1 reads them,
    and every rank raises CorruptCheckpointError naming them, before any data is read."""
    opts, uri, ref = s3.options_json(), s3.uri(f"bad-{problem}"), str(tmp_path / "ref.pt")
    run_ranks("rankload_workers.save_indexed", 2, uri, opts, ref, False)
    store = open_store(uri, s3.options)
    name = records_name(1, 0)
    if problem == "corrupt":
        raw = bytearray(store.get(name))
        raw[-3] ^= 0xFF
        store.put(name, bytes(raw))
    else:
        store.delete([name])
    results = run_ranks("rankload_workers.load_expecting_error", 2, uri, opts, "none")
    for rank, (outcome, data_gets) in results.items():
        assert outcome.startswith("CorruptCheckpointError"), (rank, outcome)
        assert name in outcome, outcome
        assert data_gets == 0


@pytest.mark.parametrize("change", ["shape", "extra"])
def test_a_state_that_does_not_match_is_refused_on_every_rank_before_reading(s3, tmp_path,
                                                                            change):
    """Rank 1's state has a tensor of another shape (or a key the checkpoint lacks):
    StateMismatchError naming it on both ranks, and no data file was read."""
    opts, uri, ref = s3.options_json(), s3.uri(f"mismatch-{change}"), str(tmp_path / "ref.pt")
    run_ranks("rankload_workers.save_indexed", 2, uri, opts, ref, False)
    results = run_ranks("rankload_workers.load_expecting_error", 2, uri, opts, change)
    key = "model.0.bias" if change == "shape" else "model.extra.weight"
    for rank, (outcome, data_gets) in results.items():
        assert outcome.startswith(StateMismatchError.__name__), (rank, outcome)
        assert key in outcome, outcome
        assert data_gets == 0


def test_the_manager_restores_an_indexed_checkpoint_of_stateful_objects(s3):
    """CheckpointManager saves a model and its optimizer (Stateful objects) in the indexed
    format and restores them bit-exact into fresh ones."""
    from cloudckpt.dcp.indexread import read_index
    from cloudckpt.runtime.state import StepInfo
    from cloudckpt.training.manager import CheckpointManager
    from cloudckpt.training.options import ManagerOptions

    def trained(seed: int):
        torch.manual_seed(seed)
        model = torch.nn.Linear(4, 3)
        optim = torch.optim.Adam(model.parameters())
        model(torch.randn(2, 4)).sum().backward()
        optim.step()
        return model, optim

    model, optim = trained(0)
    mgr = CheckpointManager(s3.uri("mgr"), ManagerOptions(every_steps=1),
                            storage_options=s3.options)
    mgr.save(StepInfo(global_step=5), {"model": model, "optim": optim}, force=True)
    part = open_checkpoint(s3.uri("mgr", "step-5"), s3.options).part("model")
    assert is_indexed(part)
    assert "model.weight" in {t.fqn for t in read_index(part).tensors}
    model2, optim2 = trained(1)
    assert mgr.restore({"model": model2, "optim": optim2}).global_step == 5
    assert torch.equal(model2.weight, model.weight) and torch.equal(model2.bias, model.bias)
    for k, v in optim.state_dict()["state"][0].items():
        assert torch.equal(optim2.state_dict()["state"][0][k], v), k


def test_contents_of_an_indexed_checkpoint_are_those_of_the_classic_one(monkeypatch):
    """`cloudckpt inspect`'s inventory reads an indexed checkpoint without .metadata from
    its index and records: the same tensors, shapes and item checksums as the same state
    saved classic, and no DCP file listed as another file."""
    import cloudckpt.dcp as cdcp
    from cloudckpt.contents.inventory import list_contents
    from cloudckpt.dcp import ranksave

    monkeypatch.setattr(ranksave, "SMALL_JOB_CHUNKS", 0)
    state = {"w": torch.randn(8, 4), "b": torch.arange(5), "step": 3}
    cdcp.save(state, "memory://contents-idx/run/a", indexed=True)
    cdcp.save(state, "memory://contents-idx/run/b")
    indexed, classic = (list_contents(f"memory://contents-idx/run/{n}") for n in "ab")
    assert ".metadata" not in open_checkpoint("memory://contents-idx/run/a").files
    assert [(e.name, e.shape, e.checksums) for e in indexed.entries] == \
        [(e.name, e.shape, e.checksums) for e in classic.entries]
    assert all(e.checksums for e in indexed.entries)
    assert not indexed.others and not indexed.problems


def _ranged(gets: list[tuple[str, str | None]], uri: str) -> dict[int, list[tuple[int, int]]]:
    """Per records file a rank GET, by saved rank: the byte ranges it asked for
    (``[start, end)``; one ``(0, -1)`` for a whole read)."""
    out: dict[int, list[tuple[int, int]]] = {}
    for key, header in zip(_keys([k for k, _ in gets], uri), (h for _, h in gets),
                           strict=True):
        if not key.endswith("_records"):
            continue
        saved = int(key.rsplit("/", 1)[-1].split("_")[2])
        if header is None:
            out.setdefault(saved, []).append((0, -1))
        else:
            first, last = header.removeprefix("bytes=").split("-")
            out.setdefault(saved, []).append((int(first), int(last) + 1))
    return out


def _uneven(s3, name: str) -> tuple[str, str, dict[str, int]]:
    opts, uri = s3.options_json(), s3.uri(name)
    run_ranks("rankload_workers.save_uneven", 4, uri, opts)
    ckpt = open_checkpoint(uri, s3.options)
    assert is_indexed(ckpt) and ".metadata" not in ckpt.files
    return opts, uri, {n: ckpt.entry(n).size for n in ckpt.files if n.endswith("_records")}


def test_a_resharding_rank_reads_by_range_the_records_it_needs_few_of(s3):
    """Saved at 4 ranks, loaded at 3: rank 0 needs every record of saved ranks 0 and 1
    and reads both whole; rank 1 needs every record of saved ranks 2 and 3 (the 4-row
    tensors) but only ``mid``'s and ``tail``'s of saved rank 1; rank 2 needs only
    ``mid``'s of saved ranks 2 and 3. Those fringe files are read by ranged GETs (the
    header and name table, then each needed record), a small part of their bytes, and
    every rank's state is the saved one bit for bit."""
    from cloudckpt.dcp.indexread import RECORDS_RANGES, WHOLE_RECORDS_BELOW

    opts, uri, sizes = _uneven(s3, "uneven")
    assert all(n > WHOLE_RECORDS_BELOW for n in sizes.values()), sizes  # not read whole

    results = run_ranks("rankload_workers.load_uneven", 3, uri, opts)
    expect_whole = {0: {0, 1}, 1: {2, 3}, 2: set()}
    expect_ranged = {0: set(), 1: {1}, 2: {2, 3}}
    for rank, (outcome, gets) in results.items():
        assert outcome == "same", (rank, outcome)
        read = _ranged(gets, uri)
        whole = {s for s, spans in read.items() if spans == [(0, -1)]}
        ranged = {s for s, spans in read.items() if (0, -1) not in spans}
        assert whole == expect_whole[rank] and ranged == expect_ranged[rank], (rank, read)
        for saved in ranged:
            spans = read[saved]
            size = sizes[records_name(saved, 0)]
            assert len(spans) <= RECORDS_RANGES, spans
            assert min(a for a, _ in spans) == 0, spans  # the header and name table
            assert all(0 <= a < b <= size for a, b in spans), (spans, size)
            got = sum(b - a for a, b in spans)
            assert got < size / 20, (rank, saved, got, size)
        # The fringe file of rank 1: the index orders tensors by their rows, so tail's
        # record (2 rows) follows the header and mid's (37) ends the file: two ranges.
        if rank == 1:
            assert len(read[1]) == 2, read[1]


@pytest.mark.parametrize("damage", ["position", "truncated"])
def test_a_bad_record_read_by_range_is_corrupt_on_every_rank(s3, damage):
    """Saved rank 2's records damaged where rank 2 of 3 reads them by range (``mid``'s
    record naming another tensor, the file's size kept; or the file cut before that
    record): every rank raises CorruptCheckpointError naming the file, rank 2 for what
    its ranged read found, and no rank reads data."""
    from cloudckpt.dcp.indexread import read_index
    from cloudckpt.dcp.records import RECORD_SIZE, RankRecords

    opts, uri, _ = _uneven(s3, f"uneven-{damage}")
    index = read_index(open_checkpoint(uri, s3.options))
    store = open_store(uri, s3.options)
    name = records_name(2, 0)
    raw = bytearray(store.get(name))
    recs = RankRecords.decode(bytes(raw), source=name, rank=2, index=index).records
    mid = next(k for k, r in enumerate(recs) if index.tensors[r.tensor].fqn.endswith("_mid"))
    place = len(raw) - (len(recs) - mid) * RECORD_SIZE
    if damage == "position":
        raw[place:place + 4] = (recs[mid].tensor + 1).to_bytes(4, "little")
        store.put(name, bytes(raw))
    else:
        store.put(name, bytes(raw[:place]))
    results = run_ranks("rankload_workers.load_uneven", 3, uri, opts)
    for rank, (outcome, gets) in results.items():
        assert outcome.startswith("CorruptCheckpointError"), (rank, outcome)
        assert name in outcome, (rank, outcome)
        assert not [k for k, _ in gets if k.endswith(".distcp")], (rank, gets)
    mine = results[2][0]
    assert ("names tensor" in mine) if damage == "position" else \
        ("shorter than the manifest says" in mine), mine
    assert _ranged(results[2][1], uri)[2] != [(0, -1)]

