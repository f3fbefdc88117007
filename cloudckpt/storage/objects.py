"""What a store says of an object, and the small helpers every module of the
storage layer shares on listings and batches of keys."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class ObjectInfo:
    """What the store knows about one object. ``version`` is the CAS token."""

    key: str
    size: int
    crc32c: str | None = None
    version: str | None = None
    mtime: float | None = None


def mtime_of(raw: Mapping[str, Any]) -> float | None:
    """The modification time in a filesystem's listing entry, whatever it calls it."""
    for k in ("mtime", "LastModified", "last_modified", "updated", "created"):
        v = raw.get(k)
        if v is None:
            continue
        if isinstance(v, (int, float)):
            return float(v)
        if hasattr(v, "timestamp"):
            return float(v.timestamp())
        if isinstance(v, str):
            from datetime import datetime

            try:
                return datetime.fromisoformat(v.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
    return None


def chunks(seq: list[T], n: int) -> Iterable[list[T]]:
    for i in range(0, len(seq), n):
        yield seq[i : i + n]
