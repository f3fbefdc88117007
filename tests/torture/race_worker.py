"""Writers the concurrency torture runs side by side, in forked processes.

Each returns ("won" | "lost", detail) through a queue; "lost" only for a
:class:`CommitConflictError`, anything else is reported as an error.
"""

from __future__ import annotations

import random
import traceback
from typing import Any

import torch

from cloudckpt import CheckpointWriter, CommitConflictError, RecoverSlot

BARRIER_TIMEOUT = 60.0


def content(who: str, n: int = 6) -> dict[str, bytes]:
    """What writer ``who`` puts: the same names for every writer, different bytes."""
    rng = random.Random(who)
    return {f"obj-{i}.bin": rng.randbytes(rng.randrange(1_000, 120_000)) for i in range(n)}


def _report(queue: Any, who: str, fn: Any) -> None:
    try:
        queue.put((who, "won", fn()))
    except CommitConflictError as exc:
        queue.put((who, "lost", str(exc)))
    except BaseException:
        queue.put((who, "error", traceback.format_exc()))


def write_checkpoint(uri: str, opts: dict[str, Any], who: str, barrier: Any, queue: Any) -> None:
    """Start together with the other racers; write the same names, commit."""

    def run() -> str:
        barrier.wait(BARRIER_TIMEOUT)
        with CheckpointWriter(uri, metadata={"who": who}, storage_options=opts) as w:
            w.put_many(content(who))
        return who

    _report(queue, who, run)


def commit_only(uri: str, opts: dict[str, Any], who: str, files: dict[str, tuple[int, str]],
                barrier: Any, queue: Any) -> None:
    """Commit objects already in place (as ROLL's last uploader does), all at once."""

    def run() -> str:
        w = CheckpointWriter(uri, metadata={"who": who}, storage_options=opts)
        for name, (size, crc) in files.items():
            w.add_existing(name, size, crc)
        barrier.wait(BARRIER_TIMEOUT)
        w.commit()
        return who

    _report(queue, who, run)


def save_slot(uri: str, opts: dict[str, Any], who: str, value: float, barrier: Any,
              queue: Any) -> None:
    """Save into one slot; every racer waits before the pointer swap, so all swap
    against the same pointer version."""
    real_swap = RecoverSlot._swap

    def swap_together(self: RecoverSlot, *a: Any, **k: Any) -> None:
        barrier.wait(BARRIER_TIMEOUT)
        real_swap(self, *a, **k)

    RecoverSlot._swap = swap_together  # type: ignore[method-assign]

    def run() -> str:
        return RecoverSlot(uri, storage_options=opts).save(
            {"w": torch.full((1024,), value)}, extra={"who": who}, rng=False)

    _report(queue, who, run)


def own_prefix(root: str, opts: dict[str, Any], who: str, n: int, barrier: Any,
               queue: Any) -> None:
    """Write ``n`` checkpoints below a prefix of one's own, next to other writers."""

    def run() -> int:
        barrier.wait(BARRIER_TIMEOUT)
        for step in range(n):
            with CheckpointWriter(f"{root}/{who}/step-{step}", step=step,
                                  storage_options=opts) as w:
                w.put_many(content(f"{who}-{step}", 3))
        return n

    _report(queue, who, run)


def zombie(uri: str, opts: dict[str, Any], who: str, rounds: Any, stop: Any,
           barrier: Any, queue: Any, incremental: bool = True) -> None:
    """Writer A of a save (incremental or full): claims ``uri``, then keeps writing the
    same names with new bytes (``rounds`` counts them) while another writer takes its
    claim over and commits; once ``stop`` is set, tries to commit (and must lose)."""
    from cloudckpt.core.blobs import BlobArea
    from cloudckpt.storage import open_store

    def run() -> str:
        area = BlobArea(open_store(uri, opts).ancestor(1)) if incremental else None
        w = CheckpointWriter(uri, metadata={"who": who}, storage_options=opts, blobs=area)
        n = 0
        while not stop.is_set():
            w.put_many(content(f"{who}-{n}"))
            n += 1
            with rounds.get_lock():
                rounds.value = n
        w.commit()
        return who

    _report(queue, who, run)
