"""Byte streams between ranks over a gloo process group, in bounded chunks.

A node's checkpoint is copied to a partner rank on another node (and fetched back
after the node is lost) over the job's own connections: no storage service, no
port of its own. One :func:`exchange` is a round in which every rank sends at most
one stream and receives at most one, so a ring of partners moves in one round, and
every rank posts its sends and receives before it waits on either (no pair of
blocking sends can wait on each other).

Each stream is a header (the receiver's description of what follows) and a body of
known size, sent in chunks of at most :data:`CHUNK` bytes through one reused
pair of buffers a side: memory stays bounded whatever the checkpoint's size. Each side keeps
two chunks in flight, so reading and writing overlap the wire. A side that
fails midway goes on with the exchange (zeros out, or discarding what comes in),
so its peer is never left waiting; the error is raised once the round is over.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

#: Bytes moved per message. Gloo's loopback and TCP transfers reach their speed well
#: below this; four such buffers a rank (two to send, two to receive) bound the memory
#: of a round.
CHUNK = 8 << 20


class Sink(Protocol):
    """Where a received body goes: ``write`` each piece in order, then ``close``."""

    def write(self, data: memoryview) -> None: ...

    def close(self) -> None: ...


@dataclass
class Stream:
    """What a rank sends: ``header`` (bytes for the receiver), then ``size`` bytes
    that ``pieces`` yields in order (any sizes, adding up to ``size``)."""

    header: bytes
    size: int
    pieces: Callable[[], Iterator[memoryview]]


def exchange(send_to: int | None, stream: Stream | None, recv_from: int | None,
             sink_for: Callable[[bytes], Sink] | None, group: Any = None,
             chunk: int = CHUNK) -> None:
    """One round: send ``stream`` to group rank ``send_to`` and receive a stream from
    ``recv_from``, handing its body to ``sink_for(header)`` (either side None: no send,
    no receive). Every rank of the round must call it with matching pairs. Raises the
    first error of this side (a read, the sink) after the round completed."""
    import torch

    if (send_to is None) != (stream is None) or (recv_from is None) != (sink_for is None):
        raise ValueError("exchange: a peer needs its stream or sink, and the other way round")
    sizes = _swap(send_to, torch.tensor([len(stream.header), stream.size] if stream else [0, 0],
                                        dtype=torch.int64), recv_from,
                  torch.zeros(2, dtype=torch.int64), group)
    head_len, body = (int(v) for v in sizes.tolist()) if sizes is not None else (0, 0)
    header = _swap(send_to, torch.frombuffer(bytearray(stream.header), dtype=torch.uint8)
                   if stream and stream.header else None, recv_from,
                   torch.empty(head_len, dtype=torch.uint8) if head_len else None, group)
    error: BaseException | None = None
    sink: Sink | None = None
    if recv_from is not None and sink_for is not None:
        try:
            sink = sink_for(header.numpy().tobytes() if header is not None else b"")
        except Exception as exc:  # noqa: BLE001 - raised after the round
            error = exc
    body_error = _body(send_to, _Chunks(stream, chunk) if stream is not None else None,
                       recv_from, body, sink if error is None else None, group, chunk)
    error = error or body_error
    if sink is not None and error is None:
        try:
            sink.close()
        except Exception as exc:  # noqa: BLE001
            error = exc
    if error is not None:
        raise error


def _body(send_to: int | None, out: _Chunks | None, recv_from: int | None, body: int,
          sink: Sink | None, group: Any, chunk: int) -> BaseException | None:
    """Move the bodies: chunk ``i`` of each side in buffer ``i % 2``, so that the next
    chunk is read (sent) or on the wire (received) while this one is on the wire
    (written to the sink). Two messages a side at most are in flight, each with the tag
    of its buffer; all of them complete before it returns. The first error of this side."""
    import torch
    import torch.distributed as dist

    error: BaseException | None = None
    n_in = -(-body // chunk)
    inbufs = [torch.empty(min(chunk, body), dtype=torch.uint8) for _ in range(min(2, n_in))]
    sends: list[Any] = [None, None]
    recvs: list[Any] = [None, None]

    def post_recv(i: int) -> None:
        if i < n_in:
            n = min(chunk, body - i * chunk)
            recvs[i % 2] = dist.irecv(inbufs[i % 2][:n], group=group, group_src=recv_from,
                                      tag=1 + i % 2)

    if recv_from is not None:
        post_recv(0)
        post_recv(1)
    i = 0
    while (out is not None and not out.done) or (recv_from is not None and i < n_in):
        b = i % 2
        if out is not None and not out.done:
            if sends[b] is not None:
                sends[b].wait()
            sends[b] = dist.isend(out.next(b), group=group, group_dst=send_to, tag=1 + b)
            if out.error is not None and error is None:
                error = out.error
        if recv_from is not None and i < n_in:
            recvs[b].wait()
            if sink is not None and error is None:
                n = min(chunk, body - i * chunk)
                try:
                    sink.write(memoryview(inbufs[b][:n].numpy()))  # type: ignore[arg-type]  # numpy's stubs: a buffer from 3.12
                except Exception as exc:  # noqa: BLE001 - raised after the round
                    error = exc
            post_recv(i + 2)
        i += 1
    for w in sends:
        if w is not None:
            w.wait()
    return error


class _Chunks:
    """A stream's body cut into chunks, read into one reused buffer; a read that fails
    is recorded, and the rest of the body goes out as zeros."""

    def __init__(self, stream: Stream, chunk: int) -> None:
        import torch

        self.left = stream.size
        self.bufs = [torch.empty(min(chunk, stream.size), dtype=torch.uint8)
                     for _ in range(2 if stream.size > chunk else 1 if stream.size else 0)]
        self.pieces = stream.pieces()
        self.pending = memoryview(b"")
        self.error: BaseException | None = None

    @property
    def done(self) -> bool:
        return self.left == 0

    def next(self, which: int) -> Any:
        """The next chunk, read into buffer ``which`` (0 or 1; not in flight)."""
        buf = self.bufs[which]
        n = min(buf.numel(), self.left)
        view = memoryview(buf.numpy()).cast("B")  # type: ignore[arg-type]  # numpy's stubs: a buffer from 3.12
        filled = 0
        while filled < n:
            if self.error is not None:
                view[filled:n] = bytes(n - filled)
                break
            if not self.pending:
                try:
                    self.pending = next(self.pieces).cast("B")
                except StopIteration:
                    self.error = OSError(f"a stream ended {self.left - filled} bytes short")
                    continue
                except Exception as exc:  # noqa: BLE001 - recorded, zeros sent instead
                    self.error = exc
                    continue
            take = min(n - filled, len(self.pending))
            view[filled:filled + take] = self.pending[:take]
            self.pending = self.pending[take:]
            filled += take
        self.left -= n
        return buf[:n]


def _swap(send_to: int | None, out: Any, recv_from: int | None, into: Any, group: Any) -> Any:
    """Post this side's send and receive together, then wait for both; ``into``."""
    import torch.distributed as dist

    works: list[Any] = []
    if send_to is not None and out is not None and out.numel():
        works.append(dist.isend(out, group=group, group_dst=send_to))
    if recv_from is not None and into is not None and into.numel():
        works.append(dist.irecv(into, group=group, group_src=recv_from))
    for w in works:
        w.wait()
    return into if recv_from is not None else None
