"""Moving tensor bytes between a GPU and host memory in chunks, through pinned buffers.

A save cannot hand a GPU tensor's memory to an upload: its bytes must come to the
host first. Copying a whole tensor with ``t.cpu()`` allocates pageable memory of its
size, copies synchronously (at about half the link's speed from pageable memory)
and uploads only once all of it is there. Here its bytes come through a
:class:`PinnedPool` of fixed-size buffers (allocated once, reused by every later
save, bounded in all by ``capacity``), a chunk at a time: chunk k+1's copy is issued
on a side stream before chunk k is handed to the consumer, so the consumer's
checksum and upload of chunk k run while the GPU copies chunk k+1
(:func:`to_host`). A load goes the other way (:class:`ToDevice`): checked bytes
staged into a pinned buffer, copied to the GPU without blocking, while the next
reads arrive.

The device steps are behind :class:`DeviceOps` (:class:`CudaOps` on a GPU,
:class:`HostOps` a plain memcpy otherwise), so the same code runs, and is tested,
on CPU tensors; a test can give one that fails where it chooses. CPU tensors that
are contiguous are never copied: their chunks are views of their own memory.

This lives in ``dcp/`` rather than ``storage/``: the storage layer moves bytes and
knows nothing of torch.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Generator
from typing import Any, Protocol

import torch

from cloudckpt.errors import ConfigError, DeviceCopyError

log = logging.getLogger(__name__)

#: Bytes of one pinned buffer: one chunk of a copy.
DEFAULT_CHUNK_BYTES = 64 << 20
#: Bytes of pinned buffers a pool holds at most, in all.
DEFAULT_CAPACITY = 256 << 20
#: Copies one consumer has issued ahead of the chunk it is using, at most.
DEPTH = 2


class DeviceOps(Protocol):
    """The device steps of a copy, so that a test can replace them."""

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """A host buffer of ``nbytes`` bytes (uint8), pinned where copies need it."""
        ...

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        """Issue the copy of ``src`` into the host buffer ``dst``; its event."""
        ...

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        """Issue the copy of the host ``src`` into ``dst`` (a device tensor); its event."""
        ...

    def wait(self, event: Any) -> None:
        """Block until the copy of ``event`` is done; raise if it failed."""
        ...


class HostOps:
    """Copies within host memory: synchronous memcpy, no events."""

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        dst.copy_(src)
        return None

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        dst.copy_(src)
        return None

    def wait(self, event: Any) -> None:
        pass


class CudaOps:
    """Copies on a side stream of each device, ordered after the work already queued on
    the current stream (the values a step just wrote), each followed by an event."""

    def __init__(self) -> None:
        self._streams: dict[int, Any] = {}
        self._lock = threading.Lock()

    def _stream(self, device: torch.device) -> Any:
        index = device.index if device.index is not None else torch.cuda.current_device()
        with self._lock:
            stream = self._streams.get(index)
            if stream is None:
                stream = self._streams[index] = torch.cuda.Stream(device=index)
        return stream

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        return self._copy(dst, src, src.device)

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        return self._copy(dst, src, dst.device)

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, device: torch.device) -> Any:
        stream = self._stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        if dst.is_cuda:  # later work on the current stream sees the bytes
            torch.cuda.current_stream(device).wait_event(event)
        return event

    def wait(self, event: Any) -> None:
        event.synchronize()


_cuda_ops: CudaOps | None = None


def ops_for(device: torch.device) -> DeviceOps:
    """The device steps for copies from or to ``device`` (one set per process)."""
    global _cuda_ops
    if device.type != "cuda":
        return HostOps()
    if _cuda_ops is None:
        _cuda_ops = CudaOps()
    return _cuda_ops


class PinnedPool:
    """Host buffers of ``chunk_bytes`` each, at most ``capacity`` bytes in all, made on
    first use and kept for every later copy (pinned on a GPU machine: pinning is
    slow, a few hundred ms per GiB, and belongs outside the save's critical path).

    :meth:`acquire` blocks while every buffer is out; a consumer takes one buffer
    blocking only while it holds none (:meth:`try_acquire` for more), so consumers
    holding buffers always progress and give them back. :meth:`close` frees the
    buffers (those out, when they come back); the pool makes new ones if used again.
    ``allocations`` counts the buffers ever made, ``peak_out`` the most out at once.
    """

    def __init__(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 capacity: int = DEFAULT_CAPACITY, *, ops: DeviceOps | None = None) -> None:
        if chunk_bytes <= 0 or capacity < chunk_bytes:
            raise ConfigError(
                f"a pinned pool needs chunk_bytes > 0 and capacity >= chunk_bytes (got "
                f"chunk_bytes={chunk_bytes}, capacity={capacity}): raise the capacity to at "
                "least one chunk")
        self.chunk_bytes = chunk_bytes
        self.capacity = capacity
        self.limit = capacity // chunk_bytes
        self._ops = ops
        self._free: list[torch.Tensor] = []
        self._made = 0  # buffers that exist (free or out)
        self._out = 0
        self._cond = threading.Condition()
        self._generation = 0  # bumped by close(): buffers of an older one are dropped
        self._owner: dict[int, int] = {}  # id(buffer) -> its generation
        self.allocations = 0
        self.peak_out = 0

    @property
    def out(self) -> int:
        """Buffers acquired and not yet given back."""
        return self._out

    @property
    def held_bytes(self) -> int:
        """Bytes of buffers that exist now (free or out)."""
        return self._made * self.chunk_bytes

    def acquire(self) -> torch.Tensor:
        """A buffer, waiting for one to come back while all are out."""
        with self._cond:
            while True:
                buf = self._take()
                if buf is not None:
                    return buf
                self._cond.wait()

    def try_acquire(self) -> torch.Tensor | None:
        """A buffer if one is free or may be made, else None at once."""
        with self._cond:
            return self._take()

    def _take(self) -> torch.Tensor | None:
        if self._free:
            buf = self._free.pop()
        elif self._made < self.limit:
            buf = self._make()
        else:
            return None
        self._out += 1
        self.peak_out = max(self.peak_out, self._out)
        return buf

    def _make(self) -> torch.Tensor:
        ops = self._ops or ops_for(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
        buf = ops.host_buffer(self.chunk_bytes)
        self._made += 1
        self.allocations += 1
        self._owner[id(buf)] = self._generation
        return buf

    def release(self, buf: torch.Tensor) -> None:
        """Give back a buffer from :meth:`acquire`."""
        with self._cond:
            self._out -= 1
            if self._owner.get(id(buf)) == self._generation:
                self._free.append(buf)
            else:  # made before a close(): freed now
                self._owner.pop(id(buf), None)
                self._made -= 1
            self._cond.notify()

    def close(self) -> None:
        """Free the buffers (those out, once given back)."""
        with self._cond:
            for buf in self._free:
                self._owner.pop(id(buf), None)
            self._free = []
            self._made = self._out  # those out count against the capacity until back
            self._generation += 1
            self._cond.notify_all()

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("a PinnedPool holds this process's pinned memory; it cannot be "
                        "sent to another process (give each process its own)")


_pools: dict[tuple[int, int], PinnedPool] = {}
_pools_lock = threading.Lock()


def shared_pool(chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                capacity: int = DEFAULT_CAPACITY) -> PinnedPool:
    """The process's pool of that size, for every save and load not given its own."""
    with _pools_lock:
        pool = _pools.get((chunk_bytes, capacity))
        if pool is None:
            pool = _pools[chunk_bytes, capacity] = PinnedPool(chunk_bytes, capacity)
        return pool


def shared_pinned_bytes() -> int:
    """Bytes of buffers the process's shared pools hold now."""
    with _pools_lock:
        return sum(pool.held_bytes for pool in _pools.values())


def close_shared_pools() -> None:
    """Free the buffers of the process's shared pools (made again if used again)."""
    with _pools_lock:
        pools = list(_pools.values())
    for pool in pools:
        pool.close()


def _after_fork() -> None:
    global _pools_lock, _cuda_ops
    _pools_lock = threading.Lock()
    _pools.clear()
    _cuda_ops = None


os.register_at_fork(after_in_child=_after_fork)


def flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's values as contiguous bytes (uint8) on its own device: itself when
    it is contiguous, a compact copy otherwise (conjugate and negative views resolved)."""
    t = tensor.detach().resolve_conj().resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def to_host(tensor: torch.Tensor, pool: PinnedPool | None = None, *,
            ops: DeviceOps | None = None) -> Generator[memoryview, None, None]:
    """The tensor's bytes in order, in chunks of at most the pool's chunk size, each a
    memoryview valid until the next is asked for (or the generator is closed).

    A CPU tensor's chunks are views of its own memory (a compact copy first if it is
    not contiguous), the pool untouched. Otherwise every chunk is copied into a pool
    buffer on the device's side stream, up to :data:`DEPTH` copies issued ahead of
    the one being used: chunk k+1 is on its way while the consumer uses chunk k.
    Every buffer is back in the pool when the generator ends, fails or is closed
    (close it, ``contextlib.closing``, when the consumer may stop early: else the
    buffers wait for it to be collected); a failed copy or event raises
    :class:`DeviceCopyError`."""
    flat = flat_bytes(tensor)
    total = flat.numel()
    if flat.device.type == "cpu" and ops is None:
        step = pool.chunk_bytes if pool is not None else max(total, 1)
        whole = memoryview(flat.numpy())  # type: ignore[arg-type]  # numpy's stubs: a buffer from 3.12
        for a in range(0, total, step):
            yield whole[a:a + step]
        return
    pool = pool or shared_pool()
    ops = ops or ops_for(flat.device)
    step = pool.chunk_bytes
    bounds = [(a, min(a + step, total)) for a in range(0, total, step)]
    issued: list[tuple[torch.Tensor, Any, int]] = []  # buffer, event, bytes: in order
    next_k = 0
    try:
        for _ in bounds:
            # Issue ahead while buffers come without waiting: the first blocking only
            # when this consumer holds none, so that holders always progress.
            while next_k < len(bounds) and len(issued) < DEPTH:
                buf = pool.acquire() if not issued else pool.try_acquire()
                if buf is None:
                    break
                a, b = bounds[next_k]
                try:
                    event = ops.to_host(buf[:b - a], flat[a:b])
                except Exception as exc:
                    pool.release(buf)
                    raise DeviceCopyError(
                        f"copying bytes [{a}, {b}) of a {tuple(tensor.shape)} "
                        f"{tensor.dtype} tensor on {tensor.device} to host memory failed: "
                        f"{exc}") from exc
                issued.append((buf, event, b - a))
                next_k += 1
            buf, event, n = issued[0]
            try:
                ops.wait(event)
            except Exception as exc:
                raise DeviceCopyError(
                    f"a copy of a {tuple(tensor.shape)} {tensor.dtype} tensor on "
                    f"{tensor.device} to host memory failed on the device: {exc}") from exc
            view = memoryview(buf.numpy())[:n]  # type: ignore[arg-type]  # numpy's stubs: a buffer from 3.12
            try:
                yield view
            finally:
                view.release()
                issued.pop(0)
                pool.release(buf)
    finally:
        _settle(issued, pool, ops)


def _settle(issued: list[tuple[torch.Tensor, Any, int]], pool: PinnedPool,
            ops: DeviceOps) -> None:
    """Wait for copies still in flight (their buffers are being written), then give
    every buffer back; a failure here is logged (the first one is being raised)."""
    for buf, event, _ in issued:
        try:
            ops.wait(event)
        except Exception:  # noqa: BLE001 - the error that stopped the copy is on its way
            log.debug("a device copy in flight failed while another error was raised",
                      exc_info=True)
        pool.release(buf)
    issued.clear()


class ToDevice:
    """Checked host bytes into device tensors: each piece copied into a pool buffer,
    then to the device without blocking, while the caller goes on with the next
    reads; :meth:`finish` waits for every copy. Thread-safe: one per load."""

    def __init__(self, pool: PinnedPool | None = None, *, ops: DeviceOps | None = None) -> None:
        self._pool = pool or shared_pool()
        self._ops = ops
        self._inflight: list[tuple[torch.Tensor, Any, DeviceOps]] = []
        self._lock = threading.Lock()
        self.copies = 0

    def put(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy the host tensor ``src`` into ``dst`` (same shape; the dtype converted
        on the device), in pieces of whole rows within a buffer."""
        if src.shape != dst.shape:
            raise ValueError(f"shapes differ: {tuple(src.shape)} into {tuple(dst.shape)}")
        nbytes = src.numel() * src.element_size()
        if nbytes == 0:
            return
        chunk = self._pool.chunk_bytes
        if nbytes <= chunk:
            self._put(dst, src)
            return
        row = nbytes // src.shape[0] if src.dim() else nbytes
        if src.dim() == 0 or row > chunk:  # a single row larger than a buffer
            self._wait_all()
            dst.copy_(src)
            return
        rows = chunk // row
        for r in range(0, src.shape[0], rows):
            self._put(dst[r:r + rows], src[r:r + rows])

    def _put(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        ops = self._ops or ops_for(dst.device)
        buf = self._buffer()
        try:
            host = buf[:src.numel() * src.element_size()].view(src.dtype).view(src.shape)
            host.copy_(src)
            event = ops.to_device(dst, host)
        except Exception as exc:
            self._pool.release(buf)
            raise DeviceCopyError(
                f"copying a {tuple(src.shape)} {src.dtype} piece to {dst.device} failed: "
                f"{exc}") from exc
        with self._lock:
            self._inflight.append((buf, event, ops))
            self.copies += 1

    def _buffer(self) -> torch.Tensor:
        """A free buffer; else the oldest copy's, once done; else wait for any."""
        while True:
            buf = self._pool.try_acquire()
            if buf is not None:
                return buf
            with self._lock:
                oldest = self._inflight.pop(0) if self._inflight else None
            if oldest is None:
                return self._pool.acquire()  # holding none: others will give one back
            self._finish_one(*oldest)

    def _finish_one(self, buf: torch.Tensor, event: Any, ops: DeviceOps) -> None:
        try:
            ops.wait(event)
        except Exception as exc:
            raise DeviceCopyError(f"a copy to a device failed on the device: {exc}") from exc
        finally:
            self._pool.release(buf)

    def _wait_all(self) -> None:
        with self._lock:
            inflight, self._inflight = self._inflight, []
        error: BaseException | None = None
        for buf, event, ops in inflight:
            try:
                self._finish_one(buf, event, ops)
            except DeviceCopyError as exc:
                error = error or exc
        if error is not None:
            raise error

    def finish(self) -> None:
        """Wait for every copy (raising a failed one's error); the buffers go back."""
        self._wait_all()

    def close(self) -> None:
        """After a failure: wait for the copies in flight, give back their buffers."""
        try:
            self._wait_all()
        except DeviceCopyError:
            log.debug("a device copy failed while another error was raised", exc_info=True)


class Copier:
    """Which tensors a save streams through host buffers, and with what: device
    tensors (not CPU ones: those are lent to the upload as they are), through ``pool``
    (None: the process's :func:`shared_pool`). ``ops`` and ``every_tensor`` are for
    tests: other device steps, and CPU tensors taken through the pool as well."""

    def __init__(self, pool: PinnedPool | None = None, *, ops: DeviceOps | None = None,
                 every_tensor: bool = False) -> None:
        self.pool = pool
        self.ops = ops
        self.every_tensor = every_tensor

    def wants(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s bytes go through :meth:`chunks`."""
        return self.every_tensor or tensor.device.type not in ("cpu", "meta")

    def chunks(self, tensor: torch.Tensor) -> Generator[memoryview, None, None]:
        """The tensor's bytes in order (see :func:`to_host`)."""
        pool = self.pool or shared_pool()
        ops = self.ops or (HostOps() if self.every_tensor and tensor.device.type == "cpu"
                           else None)
        return to_host(tensor, pool, ops=ops)

    def to_device(self) -> ToDevice:
        """A :class:`ToDevice` for one load's destinations that :meth:`wants`."""
        return ToDevice(self.pool, ops=self.ops)

    def __getstate__(self) -> dict[str, Any]:
        # Another process uses its own shared pool: pinned memory stays where it is.
        return {**self.__dict__, "pool": None}
