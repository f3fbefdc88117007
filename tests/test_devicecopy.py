"""Chunked copies through a bounded pool of (pinned) host buffers: the logic of
cloudckpt.dcp.devicecopy on CPU, the device steps as memcpy (HostOps) or made to fail."""

from __future__ import annotations

import threading

import pytest
import torch

from cloudckpt.dcp.devicecopy import (
    HostOps,
    PinnedPool,
    ToDevice,
    to_host,
)
from cloudckpt.errors import ConfigError, DeviceCopyError

KiB = 1024


class CountingOps(HostOps):
    """Memcpy steps that count and can fail: the copy number ``fail_copy``, or the
    wait on event number ``fail_wait`` (each copy's event is its number)."""

    def __init__(self, fail_copy: int | None = None, fail_wait: int | None = None) -> None:
        self.buffers = 0
        self.copies = 0
        self.waits: list[int] = []
        self.fail_copy, self.fail_wait = fail_copy, fail_wait

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        self.buffers += 1
        return super().host_buffer(nbytes)

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> int:
        k = self.copies
        self.copies += 1
        if k == self.fail_copy:
            raise RuntimeError(f"injected: copy {k} failed")
        dst.copy_(src)
        return k

    def to_host(self, dst, src):
        return self._copy(dst, src)

    def to_device(self, dst, src):
        return self._copy(dst, src)

    def wait(self, event) -> None:
        self.waits.append(event)
        if event == self.fail_wait:
            raise RuntimeError(f"injected: event {event} reports a failed copy")


def joined(chunks) -> bytes:
    return b"".join(bytes(c) for c in chunks)


def expected_bytes(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy())


@pytest.mark.parametrize("numel", [0, 1, 7, 1023, 4096, 4097, 3 * 4096 + 5])
def test_chunks_come_in_order_bit_exact_through_the_pool(numel):
    t = torch.randn(numel, dtype=torch.float32).to(torch.bfloat16)
    ops = CountingOps()
    pool = PinnedPool(2 * KiB, 6 * KiB, ops=ops)
    chunks = []
    for c in to_host(t, pool, ops=ops):
        assert c.nbytes <= 2 * KiB
        chunks.append(bytes(c))  # valid until the next is asked for: copied here
    assert b"".join(chunks) == expected_bytes(t)
    assert len(chunks) == -(-numel * 2 // (2 * KiB))
    assert pool.out == 0 and pool.peak_out <= 2


def test_non_contiguous_and_conjugate_views_give_their_values():
    base = torch.arange(64 * 33, dtype=torch.int32).reshape(64, 33)
    view = base.t()[3:20]
    assert not view.is_contiguous()
    ops = CountingOps()
    pool = PinnedPool(KiB, 3 * KiB, ops=ops)
    assert joined(to_host(view, pool, ops=ops)) == expected_bytes(view)
    assert joined(to_host(view)) == expected_bytes(view)  # the CPU path: a compact copy
    z = torch.randn(300, dtype=torch.complex64).conj()
    assert joined(to_host(z, pool, ops=ops)) == expected_bytes(z.resolve_conj())


def test_a_contiguous_cpu_tensor_is_lent_not_copied():
    t = torch.randn(10_000)
    pool = PinnedPool(4 * KiB, 8 * KiB)
    chunks = list(to_host(t, pool))
    assert pool.allocations == 0  # no buffer made: views of the tensor itself
    import numpy as np
    assert np.frombuffer(chunks[0], np.uint8).ctypes.data == t.data_ptr()
    assert b"".join(bytes(c) for c in chunks) == expected_bytes(t)


def test_buffers_are_made_once_and_reused_by_later_copies():
    ops = CountingOps()
    pool = PinnedPool(KiB, 4 * KiB, ops=ops)
    for seed in range(3):
        t = torch.randn(5000, generator=torch.Generator().manual_seed(seed))
        assert joined(to_host(t, pool, ops=ops)) == expected_bytes(t)
    assert pool.allocations == ops.buffers == 2  # DEPTH buffers, made by the first copy
    pool.close()
    assert pool.held_bytes == 0
    assert joined(to_host(torch.ones(600), pool, ops=ops)) == expected_bytes(torch.ones(600))
    assert pool.allocations == 4  # made again after close()


def test_concurrent_consumers_stay_within_capacity_and_all_finish():
    ops = CountingOps()
    pool = PinnedPool(KiB, 3 * KiB, ops=ops)  # fewer buffers than consumers want
    tensors = [torch.randn(2000 + 17 * i) for i in range(6)]
    results: dict[int, bytes] = {}
    start = threading.Barrier(len(tensors))

    def consume(i: int) -> None:
        start.wait()
        results[i] = joined(to_host(tensors[i], pool, ops=ops))

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(len(tensors))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
        assert not th.is_alive(), "a consumer is stuck waiting for a buffer"
    assert results == {i: expected_bytes(t) for i, t in enumerate(tensors)}
    assert pool.peak_out <= 3 and pool.allocations <= 3 and pool.out == 0


def run_with_timeout(fn, timeout=120):
    """Run ``fn`` in a thread; fail (not hang) if it does not end in time."""
    box: dict = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc

    th = threading.Thread(target=target, daemon=True)
    th.start()
    th.join(timeout)
    assert not th.is_alive(), "the copy hung"
    if "error" in box:
        raise box["error"]
    return box.get("value")


def test_a_copy_failing_midway_raises_and_gives_every_buffer_back():
    ops = CountingOps(fail_copy=3)
    pool = PinnedPool(KiB, 4 * KiB, ops=ops)
    got = []

    def consume():
        for c in to_host(torch.randn(3000), pool, ops=ops):
            got.append(bytes(c))

    with pytest.raises(DeviceCopyError, match=r"copying bytes \[3072, 4096\).*injected: copy 3"):
        run_with_timeout(consume)
    assert len(got) in (1, 2)  # the chunks before the failure came, in order
    assert pool.out == 0
    assert ops.waits == sorted(ops.waits)  # every copy issued was waited for first


def test_a_failing_event_raises_and_gives_every_buffer_back():
    ops = CountingOps(fail_wait=1)
    pool = PinnedPool(KiB, 4 * KiB, ops=ops)
    with pytest.raises(DeviceCopyError, match="failed on the device.*event 1"):
        run_with_timeout(lambda: joined(to_host(torch.randn(3000), pool, ops=ops)))
    assert pool.out == 0
    assert 2 in ops.waits  # the copy issued ahead was waited for before its buffer went back


def test_a_consumer_stopping_early_gives_every_buffer_back():
    ops = CountingOps()
    pool = PinnedPool(KiB, 4 * KiB, ops=ops)
    chunks = to_host(torch.randn(5000), pool, ops=ops)
    next(chunks)
    assert pool.out == 2  # the one in use and the one issued ahead
    chunks.close()
    assert pool.out == 0


def test_a_pool_smaller_than_a_chunk_is_refused():
    with pytest.raises(ConfigError, match="capacity >= chunk_bytes"):
        PinnedPool(4 * KiB, KiB)


def test_a_pool_cannot_be_pickled():
    import pickle
    with pytest.raises(TypeError, match="pinned memory"):
        pickle.dumps(PinnedPool(KiB, KiB))


def test_to_device_places_pieces_converting_within_the_pool():
    ops = CountingOps()
    pool = PinnedPool(KiB, 2 * KiB, ops=ops)
    up = ToDevice(pool, ops=ops)
    src = torch.randn(100, 9)  # 36-byte rows: 28 rows a piece
    dst = torch.zeros(100, 9, dtype=torch.float64)
    up.put(dst, src)
    up.put(dst[:0], src[:0])
    up.finish()
    assert torch.equal(dst, src.double())
    assert ops.copies == 4 and pool.out == 0 and pool.peak_out <= 2
    wide = torch.randn(2, 1000)  # a row larger than a buffer: copied directly
    out = torch.zeros(2, 1000)
    up.put(out, wide)
    up.finish()
    assert torch.equal(out, wide)


def test_to_device_a_failing_event_raises_at_finish_and_gives_buffers_back():
    ops = CountingOps(fail_wait=0)
    pool = PinnedPool(KiB, 2 * KiB, ops=ops)
    up = ToDevice(pool, ops=ops)
    up.put(torch.zeros(10), torch.ones(10))
    up.put(torch.zeros(10), torch.ones(10))
    with pytest.raises(DeviceCopyError, match="event 0"):
        up.finish()
    assert pool.out == 0


# ------------------------------------------------ the DCP writer streaming through it

def gpu_like_state(seed: int = 0) -> dict:
    """Tensors of odd sizes, some below the streaming threshold, one a strided view."""
    g = torch.Generator().manual_seed(seed)
    big = torch.randn(300, 701, generator=g)
    return {"w": torch.randn(1_000_003, generator=g).to(torch.bfloat16),
            "strided": big.t()[::2],
            "small": torch.randn(33, generator=g),
            "flag": torch.ones(70_001, dtype=torch.bool),
            "step": 7}


def save_through(state: dict, uri: str, options: dict, copier=None):
    import torch.distributed.checkpoint as dcp

    from cloudckpt.dcp import CloudStorageWriter
    writer = CloudStorageWriter(uri, storage_options=options, overwrite=False)
    if copier is not None:
        writer.copier = copier
    dcp.save(state, storage_writer=writer, no_dist=True)
    return writer.committed


def objects(uri: str, options: dict) -> dict[str, bytes]:
    from cloudckpt.storage import open_store
    store = open_store(uri, options)
    return {o.key: store.get(o.key) for o in store.list() if o.key.endswith(".distcp")}


def test_streamed_save_writes_the_same_bytes_and_loads_bit_exact(s3):
    from cloudckpt.dcp import load
    from cloudckpt.dcp.devicecopy import Copier
    ops = CountingOps()
    pool = PinnedPool(64 * KiB, 256 * KiB, ops=ops)  # several chunks per large tensor
    state = gpu_like_state()
    save_through(state, s3.uri("plain"), s3.options)
    save_through(state, s3.uri("streamed"), s3.options, Copier(pool, ops=ops, every_tensor=True))
    assert ops.copies > 20  # the large tensors went through the pool, in chunks
    plain, streamed = objects(s3.uri("plain"), s3.options), objects(s3.uri("streamed"),
                                                                     s3.options)
    assert plain == streamed  # the very bytes a host copy gives
    out = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0
           for k, v in state.items()}
    load(out, s3.uri("streamed"), storage_options=s3.options)
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(out[k], v), k
    assert pool.out == 0 and pool.peak_out <= pool.limit


def test_later_saves_reuse_the_pool_without_allocating(s3):
    from cloudckpt.dcp.devicecopy import Copier
    ops = CountingOps()
    pool = PinnedPool(64 * KiB, 256 * KiB, ops=ops)
    copier = Copier(pool, ops=ops, every_tensor=True)
    save_through(gpu_like_state(0), s3.uri("first"), s3.options, copier)
    made = pool.allocations
    assert 0 < made <= pool.limit
    save_through(gpu_like_state(1), s3.uri("second"), s3.options, copier)
    assert pool.allocations == made  # no buffer allocated by the second save


def test_a_copy_failing_during_a_save_fails_it_and_commits_nothing(s3):
    from cloudckpt.dcp import save
    from cloudckpt.dcp.devicecopy import Copier
    from cloudckpt.storage import open_store
    ops = CountingOps(fail_wait=5)
    pool = PinnedPool(64 * KiB, 256 * KiB, ops=ops)
    uri = s3.uri("failed")
    with pytest.raises(DeviceCopyError, match=r"\(1000003,\) torch.bfloat16 tensor.*"
                       "failed on the device: injected: event 5"):
        run_with_timeout(lambda: save(gpu_like_state(), uri, storage_options=s3.options,
                                      copier=Copier(pool, ops=ops, every_tensor=True)))
    assert pool.out == 0
    assert not open_store(uri, s3.options).exists("cloudckpt-manifest.json")


# ------------------------------------------------ the DCP reader filling through it

def load_through(dest: dict, uri: str, options: dict, copier) -> None:
    import torch.distributed.checkpoint as dcp

    from cloudckpt.dcp import CloudStorageReader
    dcp.load(dest, storage_reader=CloudStorageReader(uri, storage_options=options,
                                                     copier=copier), no_dist=True)


def test_load_through_bounce_buffers_is_bit_exact_and_converts(s3):
    from cloudckpt.dcp.devicecopy import Copier
    state = gpu_like_state(3)
    uri = s3.uri("to-load")
    save_through(state, uri, s3.options)
    ops = CountingOps()
    pool = PinnedPool(64 * KiB, 256 * KiB, ops=ops)
    holder = torch.zeros(300, 701)
    dest = {"w": torch.zeros(1_000_003, dtype=torch.float32),  # converted from bf16
            "strided": holder.t()[::2],  # a strided destination
            "small": torch.zeros(33), "flag": torch.zeros(70_001, dtype=torch.bool), "step": 0}
    load_through(dest, uri, s3.options, Copier(pool, ops=ops, every_tensor=True))
    assert torch.equal(dest["w"], state["w"].float())
    assert torch.equal(dest["strided"], state["strided"])
    assert torch.equal(holder.t()[1::2], torch.zeros(350, 300))  # nothing else touched
    assert torch.equal(dest["small"], state["small"]) and torch.equal(dest["flag"], state["flag"])
    assert ops.copies > 20  # in pieces through the pool
    assert pool.out == 0 and pool.peak_out <= pool.limit
    made = pool.allocations
    load_through(dest, uri, s3.options, Copier(pool, ops=ops, every_tensor=True))
    assert pool.allocations == made  # the buffers of the first load, reused


def test_a_corrupt_item_fails_the_load_through_bounce_buffers(s3):
    from torch.distributed.checkpoint.api import CheckpointException

    from cloudckpt import open_checkpoint
    from cloudckpt.dcp.devicecopy import Copier
    from cloudckpt.storage import open_store
    uri = s3.uri("corrupt")
    state = gpu_like_state(4)
    save_through(state, uri, s3.options)
    store = open_store(uri, s3.options)
    shard = next(f for f in open_checkpoint(uri, s3.options).files if f.endswith(".distcp"))
    data = bytearray(store.get(shard))
    data[len(data) // 2] ^= 0x10
    store.put(shard, bytes(data))
    ops = CountingOps()
    pool = PinnedPool(64 * KiB, 256 * KiB, ops=ops)
    dest = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0
            for k, v in state.items()}
    with pytest.raises(CheckpointException, match="is corrupt"):
        load_through(dest, uri, s3.options, Copier(pool, ops=ops, every_tensor=True))
    assert pool.out == 0


def test_a_failing_event_fails_the_load_and_gives_buffers_back(s3):
    from torch.distributed.checkpoint.api import CheckpointException

    from cloudckpt.dcp.devicecopy import Copier
    uri = s3.uri("event-fails")
    state = gpu_like_state(5)
    save_through(state, uri, s3.options)
    ops = CountingOps(fail_wait=2)
    pool = PinnedPool(64 * KiB, 256 * KiB, ops=ops)
    dest = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0
            for k, v in state.items()}
    with pytest.raises(CheckpointException, match="DeviceCopyError.*event 2"):
        run_with_timeout(lambda: load_through(dest, uri, s3.options,
                                              Copier(pool, ops=ops, every_tensor=True)))
    assert pool.out == 0



def test_a_writer_given_a_pool_still_pickles_for_process_based_async_saves(memory):
    import pickle

    from cloudckpt.dcp import CloudStorageWriter
    pool = PinnedPool(KiB, 4 * KiB)
    writer = CloudStorageWriter(memory.uri("p"), pinned_pool=pool)
    assert writer.copier.pool is pool
    copy = pickle.loads(pickle.dumps(writer))
    assert copy.copier.pool is None  # the other process uses its own shared pool
