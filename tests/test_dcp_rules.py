"""Sharding rules and the indexed format's codecs: rules tile tensors exactly, are
recovered from each rank's chunk, and the index and records survive round trips and
refuse malformed bytes."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorProperties

from cloudckpt.dcp.records import (
    BytesEntry,
    Index,
    Location,
    RankRecords,
    Record,
    TensorEntry,
    stock_metadata,
    structure_digest,
)
from cloudckpt.dcp.rules import Rule, infer_rule, owner
from cloudckpt.errors import CorruptCheckpointError

shapes = st.lists(st.integers(0, 12), min_size=1, max_size=3)


@st.composite
def chunked_cases(draw: st.DrawFn) -> tuple[tuple[int, ...], Rule]:
    size = tuple(draw(shapes))
    return size, Rule.chunked(draw(st.integers(0, len(size) - 1)), draw(st.integers(1, 9)))


def _cells(size: tuple[int, ...], box: tuple[tuple[int, ...], tuple[int, ...]]) -> set:
    cells = {()}
    for d in range(len(size)):
        cells = {c + (i,) for c in cells for i in range(box[0][d], box[0][d] + box[1][d])}
    return cells


@given(chunked_cases())
def test_chunks_tile_the_tensor_exactly(case: tuple[tuple[int, ...], Rule]) -> None:
    size, rule = case
    seen: set = set()
    total = 0
    for r in range(rule.parts + 2):
        box = rule.chunk(size, r)
        if r >= rule.parts:
            assert box is None
            continue
        assert box is not None
        for d in range(len(size)):
            assert 0 <= box[0][d] and box[0][d] + box[1][d] <= size[d]
        cells = _cells(size, box)
        assert not cells & seen
        seen |= cells
        total += len(cells)
    assert seen == _cells(size, ((0,) * len(size), size))
    assert total == len(seen)


@given(chunked_cases(), st.data())
def test_holders_are_exactly_the_overlapping_ranks(case: tuple[tuple[int, ...], Rule],
                                                   data: st.DataObject) -> None:
    size, rule = case
    offsets = tuple(data.draw(st.integers(0, s)) for s in size)
    sizes = tuple(data.draw(st.integers(0, s - o)) for s, o in zip(size, offsets, strict=True))
    want = _cells(size, (offsets, sizes))
    overlapping = []
    for r in range(rule.parts):
        box = rule.chunk(size, r)
        assert box is not None
        if _cells(size, box) & want:
            overlapping.append(r)
    assert list(rule.holders(size, offsets, sizes)) == overlapping


def test_whole_tensors_have_no_holders_and_one_owner() -> None:
    rule = Rule.whole()
    assert rule.chunk((3, 4), 5) == ((0, 0), (3, 4))
    assert list(rule.holders((3, 4), (0, 0), (3, 4))) == []
    assert owner("w", 7) == owner("w", 7) and 0 <= owner("w", 7) < 7
    assert len({owner(f"layer{i}.w", 8) for i in range(64)}) > 4  # spread over ranks


@given(st.lists(st.integers(0, 40), min_size=1, max_size=3), st.integers(1, 9), st.data())
def test_infer_rule_recovers_torch_chunk(size: list[int], world: int,
                                         data: st.DataObject) -> None:
    dim = data.draw(st.integers(0, len(size) - 1))
    full = torch.zeros(size)
    pieces = torch.chunk(full, world, dim) if size[dim] else ()
    step = -(-size[dim] // world)
    for r in range(world):
        offsets = [0] * len(size)
        offsets[dim] = min(size[dim], r * step)
        sizes = list(pieces[r].shape) if r < len(pieces) else \
            [0 if d == dim else s for d, s in enumerate(size)]
        rule = infer_rule(size, offsets, sizes, r, world)
        if list(sizes) == size:  # the whole tensor: indistinguishable from replicated
            assert rule == Rule.whole()
        elif 0 in size:
            continue
        else:
            assert rule == Rule.chunked(dim, world)
            assert rule.chunk(size, r) == (tuple(offsets), tuple(sizes))


def test_infer_rule_refuses_irregular_chunks() -> None:
    # a 2-D mesh: both dims split
    assert infer_rule([8, 8], [4, 4], [4, 4], 3, 4) is None
    # a chunk at another rank's place
    assert infer_rule([8], [2], [2], 0, 4) is None
    # uneven splits of another kind (4 = 3 + 1, not ceil)
    assert infer_rule([4], [0], [3], 0, 2) is None
    assert infer_rule([8], [0], [8], 0, 4) == Rule.whole()


def test_rule_json_round_trip_and_refusal() -> None:
    for rule in (Rule.whole(), Rule.chunked(1, 16)):
        assert Rule.from_json(json.loads(json.dumps(rule.to_json())), ndim=2) == rule
    for bad in (["chunked", 2, 4], ["chunked", -1, 4], ["chunked", 0, 0], ["x"], "whole",
                ["chunked", 0, True], None, {"kind": "whole"}):
        with pytest.raises(CorruptCheckpointError):
            Rule.from_json(bad, ndim=2)


# ------------------------------------------------------------------- codecs

_PROPS = TensorProperties(dtype=torch.bfloat16, requires_grad=True)


def _index(world: int = 4) -> Index:
    tensors = [
        TensorEntry("a.bias", (5,), TensorProperties(), Rule.whole(),
                    Location("__1_0.distcp", 0, 700, "0000abcd")),
        TensorEntry("a.weight", (10, 3), _PROPS, Rule.chunked(0, world)),
        TensorEntry("b.weight", (3, 10), TensorProperties(dtype=torch.int64),
                    Rule.chunked(1, world)),
    ]
    byte_items = [BytesEntry("step", Location("0a/__2_0.distcp", 900, 40, "ffffffff"))]
    digest = structure_digest(world, 0, [(t.fqn, t.size, t.properties, t.rule)
                                         for t in tensors], ["step"])
    return Index(world, 0, digest, tensors, byte_items,
                 {"a.bias": ("a", "bias"), "step": ("step",)}, "2.0.0")


def _records(index: Index, rank: int) -> RankRecords:
    return RankRecords(rank, index.digest, [
        Record(1, Location(f"__{rank}_0.distcp", 0, 100 + rank, f"{rank:08x}")),
        Record(2, Location(f"__{rank}_1.distcp", 64, 7, "deadbeef"))])


def test_index_round_trip() -> None:
    index = _index()
    again = Index.decode(index.encode())
    assert again == index


@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 3), st.integers(0, 2**40),
                          st.integers(0, 2**40), st.integers(0, 2**32 - 1)), max_size=20),
       st.integers(0, 2**31 - 1), st.integers(0, 2**63 - 1))
def test_records_round_trip(rows: list[tuple[int, ...]], rank: int, digest: int) -> None:
    """Records come back as they went, sorted by tensor position (what lets a reader
    find one by its place)."""
    recs = RankRecords(rank, digest, [Record(t, Location(f"d/__{f}_0.distcp", o, n,
                                                         f"{c:08x}"))
                                      for t, f, o, n, c in rows])
    ordered = RankRecords(rank, digest, sorted(recs.records, key=lambda r: r.tensor))
    assert RankRecords.decode(recs.encode(), source="r") == ordered


def test_records_checked_against_the_index() -> None:
    index = _index(world=2)
    data = _records(index, 1).encode()
    assert RankRecords.decode(data, source="r", rank=1, index=index).records
    with pytest.raises(CorruptCheckpointError, match="rank 1's records, not rank 0"):
        RankRecords.decode(data, source="r", rank=0, index=index)
    other = dataclasses.replace(index, digest=index.digest ^ 1)
    with pytest.raises(CorruptCheckpointError, match="another structure digest"):
        RankRecords.decode(data, source="r", index=other)
    whole = RankRecords(1, index.digest, [Record(0, Location("x", 0, 1, "00000000"))])
    with pytest.raises(CorruptCheckpointError, match="holds no part of a.bias"):
        RankRecords.decode(whole.encode(), source="r", index=index)
    twice = RankRecords(1, index.digest, [Record(1, Location("x", 0, 1, "00000000"))] * 2)
    with pytest.raises(CorruptCheckpointError, match="twice"):
        RankRecords.decode(twice.encode(), source="r", index=index)
    past = RankRecords(1, index.digest, [Record(9, Location("x", 0, 1, "00000000"))])
    with pytest.raises(CorruptCheckpointError, match="tensor 9 of 3"):
        RankRecords.decode(past.encode(), source="r", index=index)


@settings(max_examples=200)
@given(st.binary(max_size=200), st.data())
def test_malformed_records_are_corrupt(noise: bytes, data: st.DataObject) -> None:
    good = _records(_index(), 2).encode()
    cut = data.draw(st.integers(0, len(good) - 1))
    for bad in (good[:cut], good + (noise or b"x")):  # cut short, or trailing bytes
        with pytest.raises(CorruptCheckpointError, match="__2_records"):
            RankRecords.decode(bad, source="__2_records", rank=2, index=_index())
    try:  # noise: refused, or (by chance) a well-formed records file
        RankRecords.decode(good[:cut] + noise, source="__2_records", rank=2, index=_index())
    except CorruptCheckpointError as exc:
        assert "__2_records" in str(exc)


def test_records_refuse_hostile_file_names() -> None:
    for name in ("../x", "/abs", "s3://b/k", "a//b"):
        recs = RankRecords(0, 1, [Record(0, Location(name, 0, 1, "00000000"))])
        with pytest.raises(CorruptCheckpointError):
            RankRecords.decode(recs.encode(), source="r")


def _mutations() -> list[tuple[str, object]]:
    return [
        ("format", "x"), ("world_size", 0), ("world_size", "4"), ("key_spread", -1),
        ("digest", "zz"), ("digest", 5), ("tensors", {}), ("bytes", None),
        ("planner_data", [1]), ("dcp_version", 3),
    ]


@pytest.mark.parametrize(("key", "value"), _mutations())
def test_malformed_index_is_corrupt(key: str, value: object) -> None:
    doc = json.loads(_index().encode())
    doc[key] = value
    with pytest.raises(CorruptCheckpointError, match="cloudckpt-dcp-index.json"):
        Index.decode(json.dumps(doc).encode())


@pytest.mark.parametrize("change", [
    lambda t: t.update(size=[-1]), lambda t: t.update(size=[2**70]),
    lambda t: t.update(rule=["chunked", 5, 2]), lambda t: t.update(location=None),
    lambda t: t.update(properties=["os.system", "strided", False, "contiguous_format",
                                   False]),
    lambda t: t.update(properties=["float32", "strided", 0, "contiguous_format", False]),
    lambda t: t.update(location=["../x", 0, 1, "00000000"]),
    lambda t: t.update(location=["x", 0, 1, "XYZ"]), lambda t: t.update(fqn=""),
    lambda t: t.update(fqn="a.weight"),  # another tensor's name
    lambda t: t.pop("rule"),
])
def test_malformed_tensor_entry_is_corrupt(change) -> None:  # type: ignore[no-untyped-def]
    doc = json.loads(_index().encode())
    change(doc["tensors"][0])
    with pytest.raises(CorruptCheckpointError):
        Index.decode(json.dumps(doc).encode())


def test_malformed_index_bytes_are_corrupt() -> None:
    for bad in (b"", b"\xff\xfe", b"[]", b'{"format": "cloudckpt.dcp.index"}',
                b'{"a": 1, "a": 2}', b"[" * 100000):
        with pytest.raises(CorruptCheckpointError):
            Index.decode(bad)
    doc = json.loads(_index().encode())
    doc["version"] = 99
    with pytest.raises(CorruptCheckpointError, match="upgrade cloudckpt"):
        Index.decode(json.dumps(doc).encode())


def test_stock_metadata_lists_every_chunk() -> None:
    index = _index(world=4)
    md = stock_metadata(index, {r: _records(index, r) for r in range(4)})
    a = md.state_dict_metadata["a.weight"]
    assert [tuple(c.offsets) for c in a.chunks] == [(0, 0), (3, 0), (6, 0), (9, 0)]
    assert [tuple(c.sizes) for c in a.chunks] == [(3, 3), (3, 3), (3, 3), (1, 3)]
    assert a.properties.dtype == torch.bfloat16 and a.properties.requires_grad
    b = md.state_dict_metadata["b.weight"]
    assert [tuple(c.offsets) for c in b.chunks] == [(0, 0), (0, 3), (0, 6), (0, 9)]
    whole = md.state_dict_metadata["a.bias"]
    assert [tuple(c.sizes) for c in whole.chunks] == [(5,)]
    assert isinstance(md.state_dict_metadata["step"], BytesStorageMetadata)
    assert len(md.storage_data) == 1 + 4 + 4 + 1
    from torch.distributed.checkpoint.metadata import MetadataIndex
    info = md.storage_data[MetadataIndex("a.weight", torch.Size([9, 0]))]
    assert (info.relative_path, info.offset, info.length) == ("__3_0.distcp", 0, 103)
    assert md.planner_data == {"a.bias": ("a", "bias"), "step": ("step",)}
    with pytest.raises(CorruptCheckpointError, match="no records of rank 2"):
        stock_metadata(index, {r: _records(index, r) for r in (0, 1, 3)})


def test_structure_digest_sees_every_part_of_the_structure() -> None:
    base = [("w", (4, 2), TensorProperties(), Rule.chunked(0, 2))]
    d = structure_digest(2, 0, base, ["s"])
    assert d == structure_digest(2, 0, list(reversed(base)), ["s"])
    assert 0 <= d < 2**63
    others = {
        structure_digest(4, 0, base, ["s"]), structure_digest(2, 2, base, ["s"]),
        structure_digest(2, 0, [("w", (4, 3), TensorProperties(), Rule.chunked(0, 2))], ["s"]),
        structure_digest(2, 0, [("w", (4, 2), _PROPS, Rule.chunked(0, 2))], ["s"]),
        structure_digest(2, 0, [("w", (4, 2), TensorProperties(), Rule.whole())], ["s"]),
        structure_digest(2, 0, base, []),
    }
    assert d not in others and len(others) == 6


def test_an_index_splitting_over_more_parts_than_ranks_is_corrupt() -> None:
    doc = json.loads(_index(world=4).encode())
    doc["world_size"] = 2
    with pytest.raises(CorruptCheckpointError, match="4 parts by 2 ranks"):
        Index.decode(json.dumps(doc).encode())


def test_structure_digest_sees_where_flattened_names_came_from() -> None:
    base = [("a.b", (2,), TensorProperties(), Rule.whole())]
    assert structure_digest(1, 0, base, [], {"a.b": ("a", "b")}) != \
        structure_digest(1, 0, base, [], {"a.b": ("a.b",)})
