"""DCP's on-store names, ``.metadata`` loaded safely, and the items' checksums.

``.metadata`` is a pickle; it is unpickled with an allowlist of DCP's own types
(:mod:`cloudckpt.serialization.dcpmeta`), so nothing in a checkpoint can execute
code when it is read.
"""

from __future__ import annotations

import base64
import struct
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

from cloudckpt.core import kinds
from cloudckpt.errors import CorruptCheckpointError
from cloudckpt.serialization.dcpmeta import unpickle_metadata

METADATA_NAME = ".metadata"
SUFFIX = ".distcp"
DCP_KIND = kinds.DCP


def load_metadata(data: bytes, *, source: str = METADATA_NAME) -> Metadata:
    """Unpickle DCP metadata without executing anything outside DCP's own types."""
    try:
        md = unpickle_metadata(data)
    except Exception as exc:  # noqa: BLE001 - any failure means: do not trust it
        raise CorruptCheckpointError(
            f"{source} is not safe DCP metadata ({exc}); refusing to load it", {source: str(exc)}
        ) from None
    if not isinstance(md, Metadata):
        raise CorruptCheckpointError(f"{source} does not hold DCP Metadata", {source: "type"})
    return md


def file_ends(md: Metadata) -> dict[str, int]:
    """Each file ``md`` names (its path relative to the checkpoint), with the end of its
    last item: how long the file must at least be."""
    ends: dict[str, int] = {}
    for info in (md.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0),
                                       info.offset + info.length)
    return ends


def missing_files(md: Metadata, sizes: Mapping[str, int], prefix: str = ""
                  ) -> dict[str, str]:
    """The files ``md`` names that ``sizes`` (key -> size; keys are ``prefix/`` and the
    relative path) lacks or holds too short to cover their items: ``{key: "missing"}``
    or ``{key: "short: N of M bytes"}``. Empty when a load would find every item."""
    out = {}
    for rel, end in file_ends(md).items():
        key = f"{prefix}/{rel}" if prefix else rel
        if key not in sizes:
            out[key] = "missing"
        elif sizes[key] < end:
            out[key] = f"short: {sizes[key]} of {end} bytes"
    return out


# ------------------------------------------------------------ item checksums
# The manifest records a CRC32C per DCP item, so a ranged read of one item is
# checked on its own. There are items x ranks of them (2.2 million for a 70B model
# with Adam on 1,024 ranks), so each file's are packed into one string: base64 of
# (offset: u64 little-endian, CRC32C: 4 bytes) per item, 16 characters an item.
_ITEM = struct.Struct("<Q4s")


def pack_item_crcs(items: Iterable[tuple[str, int, str]]) -> dict[str, str]:
    """``(file, offset, crc32c hex)`` per item -> the manifest's ``item_crcs``."""
    per_file: dict[str, list[bytes]] = defaultdict(list)
    for path, offset, crc in items:
        per_file[path].append(_ITEM.pack(offset, bytes.fromhex(crc)))
    return {path: base64.b64encode(b"".join(packed)).decode() for path, packed in
            sorted(per_file.items())}


class ItemCrcs:
    """The CRC32C of each item, from a DCP manifest's metadata (packed ``item_crcs``);
    each file's are unpacked when first asked for."""

    def __init__(self, dcp_metadata: Mapping[str, Any] | None) -> None:
        meta = dcp_metadata or {}
        packed = (meta.get("item_crcs") if isinstance(meta, Mapping) else meta) or {}
        if not isinstance(packed, Mapping):  # a manifest's metadata is read as hostile
            raise CorruptCheckpointError(
                f"the manifest's item checksums are malformed ({type(packed).__name__}, not "
                "an object of packed checksums per file); the checkpoint cannot be trusted",
                {"item_crcs": "malformed"})
        self._packed: Mapping[str, Any] = packed
        self._files: dict[str, dict[int, str]] = {}

    @classmethod
    def of(cls, items: Iterable[tuple[str, int, str]]) -> ItemCrcs:
        """The checksums of ``(file, offset, crc32c hex)`` items known already (read from
        the records of an indexed checkpoint rather than from its manifest)."""
        out = cls(None)
        for path, offset, crc in items:
            out._files.setdefault(path, {})[offset] = crc
        return out

    def get(self, path: str, offset: int) -> str | None:
        if path not in self._files:
            self._files[path] = self._unpack(path)
        return self._files[path].get(offset)

    def _unpack(self, path: str) -> dict[int, str]:
        packed = self._packed.get(path)
        if not packed:
            return {}
        try:
            if not isinstance(packed, str):
                raise ValueError(f"{type(packed).__name__}, not base64 text")
            raw = base64.b64decode(packed, validate=True)
            return {off: crc.hex() for off, crc in _ITEM.iter_unpack(raw)}
        except (ValueError, struct.error) as exc:
            raise CorruptCheckpointError(f"the manifest's item checksums of {path} are "
                                         f"malformed ({exc})", {path: "item checksums"}) from None
