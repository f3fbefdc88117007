"""Where a saved rank's record of a tensor lies in its records file, and how a load
reads a few records of a large file by range: the position arithmetic, the range
coalescing, and the validation of what ranged reads return."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import TensorProperties

from cloudckpt.dcp.indexread import (
    RECORDS_GAP,
    RECORDS_RANGES,
    WHOLE_RECORDS_BELOW,
    coalesce,
    metadata_for,
    plan_records_read,
)
from cloudckpt.dcp.records import (
    RECORD_SIZE,
    Index,
    Location,
    RankRecords,
    Record,
    TensorEntry,
    structure_digest,
    tensor_order,
)
from cloudckpt.dcp.rules import Rule
from cloudckpt.errors import CorruptCheckpointError


def _index(parts: list[int | None]) -> Index:
    """One tensor a rule (``None``: held whole), named in order, 12 rows each."""
    tensors = [TensorEntry(f"t{i:04d}", (12, 2), TensorProperties(),
                           Rule.whole() if p is None else Rule.chunked(0, p),
                           Location("__0_0.distcp", 0, 8, "00000000") if p is None else None)
               for i, p in enumerate(parts)]
    digest = structure_digest(4, 0, [(t.fqn, t.size, t.properties, t.rule) for t in tensors],
                              [])
    return Index(4, 0, digest, tensors)


def _records(index: Index, rank: int) -> RankRecords:
    """What rank ``rank`` writes: a record of each tensor it holds a part of, in the
    order its plan happened to give them (reversed here), over two files."""
    return RankRecords(rank, index.digest, [
        Record(t, Location(f"__{rank}_{t % 2}.distcp", 100 * t, 10 + t, f"{t:08x}"))
        for t in reversed(index.held(rank))])


def test_held_is_every_chunked_tensor_whose_rule_gives_the_rank_a_part() -> None:
    index = _index([None, 4, 2, 4, None, 3])
    assert index.held(0) == index.held(1) == (1, 2, 3, 5)
    assert index.held(2) == (1, 3, 5)
    assert index.held(3) == (1, 3)
    assert index.held(4) == index.held(99) == ()
    for rank in range(4):  # what the rules say, tensor by tensor
        assert index.held(rank) == tuple(i for i, t in enumerate(index.tensors)
                                         if t.rule.chunk(t.size, rank) is not None
                                         and t.rule.kind != "whole")


@given(st.lists(st.sampled_from([None, 1, 2, 3, 4]), min_size=1, max_size=40),
       st.integers(0, 3))
def test_each_record_lies_where_its_position_says(parts: list[int | None], rank: int) -> None:
    """Encoded in any order, the record of the k-th tensor a rank holds is the k-th of
    its file's last n records: decoding those bytes alone gives that tensor."""
    index = _index(parts)
    data = _records(index, rank).encode()
    plan = plan_records_read(index, rank, "r", len(data), None)
    held = index.held(rank)
    assert plan.head == len(data) - len(held) * RECORD_SIZE
    for k, t in enumerate(held):
        at = plan.head + k * RECORD_SIZE
        part = RankRecords.decode_part(data[:plan.head], {t: data[at:at + RECORD_SIZE]},
                                       source="r", rank=rank, index=index)
        assert [r.tensor for r in part.records] == [t] and part.covers == {t}
        assert part.records[0].location.offset == 100 * t
    whole = RankRecords.decode(data, source="r", rank=rank, index=index)
    assert [r.tensor for r in whole.records] == list(held) and whole.covers is None


def test_records_out_of_order_or_missing_are_corrupt() -> None:
    index = _index([4, 4, 4])
    good = _records(index, 1)
    data = bytearray(good.encode())
    tail = len(data) - 3 * RECORD_SIZE
    first, second = (bytes(data[tail + k * RECORD_SIZE:tail + (k + 1) * RECORD_SIZE])
                     for k in (0, 1))
    data[tail:tail + 2 * RECORD_SIZE] = second + first
    with pytest.raises(CorruptCheckpointError, match="out of order"):
        RankRecords.decode(bytes(data), source="__1_records", rank=1, index=index)
    short = RankRecords(1, index.digest, good.records[1:])  # the last tensor's record dropped
    with pytest.raises(CorruptCheckpointError, match="2 records, where the index gives rank 1 "
                       "a part of 3"):
        RankRecords.decode(short.encode(), source="__1_records", rank=1, index=index)


def test_coalesce_merges_near_ranges_and_caps_their_number() -> None:
    assert coalesce([]) == []
    assert coalesce([(0, 40), (40, 68)]) == [(0, 68)]
    assert coalesce([(100, 128), (0, 40), (20, 50)], gap=49) == [(0, 50), (100, 128)]
    assert coalesce([(100, 128), (0, 40), (20, 50)], gap=50) == [(0, 128)]
    far = RECORDS_GAP + 1
    assert coalesce([(0, 10), (10 + RECORDS_GAP, 20 + RECORDS_GAP)]) == \
        [(0, 20 + RECORDS_GAP)]
    assert coalesce([(0, 10), (10 + far, 20 + far)]) == [(0, 10), (10 + far, 20 + far)]
    # Past the cap, the smallest gaps are read through: here those of 5,000 and 6,000.
    spans = [(0, 10), (10_010, 10_020), (15_020, 15_030), (21_030, 21_040),
             (31_040, 31_050), (41_050, 41_060)]
    assert coalesce(spans, most=4) == [(0, 10), (10_010, 21_040), (31_040, 31_050),
                                       (41_050, 41_060)]
    assert coalesce(spans, most=1) == [(0, 41_060)]
    assert len(coalesce([(i * 10_000, i * 10_000 + 28) for i in range(100)])) == \
        RECORDS_RANGES


@given(st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 100)), max_size=30),
       st.integers(0, 10_000), st.integers(1, 6))
def test_coalesced_ranges_cover_every_span_and_are_disjoint(
        spans: list[tuple[int, int]], gap: int, most: int) -> None:
    spans = [(a, a + n) for a, n in spans]
    out = coalesce(spans, gap=gap, most=most)
    assert len(out) <= most
    assert all(a < b for a, b in out) and all(b < c for (_, b), (c, _) in pairwise(out))
    assert all(any(a <= s and e <= b for a, b in out) for s, e in spans)


def test_a_read_is_whole_for_small_files_and_large_shares_else_by_range() -> None:
    parts: list[int | None] = [4] * 1000
    index = _index(parts)
    size = len(_records(index, 2).encode())
    assert size > WHOLE_RECORDS_BELOW
    assert plan_records_read(index, 2, "r", size, None).ranges == ()  # all of them
    assert plan_records_read(index, 2, "r", size, set(range(500))).ranges == ()  # half
    plan = plan_records_read(index, 2, "r", size, {3, 700})
    head = plan.head
    assert plan.slots == {3: head + 3 * RECORD_SIZE, 700: head + 700 * RECORD_SIZE}
    assert plan.ranges == ((0, head + 4 * RECORD_SIZE),
                           (head + 700 * RECORD_SIZE, head + 701 * RECORD_SIZE))
    small = _index([4] * 20)
    n = len(_records(small, 2).encode())
    assert n < WHOLE_RECORDS_BELOW and plan_records_read(small, 2, "r", n, {3}).ranges == ()
    with pytest.raises(CorruptCheckpointError, match="too few for a header"):
        plan_records_read(index, 2, "__2_records", 1000 * RECORD_SIZE, {3})


def test_a_ranged_read_that_disagrees_with_the_index_is_corrupt() -> None:
    index = _index([4] * 10)
    data = _records(index, 1).encode()
    plan = plan_records_read(index, 1, "r", len(data), None)
    head, at = data[:plan.head], plan.head + 4 * RECORD_SIZE
    rec = data[at:at + RECORD_SIZE]

    def part(head: bytes, records: dict[int, bytes], rank: int = 1) -> RankRecords:
        return RankRecords.decode_part(head, records, source="__1_records", rank=rank,
                                       index=index)

    assert part(head, {4: rec}).records[0].tensor == 4
    with pytest.raises(CorruptCheckpointError, match="where t0005 belongs names tensor 4"):
        part(head, {5: rec})  # a record that is not the one at the tensor's place
    with pytest.raises(CorruptCheckpointError, match="not the .* before its records"):
        part(head + b"\0", {4: rec})  # the name table does not end where records begin
    with pytest.raises(CorruptCheckpointError, match="rank 1's records, not rank 2's"):
        part(head, {4: rec}, rank=2)
    other = _records(_index([4] * 11), 1).encode()
    with pytest.raises(CorruptCheckpointError):  # another save's header: digest, count
        part(other[:len(other) - 11 * RECORD_SIZE], {4: rec})
    with pytest.raises(CorruptCheckpointError, match="is 27 bytes"):
        part(head, {4: rec[:-1]})


def test_metadata_lists_only_the_chunks_of_the_records_read() -> None:
    """A saved rank whose records were read for one tensor gives a chunk of that tensor
    only; records covering a tensor the rule says the rank holds but lacking its record
    are corrupt."""
    index = _index([4, 4])
    data = _records(index, 3).encode()
    plan = plan_records_read(index, 3, "r", len(data), None)
    at = plan.head + RECORD_SIZE
    one = RankRecords.decode_part(data[:plan.head], {1: data[at:at + RECORD_SIZE]},
                                  source="r", rank=3, index=index)
    whole = RankRecords.decode(_records(index, 2).encode(), source="r", rank=2, index=index)
    md, _ = metadata_for(index, {2: whole, 3: one}, ["t0000", "t0001"])
    chunks = {fqn: [tuple(c.offsets) for c in md.state_dict_metadata[fqn].chunks]
              for fqn in ("t0000", "t0001")}
    assert chunks == {"t0000": [(6, 0)], "t0001": [(6, 0), (9, 0)]}
    lacking = RankRecords(3, index.digest, [], frozenset({0}))
    with pytest.raises(CorruptCheckpointError, match="no entry for t0000"):
        metadata_for(index, {3: lacking}, ["t0000"])
    assert torch.Size(md.state_dict_metadata["t0000"].size) == (12, 2)


def test_tensors_split_alike_lie_side_by_side_in_the_index() -> None:
    """Layers interleave tensors of different row counts by name; the index orders them
    by how they are split, so the records a resharding rank needs of one row count lie
    in one range of a saved rank's records file."""
    shapes = {"wk": (1024, 8), "wq": (8192, 8), "w1": (28672, 8), "norm": (8192,)}
    entries = [TensorEntry(f"layers.{n}.{k}", size, TensorProperties(), Rule.chunked(0, 16))
               for n in range(3) for k, size in shapes.items()]
    entries.append(TensorEntry("bias", (7,), TensorProperties(), Rule.whole(),
                               Location("__0_0.distcp", 0, 8, "00000000")))
    ordered = sorted(entries, key=lambda t: tensor_order(t.fqn, t.size, t.rule))
    rows = [t.size[0] for t in ordered if t.rule.kind != "whole"]
    assert ordered[0].fqn == "bias"
    assert rows == sorted(rows)  # one run per row count
    assert [t.fqn for t in ordered if t.size[0] == 8192] == sorted(
        f"layers.{n}.{k}" for n in range(3) for k in ("norm", "wq"))


def test_a_rank_past_a_tensors_rows_holds_no_record_of_it() -> None:
    """torch.chunk's rounding leaves the last ranks no rows of a small tensor: their
    part is empty, so they write no record of it and a load finds none to read."""
    rule = Rule.chunked(0, 4)
    assert [rule.filled((n, 3)) for n in (0, 1, 2, 3, 4, 5, 9)] == [0, 1, 2, 3, 4, 3, 3]
    assert Rule.chunked(1, 4).filled((5, 0)) == 0
    tensors = [TensorEntry("a", (12, 2), TensorProperties(), rule),
               TensorEntry("b", (2, 2), TensorProperties(), rule)]
    digest = structure_digest(4, 0, [(t.fqn, t.size, t.properties, t.rule) for t in tensors],
                              [])
    index = Index(4, 0, digest, tensors)
    assert index.held(1) == (0, 1) and index.held(2) == index.held(3) == (0,)
    stray = RankRecords(2, digest, [Record(0, Location("__2_0.distcp", 0, 8, "00000000")),
                                    Record(1, Location("__2_0.distcp", 8, 8, "00000000"))])
    with pytest.raises(CorruptCheckpointError, match="holds no part of b"):
        RankRecords.decode(stray.encode(), source="__2_records", rank=2, index=index)
