"""One coordinated save of several parts into one checkpoint.

Every save that more than one rank (or more than one kind of object) goes into
runs the same four steps: rank 0 claims the prefix (:func:`claim`), each rank
writes its share of every part, rank 0 commits the root manifest once every part
is durable, and on any failure the claim is abandoned, marked, so that what was
written stays provably cloudckpt's for the next save or ``gc``. :func:`save`
runs them through :mod:`cloudckpt.runtime.coordination`, so a failure on any
rank raises on every rank and nothing is committed.

What goes into the checkpoint is a list of :class:`Part` handlers: a DCP state
(:class:`DcpPart`), each rank's own bytes (:class:`RankBytes`), bytes rank 0
writes at commit (:class:`SharedBytes`), files already stored (:class:`Stored`).
A framework adds its own handler by implementing the two methods.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

from cloudckpt import dcp
from cloudckpt.core.blobs import BlobArea
from cloudckpt.core.checkpoint import Checkpoint, CheckpointWriter
from cloudckpt.core.deletion import remove_leftovers
from cloudckpt.errors import IncompleteCheckpointError
from cloudckpt.runtime import coordination as coord
from cloudckpt.runtime import interrupts
from cloudckpt.storage import Store

log = logging.getLogger("cloudckpt")

#: An object a part stored: its key (relative to the checkpoint), size and CRC32C; in
#: an incremental save, the digest of the blob holding it; and whether it went to the
#: save's writer area (see :func:`entry`; left out, it did when it is no blob and the
#: save writes its objects there: a part writes through the store it is given).
Entry = (tuple[str, int, str] | tuple[str, int, str, str | None]
         | tuple[str, int, str, str | None, bool])


def entry(store: Store, key: str, size: int, crc32c: str, blob: str | None = None) -> Entry:
    """The :class:`Entry` of an object a part wrote through ``store`` (the one its
    :meth:`Part.write` was given): moved when not a blob and ``store`` keeps its
    objects in a writer area."""
    return key, size, crc32c, blob, blob is None and store.written_under is not None


class Part(Protocol):
    """One piece of a multi-part save."""

    def write(self, store: Store, group: Any) -> Any:
        """Write this rank's share below ``store`` (called on every rank, in order);
        what it returns on rank 0 is passed to :meth:`commit`. ``store`` may keep its
        objects in the save's writer area (see :func:`save`): write through it, and
        record what it wrote with :func:`entry`."""

    def commit(self, writer: CheckpointWriter, written: Any) -> None:
        """On rank 0, once every part is written: add this part to the manifest."""


def claim(store: Store, group: Any = None, **writer_options: Any) -> CheckpointWriter | None:
    """Make ``store`` ready for a multi-part save, agreed on every rank.

    On rank 0: a :class:`CheckpointWriter` for the root manifest (``writer_options``
    go to it) claims the prefix before any rank writes, so whatever a crash leaves
    there is provably cloudckpt's; leftovers of an earlier save that never
    committed are deleted (they are invisible to every reader, and in the way of
    the parts' create-only commits). Returns that writer on rank 0, None elsewhere.

    Raises the same error on every rank when the prefix cannot be used: a
    checkpoint is committed there (:class:`~cloudckpt.errors.CommitConflictError`),
    another live save holds it, or it holds data that is not an unfinished save of
    cloudckpt's (:class:`~cloudckpt.errors.NotACheckpointError`).
    """

    def prepare() -> CheckpointWriter:
        # The writer refuses a committed prefix, and its claim one that holds a root or
        # objects cloudckpt did not write; what the claim listed are the leftovers.
        writer = CheckpointWriter(store, **writer_options)
        try:
            found = writer.claim()
            assert found is not None
            removed = remove_leftovers(store, (o.key for o in found.objects))
            if removed:
                log.warning("replaced the uncommitted leftovers of an earlier save at %s "
                            "(%d objects)", store.uri, len(removed))
        except BaseException:
            writer.abandon()
            raise
        return writer

    return coord.on_coordinator(prepare, group, share=False)


def commit(writer: CheckpointWriter, parts: Sequence[Part], written: Sequence[Any]
           ) -> Checkpoint:
    """Rank 0: add every part to the root manifest, then commit it."""
    for part, result in zip(parts, written, strict=True):
        part.commit(writer, result)
    return writer.commit()


@interrupts.watching()
def save(store: Store, parts: Sequence[Part], *, group: Any = None,
         deadline: float | None = None, **writer_options: Any) -> Checkpoint | None:
    """Claim ``store``, write ``parts`` on every rank, commit on rank 0; call on every
    rank. Returns the checkpoint on rank 0, None elsewhere. If any rank fails, every
    rank raises, nothing is committed, and the claim is abandoned (marked).

    ``deadline`` (a ``time.monotonic()`` on rank 0) refuses a commit after it with
    :class:`~cloudckpt.errors.IncompleteCheckpointError`: a save that ran out of time
    stays invisible. ``writer_options`` go to :func:`claim`.

    When rank 0's claim was not fresh (it took a claim over, or retries), every part
    is given a view of ``store`` that keeps its objects in rank 0's writer area (see
    :class:`~cloudckpt.core.checkpoint.CheckpointWriter`), so that the writer it took
    over from cannot overwrite them.
    """
    claimed = claim(store, group, **writer_options)
    area = coord.on_coordinator(lambda: claimed.moving if claimed else None, group)
    target = store if area is None else store.writing_under(area)

    def finish() -> Checkpoint | None:
        if claimed is None:
            return None
        if deadline is not None and time.monotonic() > deadline:
            raise IncompleteCheckpointError(
                f"{store.uri} was written {time.monotonic() - deadline:.1f} s after its "
                "deadline; it is not committed (invisible), the previous checkpoint stays "
                "the newest")
        return commit(claimed, parts, written)

    try:
        written = [part.write(target, group) for part in parts]
        return coord.on_coordinator(finish, group, share=False)
    except BaseException:
        if claimed is not None:
            claimed.abandon()  # the claim stays, marked: the leftovers remain provably ours
        raise


@interrupts.watching()
def drive(store: Store, parts: Sequence[tuple[str, Callable[[str], Any]]],
          shared: Mapping[str, bytes | Callable[[], bytes]], **writer_options: Any
          ) -> Checkpoint:
    """One save that a driver process commits and worker groups fill: the driver
    claims ``store``; each ``(prefix, save)`` of ``parts`` is called with the URI of
    its prefix, where that group's workers commit their own part; then the driver
    writes ``shared`` (bytes, or a callable giving them, called after every part) and
    commits, adding the parts. Any failure abandons the claim and raises."""
    writer = claim(store, **writer_options)
    assert writer is not None  # the driver is its own coordinator
    try:
        for prefix, save_part in parts:
            save_part(store.child(prefix).uri)
        blobs = {key: data() if callable(data) else data for key, data in shared.items()}
        for prefix, _ in parts:
            writer.add_part(prefix)
        for key, data in blobs.items():
            writer.put(key, data)
        return writer.commit()
    except BaseException:
        writer.abandon()
        raise


# ------------------------------------------------------------------ the handlers


@dataclass
class DcpPart:
    """A state dict saved with DCP below ``prefix`` (a committed sub-checkpoint)."""

    prefix: str
    state: Mapping[str, Any]
    step: int | None = None
    #: Passed on to :func:`cloudckpt.dcp.save`.
    options: Mapping[str, Any] = field(default_factory=dict)

    def write(self, store: Store, group: Any) -> None:
        dcp.save(dict(self.state), store.child(self.prefix), process_group=group,
                 step=self.step, **self.options)

    def commit(self, writer: CheckpointWriter, written: None) -> None:
        writer.add_part(self.prefix)


@dataclass
class RankBytes:
    """Each rank's own bytes, at ``key(rank)`` (or, with ``blobs``, a blob there)."""

    key: Callable[[int], str]
    data: bytes
    blobs: BlobArea | None = None

    def write(self, store: Store, group: Any) -> list[Entry]:
        def mine() -> Entry:
            key = self.key(coord.rank(group))
            if self.blobs is None:
                info, digest = store.put(key, self.data), None
            else:
                digest, info = self.blobs.put_many(store, {key: self.data})[key]
            assert info.crc32c is not None
            return entry(store, key, info.size, info.crc32c, digest)

        return coord.each_rank(mine, group)

    def commit(self, writer: CheckpointWriter, written: list[Entry]) -> None:
        Stored(written).commit(writer, None)


@dataclass
class SharedBytes:
    """Bytes rank 0 writes at commit, after every other part: ``data`` is called
    there (and only there), or is the bytes themselves."""

    key: str
    data: bytes | Callable[[], bytes]

    def write(self, store: Store, group: Any) -> None:
        return None

    def commit(self, writer: CheckpointWriter, written: None) -> None:
        writer.put(self.key, self.data() if callable(self.data) else self.data)


@dataclass
class Stored:
    """Objects already in the checkpoint, each with its size and CRC32C (see
    :data:`Entry`)."""

    entries: Iterable[Entry]

    def write(self, store: Store, group: Any) -> None:
        return None

    def commit(self, writer: CheckpointWriter, written: Any) -> None:
        for key, size, crc, *rest in self.entries:
            blob = cast("str | None", rest[0]) if rest else None
            moved = cast(bool, rest[1]) if len(rest) > 1 else (
                blob is None and writer.moving is not None)
            writer.add_existing(key, size, crc, blob, moved)
