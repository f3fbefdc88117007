"""DCP loads through cloudckpt, bit for bit, on S3 (moto) and local disk.

Behaviour-level checks for the streaming reader: tensors of every layout the
saved state can have (non-contiguous, views sharing a storage, 0-d, empty),
the dtypes checkpoints hold, tensors spanning several parts, destinations of
another dtype or layout, partial (windowed) reads, and corruption detected
mid-stream. Only the public API is used: ``cloudckpt.dcp.save``/``load``,
``open_checkpoint`` and ``cloudckpt.errors``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

import boto3
import pytest
import torch
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

import cloudckpt.dcp as cloud_dcp
from cloudckpt import open_checkpoint
from cloudckpt.errors import CorruptCheckpointError, StateMismatchError
from cloudckpt.storage.transfer.window import shared_window

if TYPE_CHECKING:
    from conftest import Backend

MiB = 1024 * 1024
#: The smallest part an S3 multipart upload may have; used on both backends.
PART = 5 * MiB
#: A sentinel no saved value equals (the load must overwrite it).
SENTINEL = 12345.0

_INT_OF = {torch.float16: torch.int16, torch.bfloat16: torch.int16,
           torch.float32: torch.int32, torch.float64: torch.int64}


@pytest.fixture(params=["s3", "local"])
def where(request) -> Backend:
    """S3 on the moto server, then a local directory."""
    return request.getfixturevalue(request.param)


# --------------------------------------------------------------------- helpers


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a float tensor (NaN payloads and -0.0 included) as integers."""
    return t.contiguous().view(_INT_OF[t.dtype]) if t.dtype in _INT_OF else t


def assert_same(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    """Same shape, dtype and bits (torch.equal for all, bit patterns for floats)."""
    assert got.shape == want.shape, (what, got.shape, want.shape)
    assert got.dtype == want.dtype, (what, got.dtype, want.dtype)
    if want.is_floating_point():
        assert torch.equal(bits(got), bits(want)), what
    else:
        assert torch.equal(got, want), what


def sentinel_like(t: torch.Tensor) -> torch.Tensor:
    """A fresh contiguous destination of ``t``'s shape and dtype, no element equal to ``t``'s."""
    if not t.is_floating_point():
        return torch.bitwise_not(t.detach()).contiguous()
    return torch.full(tuple(t.shape), SENTINEL, dtype=t.dtype)


def save(state: dict, backend: Backend, name: str, **options) -> str:
    uri = backend.uri(name)
    cloud_dcp.save(state, uri, storage_options={**backend.options, **options})
    return uri


def load(state: dict, backend: Backend, uri: str, planner=None, **options) -> None:
    cloud_dcp.load(state, uri, storage_options={**backend.options, **options},
                   planner=planner)


def round_trip(state: dict, backend: Backend, name: str = "ckpt") -> dict:
    """Save ``state``, load it into sentinel-filled destinations, return those."""
    uri = save(state, backend, name)
    dest = {k: sentinel_like(v) for k, v in state.items()}
    load(dest, backend, uri)
    return dest


def shards(backend: Backend, uri: str) -> list[str]:
    return [f for f in open_checkpoint(uri, backend.options).files if f.endswith(".distcp")]


def _s3_location(uri: str, path: str) -> tuple[str, str]:
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    return bucket, f"{prefix}/{path}"


def _s3_client(backend: Backend):
    return boto3.client("s3", endpoint_url=backend.options["endpoint_url"],
                        aws_access_key_id=backend.options["key"],
                        aws_secret_access_key=backend.options["secret"],
                        region_name="us-east-1")


def raw_get(backend: Backend, uri: str, path: str) -> bytes:
    """An object's bytes, read past cloudckpt (boto3, or the file itself)."""
    if backend.name == "s3":
        bucket, key = _s3_location(uri, path)
        return _s3_client(backend).get_object(Bucket=bucket, Key=key)["Body"].read()
    return (Path(uri) / path).read_bytes()


def flip_byte(backend: Backend, uri: str, path: str, pos: int) -> None:
    """Flip one bit of byte ``pos`` of an object, keeping its size: an S3 object is
    rewritten through boto3, a local file is edited in place."""
    if backend.name == "s3":
        data = bytearray(raw_get(backend, uri, path))
        data[pos] ^= 0x10
        bucket, key = _s3_location(uri, path)
        _s3_client(backend).put_object(Bucket=bucket, Key=key, Body=bytes(data))
        assert len(raw_get(backend, uri, path)) == len(data)
    else:
        with open(Path(uri) / path, "r+b") as f:
            f.seek(pos)
            b = f.read(1)[0]
            f.seek(pos)
            f.write(bytes([b ^ 0x10]))


def randn(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


# ---------------------------------------------------------------- 1. layouts


def test_non_contiguous_sources_round_trip(where):
    base = randn(40, 30, seed=1)
    four = randn(2, 3, 4, 5, seed=2)
    state = {
        "transposed": base.t(),
        "strided_rows": base[::3],
        "strided_both": base[1::2, 2::3],
        "column": base[:, 7],
        "narrowed": base.narrow(1, 5, 11),
        "permuted": four.permute(3, 1, 0, 2),
        "channels_last": four.contiguous(memory_format=torch.channels_last),
        "expanded": torch.arange(7, dtype=torch.int64).expand(5, 7),
    }
    expected = {k: v.clone(memory_format=torch.contiguous_format) for k, v in state.items()}
    assert not any(v.is_contiguous() for v in state.values())  # the premise of the test
    got = round_trip(state, where)
    for k, v in expected.items():
        assert_same(got[k], v, k)


# ------------------------------------------------------------- 2. shared storage


def test_views_sharing_one_storage_saved_as_separate_keys(where):
    base = randn(200, 30, seed=3)
    state = {
        "base": base,
        "top": base[:10],
        "bottom": base[190:],
        "middle_cols": base[5:15, 10:20],
        "col": base[:, 4],
        "transposed": base.t(),
        "flat": base.view(-1)[100:400],
        "as_int32": base.view(torch.int32),
        "other_slice_of_a_bigger_tensor": randn(1000, seed=4)[500:520],
    }
    storage = base.untyped_storage().data_ptr()
    assert sum(v.untyped_storage().data_ptr() == storage for v in state.values()) == 8
    expected = {k: v.clone() for k, v in state.items()}
    uri = save(state, where, "ckpt")
    dest = {k: sentinel_like(v) for k, v in state.items()}
    load(dest, where, uri)
    for k, v in expected.items():
        assert_same(dest[k], v, k)
    # Each key holds its own bytes, not the whole storage it is a view of (torch.save of
    # a view writes all of its storage: 8 x 24 kB here), give or take 4 KiB of framing.
    ckpt = open_checkpoint(uri, where.options)
    payload = sum(v.numel() * v.element_size() for v in state.values())
    assert sum(ckpt.entry(f).size for f in shards(where, uri)) < payload + 4096 * len(state)


def test_destinations_that_are_views_of_one_storage(where):
    base = randn(40, 30, seed=5)
    uri = save({"base": base, "top": base[:10].clone(), "col": base[:, 4].clone(),
                "t": base.t().clone()}, where, "ckpt")
    buf = torch.full((40, 30), SENTINEL)
    dest = {"base": buf, "top": buf[:10], "col": buf[:, 4], "t": buf.t()}
    load(dest, where, uri)
    assert_same(buf, base, "base")  # every write into the shared storage agreed
    assert_same(dest["col"], base[:, 4], "col")
    assert_same(dest["t"], base.t(), "t")


# ------------------------------------------------------------- 3. 0-d and empty


def test_zero_dim_and_empty_tensors(where):
    state = {
        "scalar_f32": torch.tensor(3.25),
        "scalar_neg_zero": torch.tensor(-0.0),
        "scalar_i64": torch.tensor(-(2**40) - 7, dtype=torch.int64),
        "scalar_bf16": torch.tensor(1.0078125, dtype=torch.bfloat16),
        "scalar_bool": torch.tensor(True),
        "empty": torch.empty(0),
        "empty_3x0": torch.empty(3, 0),
        "empty_0x5_bf16": torch.empty(0, 5, dtype=torch.bfloat16),
        "empty_i8": torch.empty(0, dtype=torch.int8),
        "neighbour": torch.arange(11, dtype=torch.float32),
    }
    got = round_trip(state, where)
    for k, v in state.items():
        assert_same(got[k], v, k)
    assert got["scalar_neg_zero"].dim() == 0 and torch.signbit(got["scalar_neg_zero"])


# ------------------------------------------------------------------- 4. dtypes


def _values(dtype: torch.dtype) -> torch.Tensor:
    """Odd-sized (37, 29) values of ``dtype`` covering its range and, for floats,
    NaN, +-inf, -0.0 and subnormals."""
    g = torch.Generator().manual_seed(6)
    n = 37 * 29
    if dtype == torch.bool:
        t = torch.rand(n, generator=g) > 0.5
    elif dtype == torch.int8:
        t = torch.randint(-128, 128, (n,), generator=g, dtype=torch.int8)
    elif dtype == torch.int64:
        t = torch.randint(-(2**62), 2**62, (n,), generator=g, dtype=torch.int64)
        t[:3] = torch.tensor([torch.iinfo(torch.int64).min, torch.iinfo(torch.int64).max, 0])
    else:
        t = (torch.randn(n, generator=g) * 100).to(dtype)
        info = torch.finfo(dtype)
        t[:7] = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0,
                              info.tiny / 4, info.max, info.min]).to(dtype)
        # A NaN with a payload other than the default one.
        t.view(_INT_OF[dtype])[7] = t.view(_INT_OF[dtype])[0] | 1
    return t.reshape(37, 29)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.int8, torch.bool,
                                   torch.int64, torch.float32], ids=str)
def test_dtypes_round_trip_bit_exact(where, dtype):
    v = _values(dtype)
    state = {"v": v, "v_strided": v[::2, 1::2]}
    got = round_trip(state, where)
    assert_same(got["v"], v, "v")
    assert_same(got["v_strided"], v[::2, 1::2].contiguous(), "v_strided")
    if dtype in (torch.bfloat16, torch.float16):
        assert torch.equal(got["v"].view(torch.int16), v.view(torch.int16))


# ------------------------------------------------------- 5. larger than a part


def test_tensor_of_several_parts(where):
    n = (7 * PART) // 2 // 4 + 3  # 3.5 parts of fp32, plus 3 elements: no part boundary aligns
    big = randn(n, seed=7)
    small = torch.arange(1001, dtype=torch.int16)
    uri = save({"big": big, "small": small}, where, "ckpt", part_size=PART)
    ckpt = open_checkpoint(uri, where.options)
    assert max(ckpt.entry(f).size for f in shards(where, uri)) > 3 * PART
    dest = {"big": torch.full((n,), SENTINEL), "small": torch.zeros(1001, dtype=torch.int16)}
    load(dest, where, uri, part_size=PART)
    assert_same(dest["big"], big, "big")
    assert_same(dest["small"], small, "small")


# ------------------------------------------------ 6. and 7. other destinations


def assert_converted(got: torch.Tensor, saved: torch.Tensor, what: str) -> None:
    """``got`` is ``saved.to(got.dtype)``: same bits wherever ``saved`` is not NaN, and NaN
    where it is (torch's own casts give a NaN different bits on different kernel paths:
    0x7fc0 or 0xffff in bf16, so a NaN's bits after a cast are not the reader's to keep)."""
    want = saved.to(got.dtype)
    assert got.shape == want.shape and got.dtype == want.dtype, what
    nan = torch.isnan(saved)
    assert torch.equal(torch.isnan(got), nan), what
    assert torch.equal(bits(got)[~nan], bits(want)[~nan]), what


def test_destination_of_another_dtype(where):
    saved = randn(33, 17, seed=8) * 3.0
    # NaN, inf, -0.0, an fp32 subnormal, values that round (to even, and up) in bf16
    saved[0, :7] = torch.tensor([float("nan"), float("inf"), -0.0, 1e-40,
                                 1.00390625, 1.01171875, 70000.0])
    uri = save({"w": saved, "v": saved[:, 3].clone()}, where, "ckpt")
    for dtype in (torch.bfloat16, torch.float64, torch.float16):
        dest = {"w": torch.full((33, 17), SENTINEL, dtype=dtype),
                "v": torch.full((33,), SENTINEL, dtype=dtype)}
        load(dest, where, uri)
        assert_converted(dest["w"], saved, str(dtype))
        assert_converted(dest["v"], saved[:, 3], str(dtype))
    # A bf16 destination that is also non-contiguous.
    dst = torch.full((17, 33), SENTINEL, dtype=torch.bfloat16).t()
    load({"w": dst}, where, uri)
    assert_converted(dst, saved, "transposed bf16")


def test_non_contiguous_destinations(where):
    w = randn(64, 48, seed=9)
    c = randn(2, 3, 4, 5, seed=10)
    uri = save({"w": w, "row": w[7].clone(), "c": c}, where, "ckpt")
    transposed = torch.full((48, 64), SENTINEL).t()
    wide = torch.full((64, 100), SENTINEL)
    window = wide[:, 10:58]
    strided = torch.full((200,), SENTINEL)
    every_fourth = strided[::4][:48]
    cl = torch.full((2, 3, 4, 5), SENTINEL).contiguous(memory_format=torch.channels_last)
    assert not any(t.is_contiguous() for t in (transposed, window, every_fourth, cl))
    load({"w": transposed, "row": every_fourth, "c": cl}, where, uri)
    assert_same(transposed, w, "transposed")
    assert_same(every_fourth, w[7], "every_fourth")
    assert_same(cl, c, "channels_last")
    load({"w": window}, where, uri)
    assert_same(window, w, "window")
    # Nothing outside the destination views was written.
    assert torch.all(wide[:, :10] == SENTINEL) and torch.all(wide[:, 58:] == SENTINEL)
    gaps = torch.ones(200, dtype=torch.bool)
    gaps[0:192:4] = False
    assert torch.all(strided[gaps] == SENTINEL)


# --------------------------------------------------------------- 8. corruption


def _corruption_case(where: Backend) -> tuple[str, str, torch.Tensor, bytes]:
    w = randn(1024 * 1024 + 5, seed=11)  # 4 MiB and a bit: several 1 MiB read ranges
    uri = save({"w": w}, where, "ckpt")
    (shard,) = shards(where, uri)
    data = raw_get(where, uri, shard)
    return uri, shard, w, data


def _expect_corrupt(where: Backend, uri: str, shard: str, n: int) -> None:
    dest = {"w": torch.full((n,), SENTINEL)}
    with pytest.raises(CorruptCheckpointError) as exc:
        load(dest, where, uri, part_size=MiB)
    assert shard in str(exc.value)


def test_flipped_byte_mid_tensor_is_caught(where):
    uri, shard, w, data = _corruption_case(where)
    start = data.find(w.numpy().tobytes())
    assert start > 0  # the tensor's bytes lie in the object as they are
    dest = {"w": torch.full_like(w, SENTINEL)}
    load(dest, where, uri, part_size=MiB)  # intact, it loads
    assert_same(dest["w"], w)
    flip_byte(where, uri, shard, start + w.numel() * 4 // 2 + 1)
    _expect_corrupt(where, uri, shard, w.numel())


@pytest.mark.parametrize("spot", ["signature", "entry_name", "pickle", "last_byte"])
def test_flipped_byte_outside_the_tensor_data_is_caught(where, spot):
    uri, shard, w, data = _corruption_case(where)
    pos = {"signature": 0, "entry_name": 31, "last_byte": len(data) - 1,
           "pickle": data.find(b"_rebuild_tensor")}[spot]
    assert pos >= 0 and data[:4] == b"PK\x03\x04"
    flip_byte(where, uri, shard, pos)
    assert raw_get(where, uri, shard)[pos] != data[pos]
    _expect_corrupt(where, uri, shard, w.numel())


# ------------------------------------------------------------ 9. partial loads


def _partial_state() -> dict:
    return {"big": randn(64, 48, seed=12), "bias": randn(48, seed=13),
            "counts": torch.arange(100, dtype=torch.int64), "half": randn(9, 5, seed=14,
                                                                          dtype=torch.bfloat16)}


def test_partial_load_of_some_keys(where):
    state = _partial_state()
    uri = save(state, where, "ckpt")
    extra = torch.full((4,), SENTINEL)
    dest = {"big": torch.full((64, 48), SENTINEL), "half": sentinel_like(state["half"]),
            "not_in_checkpoint": extra}
    with pytest.raises(StateMismatchError, match="not_in_checkpoint"):
        load(dest, where, uri)
    dest = {"big": torch.full((64, 48), SENTINEL), "half": sentinel_like(state["half"]),
            "not_in_checkpoint": extra}
    load(dest, where, uri, planner=DefaultLoadPlanner(allow_partial_load=True))
    assert_same(dest["big"], state["big"], "big")
    assert_same(dest["half"], state["half"], "half")
    assert torch.all(extra == SENTINEL)
    assert set(dest) == {"big", "half", "not_in_checkpoint"}


class _WindowPlanner(DefaultLoadPlanner):
    """Reads windows of saved tensors into destination keys, as a resharding load
    does: ``windows`` maps a destination key to (saved key, offsets, sizes)."""

    def __init__(self, windows: dict[str, tuple[str, tuple[int, ...], tuple[int, ...]]]):
        super().__init__()
        self.windows = windows

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        items = []
        for dest_key, (fqn, offsets, sizes) in self.windows.items():
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
            for item in create_read_items_for_chunk_list(
                    fqn, self.metadata.state_dict_metadata[fqn], [chunk]):
                items.append(dataclasses.replace(
                    item, dest_index=MetadataIndex(dest_key, item.dest_index.offset,
                                                   item.dest_index.index)))
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.state_dict[index.fqn]


def test_windowed_reads_of_parts_of_saved_tensors(where):
    state = _partial_state()
    big = state["big"]
    uri = save(state, where, "ckpt")
    wide = torch.full((24, 40), SENTINEL)
    dest = {
        "rows": torch.full((24, 48), SENTINEL),  # whole rows: one byte range of the item
        "block": torch.full((20, 16), SENTINEL),  # a block: strided in the saved storage
        "block_t": torch.full((16, 20), SENTINEL).t(),  # ... into a transposed view
        "block_in_wide": wide[2:22, 5:21],  # ... into a window of a bigger tensor
        "tail_counts": torch.zeros(7, dtype=torch.int64),
        "corner": torch.zeros(1, 1),
    }
    planner = _WindowPlanner({
        "rows": ("big", (16, 0), (24, 48)),
        "block": ("big", (30, 9), (20, 16)),
        "block_t": ("big", (30, 9), (20, 16)),
        "block_in_wide": ("big", (44, 32), (20, 16)),
        "tail_counts": ("counts", (93,), (7,)),
        "corner": ("big", (63, 47), (1, 1)),
    })
    load(dest, where, uri, planner=planner)
    assert_same(dest["rows"], big[16:40], "rows")
    assert_same(dest["block"], big[30:50, 9:25], "block")
    assert_same(dest["block_t"], big[30:50, 9:25], "block_t")
    assert_same(dest["block_in_wide"], big[44:64, 32:48], "block_in_wide")
    assert_same(dest["tail_counts"], state["counts"][93:], "tail_counts")
    assert_same(dest["corner"], big[63:, 47:], "corner")
    outside = torch.ones(24, 40, dtype=torch.bool)
    outside[2:22, 5:21] = False
    assert torch.all(wide[outside] == SENTINEL)


def test_load_buffers_stay_within_the_read_window(s3):
    """Same-dtype contiguous destinations take the bytes straight into their memory
    (no window bytes at all); converted ones go through the window a few rows at a
    time, never more than it holds."""
    g = torch.Generator().manual_seed(7)
    sd = {"a": torch.randn(2048, 1024, generator=g), "b": torch.randn(1024, 1536, generator=g)}
    uri = save(sd, s3, "window")
    window = 3 * MiB + 17  # a capacity no other test uses: a window of its own
    dst = {k: torch.zeros_like(v) for k, v in sd.items()}
    reader = cloud_dcp.CloudStorageReader(uri, storage_options=s3.options, read_window=window)
    dcp_load(dst, storage_reader=reader, no_dist=True)
    assert all(torch.equal(dst[k], v) for k, v in sd.items())
    assert shared_window(window).peak == 0
    half = {k: torch.zeros(v.shape, dtype=torch.bfloat16) for k, v in sd.items()}
    reader = cloud_dcp.CloudStorageReader(uri, storage_options=s3.options, read_window=window)
    dcp_load(half, storage_reader=reader, no_dist=True)
    assert all(torch.equal(half[k], v.to(torch.bfloat16)) for k, v in sd.items())
    assert 0 < shared_window(window).peak <= window


# Storages of 512 KiB (fetched with neighbours), 4 MiB (one streamed request) and
# 36 MiB (over two parts: located by a head read, then fetched whole).
@pytest.mark.parametrize("n,rows", [(128, 40), (1024, 900), (9216, 9000)])
def test_items_of_another_layout_load_through_torch_load(where, monkeypatch, n, rows):
    """A record whose tensor is not a compact C-contiguous one (here: a view saved
    with its whole storage, as other writers may) is read whole and torch.load'ed."""
    import cloudckpt.dcp.units as units

    monkeypatch.setattr(units, "cpu_compact", lambda t: t.detach())
    g = torch.Generator().manual_seed(3)
    big = torch.randn(n, 1024, generator=g)
    sd = {"v": big[n - rows:]}
    uri = save(sd, where, f"layout-{rows}")
    files = [f for f in open_checkpoint(uri, where.options).files if f.endswith(".distcp")]
    assert sum(open_checkpoint(uri, where.options).entry(f).size for f in files) > big.nbytes
    dst = {"v": torch.zeros(rows, 1024)}
    load(dst, where, uri)
    assert torch.equal(dst["v"], sd["v"])
