"""What a DCP load reads: each requested item, and how items are grouped into requests.

An item (:class:`RequestedItem`) carries where it lies, the CRC32C its bytes must have and
what has arrived for it; :func:`coalesce` joins items lying close together in one
file into one ranged read, so a load makes few requests for many small items.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from cloudckpt.compat.torch_private import StorageInfo
from cloudckpt.dcp.devicecopy import ToDevice
from cloudckpt.errors import CorruptCheckpointError
from cloudckpt.serialization.records import SavedTensor
from cloudckpt.util.crc import Crc32c

#: Adjacent items closer than this are fetched with one ranged GET.
COALESCE_GAP = 1024 * 1024


@dataclass(eq=False)
class RequestedItem:
    """One requested item: where it is, its checksum, where it goes, what arrived."""

    req: ReadItem
    info: StorageInfo
    crc: str
    target: torch.Tensor | None  # None: a bytes item
    saved: SavedTensor | None = None
    head: bytes = b""  # the item's bytes before its tensor's (streamed items)
    tail: bytearray | None = None  # the item's bytes after its tensor's
    crcs: list[tuple[int, int] | None] = field(default_factory=list)  # per span
    raw: bytes | None = None  # a bytes item's bytes
    #: How the item's checked bytes reach a GPU destination (None: copied in place).
    to_device: ToDevice | None = None

    @property
    def path(self) -> str:
        return self.info.relative_path

    @property
    def fqn(self) -> str:
        return self.req.storage_index.fqn

    def verify(self, uri: str) -> None:
        """Check a streamed item's CRC32C from its head's and its spans' (in order)."""
        crc = Crc32c()
        crc.update(self.head)
        for got in self.crcs:
            assert got is not None
            crc.append(*got)
        if crc.hexdigest() != self.crc:
            raise self.corrupt(uri, crc.hexdigest())

    def corrupt(self, uri: str, actual: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"object {self.path!r} of {uri} is corrupt: item {self.fqn} at offset "
            f"{self.info.offset} has crc32c {actual}, manifest says {self.crc}. Fall back to "
            "an earlier checkpoint.", {self.path: f"crc32c mismatch in {self.fqn}"})


def split_range(start: int, end: int, chunk: int) -> list[tuple[int, int]]:
    """``[start, end)`` as about-equal ranges of about ``chunk`` bytes (at least one)."""
    n = max(1, round((end - start) / chunk))
    return [(start + (end - start) * i // n, start + (end - start) * (i + 1) // n)
            for i in range(n)]


def coalesce(items: Sequence[RequestedItem], limit: int
              ) -> list[tuple[str, int, int, list[RequestedItem]]]:
    """Items of one file closer than :data:`COALESCE_GAP` as one range of at most about
    ``limit`` bytes (one item may be longer): ``(path, start, end, members)``."""
    groups: list[tuple[str, int, int, list[RequestedItem]]] = []
    for item in sorted(items, key=lambda i: (i.path, i.info.offset)):
        end = item.info.offset + item.info.length
        if groups:
            path, start, last, members = groups[-1]
            if (path == item.path and item.info.offset - last <= COALESCE_GAP
                    and end - start <= limit):
                groups[-1] = (path, start, max(last, end), [*members, item])
                continue
        groups.append((item.path, item.info.offset, end, [item]))
    return groups


@dataclass(frozen=True)
class Prefetched:
    """A rank's plan data: the checked bytes of the shared small items it reads."""

    items: dict[MetadataIndex, bytes]


def raw_request(index: MetadataIndex) -> ReadItem:
    """A request for an item's stored bytes as they are (read whole, kept raw)."""
    return ReadItem(LoadItemType.BYTE_IO, index, torch.Size(), index, torch.Size(),
                    torch.Size())
