"""Ranks of tests/test_multipart.py: a multi-part save with a handler of the test's
own (as a framework would add one), on real gloo process groups."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cloudckpt import open_store
from cloudckpt.core.manifest import Written
from cloudckpt.errors import StorageError
from cloudckpt.runtime import coordination as coord
from cloudckpt.training import multipart


@dataclass
class Shards:
    """Each rank writes its own shard; rank ``fail_on`` fails before writing."""

    fail_on: int | None = None

    def write(self, store: Any, group: Any) -> list[Written]:
        def mine() -> Written:
            rank = coord.rank(group)
            if rank == self.fail_on:
                raise StorageError(f"rank {rank}: the disk went away")
            info = store.put(f"shards/{rank}.bin", bytes([rank]) * (rank + 1))
            return multipart.entry(store, info.key, info.size, info.crc32c)

        return coord.each_rank(mine, group)

    def commit(self, writer: Any, written: list[Written]) -> None:
        multipart.Stored(written).commit(writer, None)


def save(rank: int, world: int, uri: str, options: dict, fail_on: int | None) -> Any:
    store = open_store(uri, options)
    parts = [Shards(fail_on), multipart.SharedBytes("shared.json", lambda: b'{"n": 1}')]
    try:
        ckpt = multipart.save(store, parts, step=3, kind="test-parts")
    except Exception as exc:  # noqa: BLE001 - the test compares every rank's error
        return ("raised", type(exc).__name__, str(exc))
    return ("committed", None if ckpt is None else sorted(ckpt.files))
